"""Precision as a small object (Lightning's plugin idea): how to run forward, and whether
gradients need a loss scaler.

=============  ==============================  =================  ============
name           compute                         weights            loss scaler
=============  ==============================  =================  ============
fp32           fp32                            fp32               no
bf16-mixed     bf16 autocast                   fp32 (master)      no
fp16-mixed     fp16 autocast                   fp32 (master)      dynamic
bf16-true      bf16                            bf16               no
=============  ==============================  =================  ============

Under the mixed precisions, "weights" are the trainable ones. A model may keep frozen parameters in
16 bits (a bf16 or fp16 base under fp32 LoRA adapters): they stay as stored on every layout, never
upcast, and autocast casts the same matmuls as in one process (ZeRO gathers such a model as stored:
``_torch/zero.py``'s ``gather_dtype``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from ..runtime.cpu import cpu_kind, describe_cpu_kind
from .loss_scaler import DynamicLossScaler

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")


class Precision:
    name = "fp32"

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.scaler: DynamicLossScaler | None = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, batch: Any) -> Any:
        return batch


class MixedPrecision(Precision):
    """Autocast to ``dtype``; trainable parameters (the optimizer's master copy) stay fp32, frozen ones
    as stored."""

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu"):
        super().__init__(device_type)
        self.dtype = dtype
        self.name = "bf16-mixed" if dtype == torch.bfloat16 else "fp16-mixed"
        if dtype == torch.float16:
            self.scaler = DynamicLossScaler()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


class TrueBF16(Precision):
    """Everything in bf16: half the memory of fp32 weights, no master copy."""

    name = "bf16-true"

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16)

    def convert_input(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(torch.bfloat16) if batch.is_floating_point() else batch
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.convert_input(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.convert_input(v) for k, v in batch.items()}
        return batch


_COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


def compute_dtype(name: str) -> torch.dtype:
    """The dtype ``name``'s matmuls run in: the one whose peak an MFU must divide by."""
    if name not in _COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {PRECISIONS}. Received: precision={name!r}")
    return _COMPUTE_DTYPES[name]


# How ``trainmesh env --peak``, the peak cache and figure names call the dtypes a matmul peak is probed in.
DTYPES_BY_SHORT_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_short_name(dtype: torch.dtype) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the name ``DTYPES_BY_SHORT_NAME`` gives ``dtype``."""
    return next(name for name, known in DTYPES_BY_SHORT_NAME.items() if known == dtype)


def build_precision(name: str, device_type: str = "cpu") -> Precision:
    if name == "fp32":
        return Precision(device_type)
    if name == "bf16-mixed":
        return MixedPrecision(torch.bfloat16, device_type)
    if name == "fp16-mixed":
        return MixedPrecision(torch.float16, device_type)
    if name == "bf16-true":
        return TrueBF16(device_type)
    raise ValueError(f"precision must be one of {PRECISIONS}. Received: precision={name!r}")


# bf16 autocast casts every matmul's inputs; below this matmul speed-up over fp32 the casts eat the gain.
BF16_MIN_SPEEDUP = 1.5


def bf16_matmul_speedup(device_type: str = "cpu", size: int = 256) -> float:
    """How many times faster a bf16 matmul runs than an fp32 one here (best of a few, tens of ms).

    On a CPU it is hardware-dependent by more than an order of magnitude: AMX or AVX512-BF16 make
    bf16 2-4x faster than fp32, while on AVX2 alone torch falls back to a path ~45x slower.
    CPU time of this thread, so a busy machine does not tilt the comparison."""
    if device_type != "cpu":
        raise ValueError(f"bf16_matmul_speedup times CPU matmuls only. Received: device_type={device_type!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            torch.mm(a, b)
            times = []
            for _ in range(3):
                start = time.thread_time()
                torch.mm(a, b)
                times.append(time.thread_time() - start)
            best[dtype] = max(min(times), 1e-9)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def fastest_precision(device_type: str = "cpu") -> tuple[str, str]:
    """``(precision, why)``: "bf16-mixed" where bf16 matmuls pay on this device, "fp32" where they do not.

    On a CPU, the two kinds whose answer is known are not timed: AMX (bf16 on tile units) always
    pays, AVX2 alone (torch's ~45x slower fallback) never does. On AVX512, with or without BF16,
    and on CPUs torch reports no x86 features for, the gain varies by CPU and is measured
    (``bf16_matmul_speedup``, from ``BF16_MIN_SPEEDUP``)."""
    if device_type == "cuda":  # the GPU says whether it has bf16 units; where it has, they pay
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", "this GPU supports bf16"
        return "fp32", "this GPU does not support bf16"
    kind = cpu_kind()
    if kind == "amx":
        return "bf16-mixed", "this CPU has AMX: bf16 matmuls run on its tile units"
    if kind == "avx2":
        return "fp32", (
            "this CPU has AVX2 only (no AVX512-BF16 or AMX): torch has no native bf16 matmul "
            "on it, and its fallback runs ~45x slower than fp32"
        )
    speedup = bf16_matmul_speedup(device_type)
    named = describe_cpu_kind(kind)
    if speedup >= BF16_MIN_SPEEDUP:
        return "bf16-mixed", f"bf16 matmuls run {speedup:.1f}x fp32's speed here ({named})"
    return "fp32", (
        f"bf16 matmuls run at {speedup:.2g}x fp32's speed here ({named}; bf16-mixed pays from {BF16_MIN_SPEEDUP}x)"
    )
