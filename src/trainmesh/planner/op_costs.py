"""Every op a step dispatches, with its FLOPs and bytes moved, and what it costs on a machine.

Matmul FLOPs alone miss most of a small or medium model's step on a CPU (and a good part of it on
a GPU): norms, activations, softmax, dropout, residual adds, casts, the optimizer's per-parameter
updates are memory-bound, and every op pays a fixed dispatch cost (Python, autograd, the
dispatcher; DTensor adds sharding propagation to each op it sees). ``OpProfile`` counts all of
them on the step the dry run really runs (a ``TorchDispatchMode`` over the fake step, the same
ops a real step dispatches), keyed by phase (forward, backward, optimizer) and by cost:

* ``flops``: the formula of ``torch.utils.flop_counter`` (``flops.op_flops``) on the local shards;
* ``bytes``: bytes the op reads and writes on this rank (its tensor inputs and outputs, local
  shards); a view moves nothing; an indexing op (embedding lookup) reads only what it returns;
* ``dtensor``: whether the op ran on DTensors (each pays sharding propagation on top);
* ``kind`` (``op_kind``): ``""`` for an op the roofline prices, else the name of a kind whose work
  neither a matmul's rate nor an add's bandwidth describes: fused attention (``"attention"``,
  ``"attention_backward"``: softmax, masking and rescaling between its matmuls, 2-3x a matmul of
  the same FLOPs on a CPU), and element-wise ops bound by their arithmetic, not their bytes
  (``exp``, ``_log_softmax``, ``silu``, ... : several times an add of the same bytes).

``price`` turns a profile into seconds with a ``Hardware``'s measured or published figures, one op
at a time, roofline style: ``max(flops / matmul rate at that size, bytes / bandwidth at that
size) + overhead``. The rates come from curves (``calibrate.py`` measures them on the machine,
``hardware.py`` holds published ones), so a small op is priced at what a small op gets. An op of
a kind the hardware has its own measured curve for (``Hardware.op_kind_curves``, probed by
``calibrate_op_kinds.measure_op_kind_curves``) is priced on that curve instead: attention's FLOPs at
attention's rate, an arithmetic-bound op's bytes at the rate that op moves them.

>>> import torch
>>> a, b = torch.ones(8, 16), torch.ones(16, 4)
>>> with OpProfile() as prof:
...     y = (a @ b).relu()
>>> prof.ops("forward"), prof.flops(), prof.bytes()
(2, 1024, 1152)
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .flops import op_flops

PHASES = ("forward", "backward", "optimizer")
# Ops that read only the rows they return from their (large) first input: pricing them by the
# whole table would charge a 100 MB embedding per lookup.
# Ops that return an alias without being marked as views (they never copy).
_ALIASING = {"_unsafe_view", "lift_fresh", "alias"}
_INDEXING = {"embedding", "index_select", "gather", "index", "take", "_embedding_bag"}
# Element-wise ops whose arithmetic (transcendentals, a row's reduction and rescaling) takes longer
# than moving their bytes on a CPU core; each is priced on its own probed curve where calibrated
# (in-place and foreach forms as the plain op: the same arithmetic per element).
ARITHMETIC_OPS = (
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "erf",
    "_softmax",
    "_log_softmax",
    "silu_backward",
    "gelu_backward",
    "sigmoid_backward",
    "tanh_backward",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
)


def op_kind(func) -> str:
    """How ``func`` is priced: ``"attention"`` / ``"attention_backward"`` (fused scaled-dot-product
    attention), the op's name for an arithmetic-bound element-wise op (``ARITHMETIC_OPS``), else ``""``."""
    name = func._opname
    if "scaled_dot_product" in name and "attention" in name:
        return "attention_backward" if name.endswith("backward") else "attention"
    if name.startswith("_foreach_"):
        name = name[len("_foreach_") :]
    if name.endswith("_") and name[:-1] in ARITHMETIC_OPS:  # in place: the same arithmetic
        name = name[:-1]
    return name if name in ARITHMETIC_OPS else ""


def _nbytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class OpProfile(TorchDispatchMode):
    """Counts ops while active; ``phase`` (set by the caller) files them. ``counts``:
    ``(phase, dtensor, flops, bytes, kind) -> number of ops`` (ops of one shape collapse into one key)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional", "prim"):
            # communication is priced by the alpha-beta model, per axis; prim.* are metadata queries
            # (FakeTensorMode asks for .device through them) that a real step does not dispatch
            return out
        leaves = tree_leaves((args, kwargs))
        dtensor = any(hasattr(t, "_local_tensor") for t in leaves)
        flops, moved, kind = 0, 0, ""
        if not func.is_view and func._opname not in _ALIASING:  # a view (detach, transpose) moves nothing
            local_args, local_kwargs, local_out = tree_map(
                lambda v: getattr(v, "_local_tensor", v), (args, kwargs, out)
            )
            flops = op_flops(func, local_args, local_kwargs, local_out)
            written = sum(_nbytes(t) for t in tree_leaves(out))
            read = written if func._opname in _INDEXING else sum(_nbytes(t) for t in leaves)
            moved = read + written
            kind = op_kind(func)
        self.counts[(self.phase, dtensor, int(flops), int(moved), kind)] += 1
        return out

    def ops(self, phase: str | None = None) -> int:
        return sum(n for (p, *_), n in self.counts.items() if phase in (None, p))

    def flops(self, phase: str | None = None) -> int:
        return sum(f * n for (p, _, f, _, _), n in self.counts.items() if phase in (None, p))

    def bytes(self, phase: str | None = None) -> int:
        return sum(b * n for (p, _, _, b, _), n in self.counts.items() if phase in (None, p))

    def scaled(self, factor: int, phases: Iterable[str] = ("forward", "backward")) -> "OpProfile":
        """A pipeline stage's profile for ``factor`` microbatches (one was run): forward and backward
        ops repeat per microbatch, the optimizer step does not."""
        out = OpProfile()
        for key, n in self.counts.items():
            out.counts[key] = n * factor if key[0] in phases else n
        return out

    def rows(self) -> list[list]:
        return [[p, d, f, b, n, k] for (p, d, f, b, k), n in sorted(self.counts.items(), key=lambda kv: str(kv[0]))]

    @classmethod
    def from_rows(cls, rows: list[list]) -> "OpProfile":
        """From ``rows()``; rows written before op kinds existed (5 fields) are of the roofline kind."""
        out = cls()
        for p, d, f, b, n, *kind in rows:
            out.counts[(p, bool(d), int(f), int(b), kind[0] if kind else "")] += int(n)
        return out


def rate_at(curve, size: float, default: float) -> float:
    """A rate (FLOP/s or bytes/s) for an op of ``size`` from a measured curve of ``(size, rate)``
    points, interpolated in log-size; flat beyond the ends. ``default`` when there is no curve."""
    if not curve:
        return default
    sizes = [s for s, _ in curve]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (s0, r0), (s1, r1) = curve[i - 1], curve[i]
    w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return r0 + w * (r1 - r0)


def price(profile: OpProfile, hardware) -> dict[str, float]:
    """Seconds per phase on ``hardware``: per op ``max(flops/rate, bytes/bandwidth) + overhead``, the
    rate or bandwidth of the op's own kind where ``hardware`` measured one (``op_kind_curves``)."""
    out = {p: 0.0 for p in PHASES}
    kind_curves = dict(getattr(hardware, "op_kind_curves", ()) or ())
    for (phase, dtensor, flops, moved, kind), n in profile.counts.items():
        own = kind_curves.get(kind) if kind else None
        flops_curve = own if own and kind.startswith("attention") else hardware.flops_curve
        bandwidth_curve = own if own and not kind.startswith("attention") else hardware.bandwidth_curve
        compute = flops / rate_at(flops_curve, flops, hardware.flops) if flops else 0.0
        memory = (
            moved / rate_at(bandwidth_curve, moved, hardware.memory_bandwidth)
            if moved and hardware.memory_bandwidth
            else 0.0
        )
        overhead = hardware.op_overhead + (hardware.dtensor_op_overhead if dtensor else 0.0)
        out[phase] = out.get(phase, 0.0) + n * (max(compute, memory) + overhead)
    return out


__all__ = ["OpProfile", "price", "rate_at", "op_kind", "ARITHMETIC_OPS", "PHASES"]
