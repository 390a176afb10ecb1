"""Throughput and model FLOPs utilisation (MFU): what the step achieved against what the hardware can do.

* FLOPs per sample: torch's ``FlopCounterMode`` over one forward + loss + backward of a copy of the
  model on the meta device, at the first micro-batch's shapes, counted once. Meta tensors carry
  shapes only, so the count costs no compute, does not touch the real step (compiled regions,
  FSDP / DDP hooks, DTensor collectives), and counts model FLOPs: activation-checkpointing
  recomputation is not in it (that would be hardware FLOPs utilisation, not MFU).
* The peak: a short measured matmul probe (``trainmesh env --peak``, cached per device, dtype and
  thread count under the user's cache directory), or a figure the user states (``peak_flops=``).
  On CPU the probe uses every core of the node, so the peak is the node's; on a GPU it is one device's.
* MFU = FLOPs per sample x samples per second (the whole job) / (peak x number of peak units).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..runtime.cpu import cpu_kind
from .precision import DTYPES_BY_SHORT_NAME

__all__ = ["ThroughputMeter", "cached_peak_flops", "count_flops_per_sample", "measure_peak_flops", "meta_copy"]


# --- FLOPs per sample ---------------------------------------------------------------------
def meta_copy(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` on the meta device (its weights are not copied); None if it cannot be made."""
    try:
        memo: dict[int, Any] = {}
        for tensor in list(model.parameters()) + list(model.buffers()):
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        return copy.deepcopy(model, memo)
    except Exception:  # a model that cannot be deep-copied: no FLOP count, throughput only
        return None


def _to_meta(value: Any) -> Any:
    if torch.is_tensor(value):
        value = value.to_local() if hasattr(value, "to_local") else value  # this process's rows, no collective
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def count_flops_per_sample(
    meta_model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable, rows: int
) -> float | None:
    """Forward + loss + backward FLOPs of ``meta_model`` on (``inputs``, ``targets``), per row; None when
    the model cannot run on the meta device (data-dependent control flow, ``.item()`` in forward)."""
    from torch.utils.flop_counter import FlopCounterMode

    if rows < 1:
        return None
    try:
        inputs, targets = _to_meta(inputs), _to_meta(targets)
        with FlopCounterMode(display=False) as counter:
            loss = loss_fn(meta_model(inputs), targets)
            loss.backward()
        total = counter.get_total_flops()
    except Exception:
        return None
    return float(total) / rows if total > 0 else None


def tokens_per_sample(inputs: Any) -> int | None:
    """Tokens in one sample when the inputs are token ids (an integer tensor of rank 2), else None."""
    if isinstance(inputs, dict):
        inputs = inputs.get("input_ids")
    inputs = inputs.to_local() if hasattr(inputs, "to_local") else inputs
    if torch.is_tensor(inputs) and inputs.dim() == 2 and not inputs.is_floating_point():
        return int(inputs.shape[1])
    return None


# --- the peak ------------------------------------------------------------------------------
def _cache_file() -> Path:
    root = os.environ.get("TRAINMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "trainmesh"
    )
    return Path(root) / "peak_flops.json"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _device_name(device_type: str) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(device_type: str, dtype: torch.dtype) -> str:
    threads = _cpu_count() if device_type == "cpu" else 1
    # "|cpu-time": readings of the CPU-time probe; wall-clock readings of older versions are not reused.
    # The vector ISA torch uses (AVX2, AVX512, ...) and the CPU's bf16 kind (AMX, AVX512-BF16, ...): a
    # virtual machine's model name ("AMD EPYC", "Intel Xeon Processor") can be the same on CPUs whose
    # bf16 rates differ 400-fold, and a cache directory can move between them; torch's capability
    # alone says "AVX512" on AMX, AVX512-BF16 and plain AVX512 CPUs alike.
    cpu = f"|{torch.backends.cpu.get_cpu_capability()}|{cpu_kind()}|cpu-time" if device_type == "cpu" else ""
    return f"{device_type}|{_device_name(device_type)}|{str(dtype).removeprefix('torch.')}|units={threads}{cpu}"


def measure_peak_flops(
    dtype: torch.dtype = torch.bfloat16,
    *,
    device_type: str = "cpu",
    seconds: float = 2.0,
    sizes: tuple[int, ...] | None = None,
    save: bool = True,
) -> float:
    """The node's matmul ceiling in FLOP/s: the best rate seen in about ``seconds``; cached when ``save``.

    On CPU: one thread's rate per second of its own CPU time, times the node's cores. CPU time
    does not run while the thread is descheduled, so other programs on a shared machine cannot
    lower the reading (a wall-clock probe read 185-979 GFLOP/s on the same 2 cores under
    different loads), and one thread times cores is what perfect scaling would give: the ceiling
    is never understated, so an MFU against it is never flattered. On CUDA: wall time, synchronised,
    on sizes up to 8192 (a GPU reaches its ceiling only on large matmuls: an H100 read 2.4 TFLOP/s
    bf16 on the CPU's sizes, launch-bound, against ~800 on 8192) and enough matmuls per timing
    (~20 ms) that launch and synchronisation costs vanish.

    The sizes grow only while a matmul of the next size fits the time left: a dtype the hardware
    has no fast path for (bf16 on a CPU without AVX512-BF16 or AMX runs ~45x slower than fp32)
    would otherwise make a fixed 2048-wide probe take minutes instead of ``seconds``.
    """
    if dtype not in DTYPES_BY_SHORT_NAME.values():
        raise ValueError(f"dtype must be one of {list(DTYPES_BY_SHORT_NAME.values())}. Received: dtype={dtype!r}")
    device = torch.device("cuda") if device_type == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    on_cpu = device_type != "cuda"
    clock = time.thread_time if on_cpu else time.perf_counter
    if on_cpu:
        torch.set_num_threads(1)  # thread_time is the calling thread's: every FLOP must be its own

    def timed_mm(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
        if device_type == "cuda":
            torch.cuda.synchronize()  # time these matmuls only, not work queued before them
        start = clock()
        for _ in range(repeats):
            torch.mm(a, b)
        if device_type == "cuda":
            torch.cuda.synchronize()
        return clock() - start

    best, deadline, last = 0.0, time.perf_counter() + seconds, None
    try:
        ordered = sorted(sizes or ((256, 512, 1024, 2048) if on_cpu else (1024, 2048, 4096, 8192)))
        for index, size in enumerate(ordered):
            remaining = deadline - time.perf_counter()
            # One matmul of this size costs about (size / last size)^3 of the last one: stop when
            # the warm-up and a timed triple would not fit in what is left.
            if last is not None and 4 * last[1] * (size / last[0]) ** 3 > remaining:
                break
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            timed_mm(a, b, 1)  # warm-up: kernel choice, page faults, a GPU library's first call
            one = timed_mm(a, b, 1)  # the cost of one
            last = (size, max(one, 1e-9))
            until = time.perf_counter() + remaining / (len(ordered) - index)  # an equal share of what is left
            repeats = 3
            while True:
                elapsed = timed_mm(a, b, repeats)
                if elapsed > 0:
                    best = max(best, repeats * 2 * size**3 / elapsed)
                    repeats = max(3, min(1000, int(repeats * 0.02 / elapsed)))  # ~20 ms a timing
                if time.perf_counter() >= until:
                    break
    finally:
        torch.set_num_threads(threads)
    best *= _cpu_count() if on_cpu else 1
    if save:
        path = _cache_file()
        try:
            cached = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            cached = {}
        cached[_key(device_type, dtype)] = best
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return best


def cached_peak_flops(dtype: torch.dtype, device_type: str = "cpu") -> float | None:
    """The peak ``measure_peak_flops`` saved for this device, dtype and core count, or None."""
    try:
        return json.loads(_cache_file().read_text()).get(_key(device_type, dtype))
    except (OSError, ValueError):
        return None


def peak_units(device_type: str, world_size: int, local_world_size: int) -> int:
    """How many peaks the job has: one per node on CPU (the probe used every core), one per GPU."""
    return world_size if device_type != "cpu" else max(1, world_size // max(1, local_world_size))


# --- the meter ----------------------------------------------------------------------------
class ThroughputMeter:
    """Samples/s, tokens/s and MFU over the window since the last report (wall time, not one step's)."""

    def __init__(self, *, peak_flops: float | None, peak_units: int = 1, meta_model: nn.Module | None = None) -> None:
        self.peak_flops = peak_flops
        self.peak_units = peak_units
        self.flops_per_sample: float | None = None
        self.tokens_per_sample: int | None = None
        self._meta_model = meta_model  # dropped once counted
        self._window_start = time.perf_counter()

    @classmethod
    def for_job(
        cls,
        *,
        peak_flops: float | None,
        dtype: torch.dtype,
        device_type: str,
        world_size: int,
        local_world_size: int,
        meta_model: nn.Module | None,
    ) -> "ThroughputMeter":
        """The stated peak, else the probe's cached one for this device and dtype (None: no MFU, rates only)."""
        peak = peak_flops if peak_flops is not None else cached_peak_flops(dtype, device_type)
        return cls(
            peak_flops=peak, peak_units=peak_units(device_type, world_size, local_world_size), meta_model=meta_model
        )

    def observe(self, micro_batches: list, loss_fn: Callable) -> None:
        """Count FLOPs per sample on the first micro-batch seen (once; later calls return at once)."""
        if self._meta_model is None:
            return
        from .step import batch_rows, split_batch

        model, self._meta_model = self._meta_model, None
        inputs, targets = split_batch(micro_batches[0])
        self.tokens_per_sample = tokens_per_sample(inputs)
        self.flops_per_sample = count_flops_per_sample(model, inputs, targets, loss_fn, batch_rows(targets))

    def restart(self) -> None:
        self._window_start = time.perf_counter()

    def report(self, samples: float) -> dict[str, float]:
        """Rates for ``samples`` (the whole job's) processed since the previous report; starts the next window."""
        now = time.perf_counter()
        elapsed, self._window_start = max(now - self._window_start, 1e-9), now
        out = {"samples_per_s": samples / elapsed}
        if self.tokens_per_sample:
            out["tokens_per_s"] = out["samples_per_s"] * self.tokens_per_sample
        if self.flops_per_sample:
            out["model_flops_per_s"] = out["samples_per_s"] * self.flops_per_sample
            if self.peak_flops:
                out["mfu"] = out["model_flops_per_s"] / (self.peak_flops * self.peak_units)
        return out

    def progress_values(self, rates: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows next to the samples/s it already has."""
        shown = {}
        if "tokens_per_s" in rates:
            shown["tok/s"] = f"{rates['tokens_per_s']:.0f}"
        if "mfu" in rates:
            shown["mfu"] = f"{100 * rates['mfu']:.1f}%"
        return shown
