"""Per-rank memory and step time of trainmesh ZeRO stages 0-3 against DeepSpeed ZeRO 1/2/3.

    pip install -e '.[bench]'      # includes deepspeed; see benchmarks/README.md for keeping torch
    python benchmarks/zero_memory.py [--nproc N] [--rounds R] [--steps S] [--mem-steps M]
                                     [--warmup W] [--systems trainmesh,deepspeed] [--stages 0,1,2,3]
                                     [--precision auto|fp32|bf16-mixed] [--json PATH] [--quick]

Every variant (a system at a stage) trains the same ~50M-parameter GPT-style transformer
(8 blocks, d_model 640, vocab 8192, seq 128) from the same seed on the same token batches, on N
(default 4) gloo CPU processes started with ``python -m torch.distributed.run --standalone``, in one
precision on both sides (``--precision``; ``auto``, the default, takes what
``trainmesh.trainer.precision.fastest_precision("cpu")`` picks, as the demo does: bf16-mixed where
bf16 matmuls pay, fp32 where they do not, e.g. on an AVX2-only CPU where they run ~0.02x fp32's speed):

* bf16-mixed: bf16 compute with fp32 master weights and fp32 Adam state on both sides, gradients
  reduced in bf16 on both sides at stages 1-3 (DeepSpeed's default communication dtype under bf16;
  trainmesh's reduce_dtype). trainmesh ``precision="bf16-mixed"``; DeepSpeed ``"bf16": {"enabled":
  True}`` (bf16 parameters and gradients, fp32 master partitions inside its ZeRO optimizer: the ZeRO
  paper's mixed precision).
* fp32: everything in fp32 on both sides, gradients reduced in fp32 (both sides' default).
  trainmesh ``precision="fp32"``; DeepSpeed without a ``bf16``/``fp16`` block (its fp32 path).

* trainmesh: ``tm.Trainer(model, Adam, loss, zero_stage=k, precision=..., progress=False)``
  (stage 0: DDP; 1-3: FSDP2 ``fully_shard``; stage 1 differs from 2 only under accumulation).
* DeepSpeed: ``deepspeed.initialize(model=..., optimizer=Adam, config={...precision block...,
  "zero_optimization": {"stage": k, ...}})`` with ``DS_ACCELERATOR=cpu``.

Each variant runs in its own fresh set of processes (peak memory needs a clean process), and the
variants are interleaved stage by stage (trainmesh-k, deepspeed-k, then the other order next round).
Per variant: M instrumented steps (memory), W untimed warmup steps, S timed steps.

Memory, per rank:

* ``peak live``: the most tensor bytes alive at once during the M instrumented steps
  (``trainmesh.testing.memory.LiveTensorBytes``). A ``TorchDispatchMode`` entered before the model is built sees every tensor an operator creates
  (also from C++, e.g. DDP's buckets), counts each storage once on creation and releases it with a
  weakref callback when it dies; ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates gathered
  parameters that way) is followed too. Not seen: scratch memory inside a kernel or a gloo thread.
* ``RSS delta``: ``VmHWM`` (high-water RSS, reset after setup through /proc/self/clear_refs) minus
  ``VmRSS`` after setup: what the OS saw the steps add. The allocator may reuse memory freed in setup
  without raising RSS, so this under-counts; it is a cross-check, the targets use ``peak live``.
* ``model state``: params + grads + optimizer state held by the rank, counted from the tensors
  themselves (local shards; each storage once, padding included) at the end of the optimizer
  update of the last instrumented step, when gradients and optimizer state both exist. Extra
  gradient storage a system keeps is counted as gradients (DDP's flat buckets, unreachable from
  Python, are added as their size when ``gradient_as_bucket_view`` is off; DeepSpeed's reduce
  buckets and gradient partitions are found by walking its ZeRO optimizer object).

Targets (issue 4): trainmesh model state within 10% of the ZeRO formula for what it stores;
peak memory (``peak live``) <= DeepSpeed's at every stage; step time <= DeepSpeed's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn import functional as F

from trainmesh.runtime.host_allocator import host_malloc_setting
from trainmesh.testing.memory import LiveTensorBytes
from trainmesh.testing.stats import ci95

FULL_MODEL = {"vocab": 8192, "d_model": 640, "n_layer": 8, "n_head": 10, "seq": 128}
QUICK_MODEL = {"vocab": 4096, "d_model": 256, "n_layer": 4, "n_head": 4, "seq": 64}
MODEL_STATE_TOLERANCE = 0.10
LR = 1e-3


# --------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))  # trainmesh's shard units
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# What this benchmark changes from DeepSpeed's defaults, and why (printed with the results). Everything
# else, overlap_comm and contiguous_gradients included, is DeepSpeed's default for the stage
# (overlap_comm: off at stages 1-2, on at stage 3; the effective value is recorded per run).
# Both sides' processes run with the glibc malloc settings trainmesh.initialize applies on a CPU run
# (``trainmesh/runtime/host_allocator.py``: freed tensor memory is reused, not faulted in again each
# step); the DeepSpeed worker applies the same call before it starts, so the allocator is a setting
# both sides share, like the thread count. Recorded per variant as ``host_malloc``.
HOST_MALLOC = "the same glibc malloc settings on both sides (trainmesh/runtime/host_allocator.py)"
DS_CHANGES = {
    "reduce_bucket_size / allgather_bucket_size / stage3_prefetch_bucket_size": "set to trainmesh's largest FSDP unit of blocks at the stage (stages 1-2: blocks grouped up to 25 MB): the 5e8-element defaults would allocate a 1 GB bf16 (2 GB fp32) "
    "bucket per rank, 10x this model, and charge DeepSpeed's peak for an oversized buffer",
    "zero_allow_untested_optimizer": "the same torch.optim.Adam object trainmesh gets (not DeepSpeed's FusedAdam)",
}
# Per precision: DeepSpeed's precision block, trainmesh's gradient-reduction dtype at stages 1-3 and
# its settings that are not its defaults (with the reason; printed with the results), the ZeRO formula
# for that precision, and how closely the two systems' first-step losses (same model, seed and
# batches) must agree, else the two sides did different work and the comparison is INVALID.
PRECISIONS = {
    "bf16-mixed": {
        "ds_block": {"bf16": {"enabled": True}},
        "tm_reduce_dtype": "bf16",
        "tm_settings": {
            "reduce_dtype='bf16' (stages 1-3)": "DeepSpeed reduces gradients in communication_data_type, which defaults to bf16 under its bf16 "
            "config (engine.communication_data_type); trainmesh's default under bf16-mixed is fp32 (twice the "
            "bytes). Both sides reduce in bf16 here",
        },
        "zero_formula": "paper_2_2_12",
        # trainmesh autocasts over fp32 weights, DeepSpeed runs bf16 weights: bf16 rounding differs
        "loss_tolerance": 0.02,
        "what": "bf16 compute + fp32 master/Adam, gradients reduced in bf16",
    },
    "fp32": {
        "ds_block": {},  # no bf16/fp16 block: DeepSpeed's fp32 path; communication_data_type is then fp32
        "tm_reduce_dtype": None,  # FSDP2 reduces in the parameters' dtype, fp32
        "tm_settings": {},
        "zero_formula": "fp32_4_4_8",
        # The same fp32 weights, data and ops on both sides before the first update: the losses agree
        # to rounding (measured 5.6e-8 relative, one ulp, at every stage); 1e-5 leaves room for
        # summation order only, where any difference in the forward shows.
        "loss_tolerance": 1e-5,
        "what": "fp32 everything (params, grads, Adam m/v), gradients reduced in fp32",
    },
}


def choose_precision(requested: str) -> tuple[str, str]:
    """``(precision, why)``; ``auto`` asks the rule the demo uses (bf16 only where its matmuls pay)."""
    if requested != "auto":
        return requested, "given with --precision"
    from trainmesh.trainer.precision import fastest_precision

    precision, why = fastest_precision("cpu")
    return precision, f"auto: {why}"


def deepspeed_config(cfg: dict, stage: int, bucket: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}  # see DS_CHANGES
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket)
    return {
        "train_micro_batch_size_per_gpu": cfg["batch"] // cfg["nproc"],
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg["batch"],
        **PRECISIONS[cfg["precision"]]["ds_block"],
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def ds_bucket_elements(model: nn.Module, stage: int) -> int:
    """DeepSpeed's reduce / all-gather / prefetch bucket size, in elements. Its defaults (5e8) would
    allocate a 1 GB bf16 reduce bucket per rank at stage 3 (and in backward at stages 1-2), 10x this
    model; we give it the size of trainmesh's largest FSDP unit of blocks at that stage (a block at
    stage 3; at stages 1-2 on CPU processes trainmesh groups consecutive blocks up to 25 MB, see
    ``trainmesh._torch.zero.group_for_blocking_collectives``), or the largest single parameter if that
    is larger: the amount trainmesh reduce-scatters or gathers at once, so both sides reduce in
    buckets of the same size and neither is charged for an oversized buffer."""
    from trainmesh._torch.zero import group_for_blocking_collectives

    units = list(model.blocks)
    groups = group_for_blocking_collectives(units) if stage in (1, 2) else units

    def numel(unit):
        return sum(p.numel() for m in (unit if isinstance(unit, list) else [unit]) for p in m.parameters())

    return int(max(max(numel(g) for g in groups), max(p.numel() for p in model.parameters())))


def build_model(model_cfg: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same seed -> identical initial weights in every variant
    return GPT(**model_cfg)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Adam without weight decay (the same update as AdamW with weight_decay=0). Not AdamW: trainmesh's
    # zero_stage=1 rebuilds the optimizer from ``optimizer.defaults``, and AdamW's defaults hold
    # ``decoupled_weight_decay``, which AdamW.__init__ rejects (TypeError at Trainer construction).
    return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.0)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 loss on both sides (autocast would do this for cross_entropy; DeepSpeed's bf16 logits would not)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One distinct global batch per step; identical on every process (same generator seed)."""
    m = cfg["model"]
    steps = cfg["mem_steps"] + cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, m["vocab"], (steps * cfg["batch"], m["seq"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


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


# --------------------------------------------------------------------------- the worker (one variant)
def _barrier_time() -> float:
    torch_dist.barrier()
    return time.perf_counter()


def worker(cfg: dict, variant: str, out_path: str) -> None:
    system, stage = variant.rsplit("-", 1)
    stage = int(stage)
    torch.set_num_threads(1)
    tracker = LiveTensorBytes()
    tracker.__enter__()  # before anything is built: every tensor of the run is seen from its creation
    x, y = make_data(cfg)
    model = build_model(cfg["model"], cfg["seed"])
    num_params = sum(p.numel() for p in model.parameters())
    info: dict = {"state_at_step": []}
    mem_steps, warmup, steps = cfg["mem_steps"], cfg["warmup"], cfg["steps"]
    total_steps = mem_steps + warmup + steps
    step_times: list[float] = []
    cpu_times: list[float] = []  # this process's CPU seconds per step (all its threads): work, not waiting
    losses: list[float] = []
    phase = {"step": 0}

    def end_memory_phase() -> None:
        info["peak_live"] = tracker.peak
        info["live_end"] = tracker.live
        info["vm_hwm_kb"] = proc_status_kb("VmHWM")
        tracker.__exit__(None, None, None)

    if system == "trainmesh":
        import trainmesh as tm
        from trainmesh.trainer.callbacks import Callback

        tm.initialize()
        rank, world = tm.rank(), tm.world_size()

        class Clock(Callback):
            def on_train_begin(self, logs=None):
                setup_done()

            def on_train_batch_begin(self, step, logs=None):
                self.t0 = _barrier_time()
                self.c0 = time.process_time()

            def on_train_batch_end(self, step, logs=None):
                cpu_times.append(time.process_time() - self.c0)
                step_times.append(_barrier_time() - self.t0)
                losses.append(float((logs or {}).get("loss", math.nan)))
                phase["step"] += 1
                if phase["step"] == mem_steps:
                    end_memory_phase()

        # Under bf16-mixed, gradients reduced in bf16 at stages 1-3, as DeepSpeed's default
        # communication_data_type does under its bf16 config (see PRECISIONS); stage 0 (DDP) reduces
        # autocast's fp32 gradients. Under fp32 both sides reduce in fp32, their defaults.
        reduce_dtype = PRECISIONS[cfg["precision"]]["tm_reduce_dtype"]
        distribution = tm.DataParallel(reduce_dtype=reduce_dtype) if stage and reduce_dtype else None
        trainer = tm.Trainer(
            model,
            make_optimizer(model),
            loss_fn,
            zero_stage=stage,
            distribution=distribution,
            precision=cfg["precision"],
            progress=False,
            callbacks=[Clock()],
        )
        optimizer, wrapped = trainer.optimizer, trainer.model

        def on_step(opt, *a):
            if phase["step"] < mem_steps:
                info["state_at_step"].append(count_trainmesh_state(wrapped, opt))

        optimizer.register_step_post_hook(on_step)
        info["wrapped"] = type(wrapped).__name__
        info["optimizer"] = type(optimizer).__name__
    else:
        import deepspeed

        from trainmesh.runtime.host_allocator import keep_freed_host_memory

        keep_freed_host_memory()  # the malloc settings tm.initialize gives trainmesh's side (see HOST_MALLOC)
        torch_dist.init_process_group("gloo")
        deepspeed.init_distributed(dist_backend="gloo")
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        base = make_optimizer(model)
        ds_config = deepspeed_config(cfg, stage, ds_bucket_elements(model, stage))
        info["ds_config"] = ds_config
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=base, config=ds_config)
        info["wrapped"] = type(engine).__name__
        info["optimizer"] = type(ds_opt).__name__
        info["ds_overlap_comm_effective"] = bool(engine.zero_overlap_comm())
        info["ds_contiguous_gradients_effective"] = bool(engine.zero_contiguous_gradients())
        info["ds_communication_data_type"] = str(engine.communication_data_type)
        info["deepspeed_version"] = deepspeed.__version__

        def on_step(opt, *a):
            if phase["step"] < mem_steps:
                info["state_at_step"].append(count_deepspeed_state(engine, base))

        base.register_step_post_hook(on_step)

    def setup_done() -> None:
        gc.collect()
        info["live_after_setup"] = tracker.live
        info["hwm_reset"] = reset_hwm()
        info["rss_after_setup_kb"] = proc_status_kb("VmRSS")
        tracker.reset_peak()
        if mem_steps == 0:
            end_memory_phase()

    if system == "trainmesh":
        trainer.fit((x, y), epochs=1, batch_size=cfg["batch"], shuffle=False)
    else:
        setup_done()
        local = cfg["batch"] // world
        for k in range(total_steps):
            t0 = _barrier_time()
            c0 = time.process_time()
            start = k * cfg["batch"] + rank * local
            loss = loss_fn(engine(x[start : start + local]), y[start : start + local])
            engine.backward(loss)
            engine.step()  # includes zero_grad
            mean = loss.detach().float().clone()
            torch_dist.all_reduce(mean)  # the same per-step loss all-reduce the Trainer does (log_every_n_steps=1)
            cpu_times.append(time.process_time() - c0)
            step_times.append(_barrier_time() - t0)
            losses.append(mean.item() / world)
            phase["step"] += 1
            if phase["step"] == mem_steps:
                end_memory_phase()

    state = info["state_at_step"][-1] if info["state_at_step"] else {}
    result = {
        "rank": rank,
        "world": world,
        "variant": variant,
        "num_params": num_params,
        "peak_live_bytes": info.get("peak_live"),
        "live_after_setup_bytes": info.get("live_after_setup"),
        "live_end_of_memory_steps_bytes": info.get("live_end"),
        "rss_after_setup_kb": info.get("rss_after_setup_kb"),
        "vm_hwm_kb": info.get("vm_hwm_kb"),
        "hwm_reset": info.get("hwm_reset"),
        "model_state": state,
        "model_state_bytes": sum(v for k, v in state.items() if k != "other"),
        "step_times_s": step_times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "wrapped": info.get("wrapped"),
        "optimizer": info.get("optimizer"),
        "ds_config": info.get("ds_config"),
        "host_malloc": host_malloc_setting(),
        "deepspeed_version": info.get("deepspeed_version"),
        "ds_overlap_comm_effective": info.get("ds_overlap_comm_effective"),
        "ds_contiguous_gradients_effective": info.get("ds_contiguous_gradients_effective"),
        "ds_communication_data_type": info.get("ds_communication_data_type"),
    }
    gathered = [None] * world
    torch_dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(gathered, fh)
    torch_dist.barrier()
    torch_dist.destroy_process_group()


# --------------------------------------------------------------------------- formulas and report
def formulas(num_params: int, n: int, stage: int) -> dict[str, float]:
    """Per-rank model-state bytes. ``paper``: 2P (bf16 params) + 2P (bf16 grads) + 12P (fp32 master,
    m, v), divided as ZeRO stage ``stage`` says. ``fp32``: the same for a system that keeps its
    parameters and gradients in fp32 (master = the parameters): 4P + 4P + 8P (m, v)."""
    p = float(num_params)
    paper = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]
    fp32 = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]
    return {"paper_2_2_12": paper, "fp32_4_4_8": fp32, "fp32_all_sharded": 16 * p / n}


def matching_formula(system: str, stage: int, precision: str = "bf16-mixed") -> tuple[str, str]:
    """Which formula describes what the system stores, and why. trainmesh stores the same under
    bf16-mixed and fp32 (fp32 parameters are its master copy; bf16 exists only under autocast)."""
    if system == "deepspeed":
        if precision == "fp32":
            return "fp32_4_4_8", (
                "fp32 params + fp32 grads + m/v"
                + (
                    "; stages 1-2 also keep an fp32 master partition (a clone, 4P/N) beside the fp32 params, and "
                    "stage 1 holds only the gradient partition, as stage 2 does"
                    if stage in (1, 2)
                    else ""
                )
            )
        return "paper_2_2_12", "bf16 params + bf16 grads + fp32 master/m/v (the paper's mixed precision)"
    if stage in (1, 2):
        return "fp32_all_sharded", (
            "fp32 params + grads + m/v, all sharded: FSDP2 keeps parameters sharded "
            "between steps at stages 1-2 too (gathered only from forward to backward)"
        )
    return "fp32_4_4_8", "fp32 params (the master copy) + fp32 grads + m/v (bf16 only under autocast)"


def summarize(runs: dict[str, list[list[dict]]], cfg: dict) -> dict:
    n = cfg["nproc"]
    settings = PRECISIONS[cfg["precision"]]
    zero_key, loss_tolerance = settings["zero_formula"], settings["loss_tolerance"]
    variants = {}
    for variant, rounds in runs.items():
        system, stage = variant.rsplit("-", 1)
        stage = int(stage)
        ranks = rounds[0]
        num_params = ranks[0]["num_params"]
        ms_bytes = [r["model_state_bytes"] for r in ranks]
        forms = formulas(num_params, n, stage)
        key, why = matching_formula(system, stage, cfg["precision"])
        # per step: the slowest rank (barrier-to-barrier, so all ranks agree closely); timed steps only
        timed, round_medians = [], []
        for ranks_r in rounds:
            per_step = [max(s) for s in zip(*(r["step_times_s"] for r in ranks_r))]
            timed.extend(per_step[cfg["mem_steps"] + cfg["warmup"] :])
            if per_step[cfg["mem_steps"] + cfg["warmup"] :]:
                round_medians.append(statistics.median(per_step[cfg["mem_steps"] + cfg["warmup"] :]))
        hwm_delta = [(r["vm_hwm_kb"] - r["rss_after_setup_kb"]) * 1024 for ranks_r in rounds for r in ranks_r]
        # CPU seconds per timed step, summed over the ranks (the work done, whatever the machine's load)
        skip = cfg["mem_steps"] + cfg["warmup"]
        cpu = [sum(s) for ranks_r in rounds for s in list(zip(*(r.get("step_cpu_s", []) for r in ranks_r)))[skip:]]
        variants[variant] = {
            "system": system,
            "stage": stage,
            "num_params": num_params,
            "peak_live_bytes_max_rank": max(r["peak_live_bytes"] for rr in rounds for r in rr),
            "peak_live_bytes_per_rank": [[r["peak_live_bytes"] for r in rr] for rr in rounds],
            "live_after_setup_bytes_max_rank": max(r["live_after_setup_bytes"] for rr in rounds for r in rr),
            "rss_hwm_delta_bytes_max_rank": max(hwm_delta),
            "rss_hwm_delta_bytes_per_rank": hwm_delta,
            "model_state_bytes_max_rank": max(ms_bytes),
            "model_state_bytes_per_rank": ms_bytes,
            "model_state_parts_rank0": ranks[0]["model_state"],
            "formulas_bytes": forms,
            "matching_formula": key,
            "matching_formula_why": why,
            "model_state_vs_matching": max(ms_bytes) / forms[key],
            "model_state_vs_paper": max(ms_bytes) / forms["paper_2_2_12"],
            # the ZeRO formula for the run's precision (the paper's 2+2+12 under bf16-mixed, 4+4+8 under fp32)
            "zero_formula": zero_key,
            "model_state_vs_zero_formula": max(ms_bytes) / forms[zero_key],
            "step_time_median_s": statistics.median(timed) if timed else math.nan,
            "step_times_s": timed,
            "step_time_round_medians_s": round_medians,
            "step_cpu_s_all_ranks_median": statistics.median(cpu) if cpu else math.nan,
            "first_loss": ranks[0]["losses"][0] if ranks[0]["losses"] else math.nan,
            "last_loss": ranks[0]["losses"][-1] if ranks[0]["losses"] else math.nan,
            "wrapped": ranks[0]["wrapped"],
            "optimizer": ranks[0]["optimizer"],
        }
    comparisons = []
    for stage in (1, 2, 3):
        a, b = variants.get(f"trainmesh-{stage}"), variants.get(f"deepspeed-{stage}")
        if a and b:
            peak = a["peak_live_bytes_max_rank"] / b["peak_live_bytes_max_rank"]
            pooled = a["step_time_median_s"] / b["step_time_median_s"]
            # Rounds are interleaved (the two systems back to back, order alternating): the spread of
            # the per-round ratios is the comparison's noise. Peak memory repeats exactly per round.
            per_round = [x / y for x, y in zip(a["step_time_round_medians_s"], b["step_time_round_medians_s"])]
            # The figure is the median of the per-round ratios: each compares steps taken minutes apart
            # under the same load. A ratio of pooled medians can pair one side's quiet round with the
            # other's loaded one (a full run read 0.599 pooled against per-round 0.919 / 0.912 / 0.599).
            step = statistics.median(per_round) if len(per_round) >= 2 else pooled
            same = abs(a["first_loss"] - b["first_loss"]) <= loss_tolerance * abs(b["first_loss"])
            comparisons.append(
                {
                    "stage": stage,
                    "peak_ratio": peak,
                    "peak_met": peak <= 1.0,
                    "same_work": same,
                    "first_loss_rel_diff": abs(a["first_loss"] - b["first_loss"]) / abs(b["first_loss"]),
                    "first_loss_tolerance": loss_tolerance,
                    "first_loss_trainmesh": a["first_loss"],
                    "first_loss_deepspeed": b["first_loss"],
                    "rss_delta_ratio": a["rss_hwm_delta_bytes_max_rank"] / b["rss_hwm_delta_bytes_max_rank"],
                    "step_ratio": step,
                    "step_ratio_pooled_medians": pooled,
                    "step_met": step <= 1.0,
                    "cpu_ratio": a["step_cpu_s_all_ranks_median"] / b["step_cpu_s_all_ranks_median"],
                    "step_ratio_per_round": per_round,
                    "step_ratio_round_ci95": ci95(per_round) if len(per_round) > 1 else None,
                }
            )
    state_checks = [
        {
            "variant": v,
            "ratio": s["model_state_vs_matching"],
            "formula": s["matching_formula"],
            "met": abs(s["model_state_vs_matching"] - 1) <= MODEL_STATE_TOLERANCE,
        }
        for v, s in variants.items()
        if s["system"] == "trainmesh"
    ]
    figures = {}
    for c in comparisons:
        figures[f"zero{c['stage']}_peak_vs_deepspeed"] = c["peak_ratio"]
        figures[f"zero{c['stage']}_step_vs_deepspeed"] = c["step_ratio"]
    for c in state_checks:
        stage = variants[c["variant"]]["stage"]
        if stage in (1, 2, 3):
            figures[f"zero{stage}_model_state_vs_formula"] = c["ratio"]
    return {
        "variants": variants,
        "comparisons": comparisons,
        "model_state_checks": state_checks,
        "figures": figures,
        "precision": cfg["precision"],
        "precision_why": cfg["precision_why"],
        "deepspeed_changes": DS_CHANGES,
        "trainmesh_settings": settings["tm_settings"],
        "valid": all(c["same_work"] for c in comparisons),
        "targets": {"model_state_within": MODEL_STATE_TOLERANCE, "peak_ratio_max": 1.0, "step_ratio_max": 1.0},
        "config": cfg,
        "torch_version": torch.__version__,
    }


def print_report(report: dict) -> None:
    cfg, mb = report["config"], 2**20
    vs = report["variants"]
    tag_of = {"fp32_4_4_8": "F", "fp32_all_sharded": "S", "paper_2_2_12": "Z"}
    any_v = next(iter(vs.values()))
    m = cfg["model"]
    print(
        f"GPT {any_v['num_params'] / 1e6:.2f}M params ({m['n_layer']} blocks, d {m['d_model']}, vocab {m['vocab']}, "
        f"seq {m['seq']}), {cfg['nproc']} processes (gloo, CPU), {PRECISIONS[cfg['precision']]['what']}, global batch "
        f"{cfg['batch']}, {cfg['rounds']} round(s) x ({cfg['mem_steps']} memory + {cfg['warmup']} warmup + "
        f"{cfg['steps']} timed steps), load avg {report['load_avg_1min']['before']:.2f} -> "
        f"{report['load_avg_1min']['after']:.2f}"
    )
    print(f"precision {cfg['precision']} on both sides ({cfg['precision_why']})")
    zero_key = PRECISIONS[cfg["precision"]]["zero_formula"]
    print(
        "MB per rank (max over ranks). model state = params + grads + optimizer state held; formula = the ZeRO "
        "formula for what that system stores (F: fp32 4P+4P+8P, S: fp32 all sharded, Z: paper 2P+2P+12P); "
        f"zero = the ZeRO formula for {cfg['precision']} ({tag_of[zero_key]})"
    )
    header = (
        f"{'variant':<13}{'params':>8}{'grads':>8}{'optim':>8}{'state':>8}{'formula':>10}{'ratio':>7}"
        f"{'zero':>8}{'peak live':>11}{'RSS delta':>11}{'step s':>8}{'loss 1st':>10}"
    )
    print(header)
    print("-" * len(header))
    tag = tag_of
    for name in sorted(vs, key=lambda v: (vs[v]["stage"], vs[v]["system"] != "trainmesh")):
        s = vs[name]
        parts = s["model_state_parts_rank0"]
        f = s["formulas_bytes"][s["matching_formula"]]
        print(
            f"{name:<13}{parts.get('params', 0) / mb:>8.1f}{parts.get('grads', 0) / mb:>8.1f}"
            f"{parts.get('optimizer', 0) / mb:>8.1f}{s['model_state_bytes_max_rank'] / mb:>8.1f}"
            f"{f / mb:>8.1f} {tag[s['matching_formula']]}{s['model_state_vs_matching']:>7.3f}"
            f"{s['formulas_bytes'][zero_key] / mb:>8.1f}{s['peak_live_bytes_max_rank'] / mb:>11.1f}"
            f"{s['rss_hwm_delta_bytes_max_rank'] / mb:>11.1f}{s['step_time_median_s']:>8.3f}{s['first_loss']:>10.4f}"
        )
    quick = " (--quick: smoke test, too few steps to judge)" if cfg["quick"] else ""
    for c in report["model_state_checks"]:
        print(
            f"model state {c['variant']}: {c['ratio']:.3f} x formula {c['formula']}, target within "
            f"{MODEL_STATE_TOLERANCE:.0%}: {'met' if c['met'] else 'NOT MET'}"
        )
    if report["comparisons"]:
        print(
            "trainmesh runs with its defaults" + (" except (change: reason):" if report["trainmesh_settings"] else "")
        )
        for key, why in report["trainmesh_settings"].items():
            print(f"  {key}: {why}")
        print("DeepSpeed runs with its defaults except (change: reason):")
        for key, why in report["deepspeed_changes"].items():
            print(f"  {key}: {why}")
        eff = {
            n: v[0][0].get("ds_overlap_comm_effective")
            for n, v in report["raw_per_rank"].items()
            if n.startswith("deepspeed")
        }
        print(f"  overlap_comm (DeepSpeed's default, effective): {eff}")
        comm = {
            n: v[0][0].get("ds_communication_data_type")
            for n, v in report["raw_per_rank"].items()
            if n.startswith("deepspeed")
        }
        print(f"  communication_data_type (DeepSpeed's default for the precision, effective): {comm}")
        malloc = sorted({r.get("host_malloc") for v in report["raw_per_rank"].values() for r in v[0]} - {None})
        print(f"both sides: {HOST_MALLOC}; effective: {malloc}")
    for c in report["comparisons"]:
        if not c["same_work"]:
            print(
                f"INVALID stage {c['stage']}: first losses differ ({c['first_loss_trainmesh']:.6f} vs "
                f"{c['first_loss_deepspeed']:.6f}, relative {c['first_loss_rel_diff']:.1e}, tolerance "
                f"{c['first_loss_tolerance']:g}): the sides did different work"
            )
        print(
            f"stage {c['stage']}: first-step losses {c['first_loss_trainmesh']:.6f} vs {c['first_loss_deepspeed']:.6f} "
            f"(relative {c['first_loss_rel_diff']:.1e}, must be <= {c['first_loss_tolerance']:g})"
        )
        print(
            f"stage {c['stage']}: peak live trainmesh/deepspeed = {c['peak_ratio']:.3f} (<= 1: "
            f"{'met' if c['peak_met'] else 'NOT MET'}; RSS delta ratio {c['rss_delta_ratio']:.3f}), step time "
            f"= {c['step_ratio']:.3f} (median of per-round ratios; of pooled medians "
            f"{c['step_ratio_pooled_medians']:.3f}){_interval(c.get('step_ratio_round_ci95'))} (<= 1: "
            f"{'met' if c['step_met'] else 'NOT MET'}; CPU seconds per step, all ranks: {c['cpu_ratio']:.3f}){quick}"
        )


def _interval(bounds) -> str:
    return f" [95% of rounds {bounds[0]:.3f}-{bounds[1]:.3f}]" if bounds else ""


# --------------------------------------------------------------------------- the driver
RETRIES: list[dict] = []  # failed attempts of this run, in the JSON as "retries"


def run_variant(variant: str, cfg: dict, tmp: str, timeout: float) -> list[dict]:
    out = os.path.join(tmp, f"{variant}.json")
    cfg_path = os.path.join(tmp, "cfg.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TRAINMESH_TIMEOUT_S="600")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(cfg["nproc"]),
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--cfg",
        cfg_path,
        "--out",
        out,
    ]
    started = time.time()
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 and os.path.exists(out):
            break
        tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip().splitlines()
        # Seen on the loaded shared machine: a rank aborting ("terminate called without an active
        # exception") in a run that otherwise completes. One fresh retry, said loudly and recorded.
        print(
            f"  {variant}: attempt {attempt} failed (exit {proc.returncode}): "
            f"{next((l for l in tail if 'terminate' in l or 'Error' in l), tail[-1] if tail else '')}",
            flush=True,
        )
        RETRIES.append({"variant": variant, "attempt": attempt, "exit": proc.returncode})
        if attempt == 2:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise RuntimeError(f"variant {variant} failed (exit {proc.returncode})")
    print(f"  {variant}: {time.time() - started:.1f} s", flush=True)
    with open(out) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="processes (world size), default 4")
    parser.add_argument("--rounds", type=int, default=1, help="times each variant is run (fresh processes), default 1")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 3; --quick 5)")
    parser.add_argument("--mem-steps", type=int, default=2, help="instrumented steps for memory (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps between memory and timed steps")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default 2 per process)")
    parser.add_argument("--systems", default="trainmesh,deepspeed")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="both sides' precision; auto (default): bf16-mixed where bf16 matmuls pay here, else fp32",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a small model, about a minute")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.cfg) as fh:
            worker(json.load(fh), args.worker, args.out)
        return 0

    cfg = {
        "nproc": args.nproc,
        "rounds": args.rounds,
        "steps": args.steps or (5 if args.quick else 3),
        "mem_steps": args.mem_steps,
        "warmup": args.warmup,
        "batch": args.batch or 2 * args.nproc,
        "seed": args.seed,
        "quick": args.quick,
        "model": QUICK_MODEL if args.quick else FULL_MODEL,
    }
    cfg["precision"], cfg["precision_why"] = choose_precision(args.precision)
    print(f"precision: {cfg['precision']} ({cfg['precision_why']})", flush=True)
    if cfg["batch"] % cfg["nproc"] or min(cfg["steps"], cfg["mem_steps"], cfg["rounds"]) < 1:
        parser.error("--batch must be a multiple of --nproc; --steps, --mem-steps, --rounds >= 1")
    systems = [s for s in args.systems.split(",") if s]
    stages = [int(s) for s in args.stages.split(",") if s]
    if "deepspeed" in systems:
        try:
            import deepspeed  # noqa: F401
        except ImportError as error:
            print(
                f"deepspeed is not importable ({error}); install it (see benchmarks/README.md) or pass "
                "--systems trainmesh",
                file=sys.stderr,
            )
            return 2
    # Stage by stage, the two systems back to back, the order alternating: drift hits both alike.
    schedule = []
    for r in range(cfg["rounds"]):
        for i, stage in enumerate(stages):
            pair = [f"{s}-{stage}" for s in systems if not (s == "deepspeed" and stage == 0)]
            schedule.extend(pair if (r + i) % 2 == 0 else pair[::-1])
    load_before = os.getloadavg()[0]
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="zero-memory-") as tmp:
        for variant in schedule:
            runs.setdefault(variant, []).append(run_variant(variant, cfg, tmp, timeout=900))
    report = summarize(runs, cfg)
    report["schedule"] = schedule
    report["retries"] = RETRIES
    report["raw_per_rank"] = runs  # every rank's own numbers, DeepSpeed's config and version included
    report["load_avg_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if report["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
