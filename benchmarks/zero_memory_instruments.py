"""zero_memory.py's memory instruments: the process's RSS high-water mark (``/proc/self/status``, reset
through ``clear_refs``) and the model state a rank holds, counted from the tensors themselves on either
side (trainmesh's parameters, gradients and optimizer state; DeepSpeed's, found by walking its ZeRO
optimizer). The script's docstring says what each figure counts.

It exists apart from the worker because it is the measuring, not the training.
"""

from __future__ import annotations


import torch
from torch import nn


# --------------------------------------------------------------------------- memory instruments
def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class StateCounter:
    """Bytes of distinct storages, by category; a storage is counted once, in the first category."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, t) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        local = getattr(t, "_local_tensor", None)
        t = local if local is not None else t
        if t.is_meta:
            return
        st = t.untyped_storage()
        self.bytes.setdefault(category, 0)
        if st._cdata in self.seen or st.nbytes() == 0:
            return
        self.seen.add(st._cdata)
        self.bytes[category] += st.nbytes()

    def add_bytes(self, category: str, n: int) -> None:
        self.bytes[category] = self.bytes.get(category, 0) + n

    def walk(self, category: str, obj, depth: int = 0, visited: set | None = None) -> None:
        """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts (no modules,
        no optimizers: those are counted as their own categories)."""
        visited = set() if visited is None else visited
        if id(obj) in visited or depth > 5:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(category, obj)
        elif isinstance(obj, (list, tuple, set)):
            for item in obj:
                self.walk(category, item, depth + 1, visited)
        elif isinstance(obj, dict):
            for item in obj.values():
                self.walk(category, item, depth + 1, visited)
        elif isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            return
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch", "trainmesh"):
            for item in vars(obj).values():
                self.walk(category, item, depth + 1, visited)


def count_trainmesh_state(model: nn.Module, optimizer) -> dict[str, int]:
    c = StateCounter()
    params = list(model.parameters())
    for p in params:
        c.add("params", p)
    for p in params:
        c.add("grads", p.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: the local optimizer
    for state in inner.state.values():
        for v in state.values():
            c.add("optimizer", v)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.gradient_as_bucket_view:
        # DDP's reducer keeps flat buckets (C++ only, not reachable here) besides every .grad
        c.add_bytes("grads", sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    c.walk("other", vars(optimizer))
    return c.bytes


def count_deepspeed_state(engine, base_optimizer) -> dict[str, int]:
    c = StateCounter()
    module = engine.module
    params = list(module.parameters())
    for p in params:
        c.add("params", getattr(p, "ds_tensor", None))  # stage 3: this rank's partition
        c.add("params", p.data)
    zero = engine.optimizer
    # stages 1/2 keep the bf16 params as views of flat buffers
    for flat in getattr(zero, "bit16_groups_flat", []) or []:
        c.add("params", flat)
    for group in base_optimizer.param_groups:  # fp32 master partitions: optimizer state in the paper
        for p in group["params"]:
            c.add("optimizer", p)
    for state in base_optimizer.state.values():
        for v in state.values():
            c.add("optimizer", v)
    for p in params:
        c.add("grads", p.grad)
    for group in base_optimizer.param_groups:
        for p in group["params"]:
            c.add("grads", p.grad)
    # reduce buckets, gradient partitions, averaged gradients: everything else the ZeRO optimizer holds
    c.walk("grads", vars(zero))
    return c.bytes
