"""finetune.py's workers, run in the 4 processes ``run_distributed`` starts: ``memory_worker`` (one side in
fresh processes: peak RSS growth, live tensor bytes with a census of the peak's storages, what malloc holds
free, and one step's collectives counted at the dispatcher) and ``timing_worker`` (every timed side in the
same processes, rounds interleaved).

It exists apart from the script because it runs inside the measured processes, the script outside them.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import warnings

import torch

import finetune_sides
from finetune_sides import WORLD, LoopSide, build_side, token_data
from trainer_overhead import round_order  # rotating, reversing rounds, as the other step-time benchmarks

SMALL_COLLECTIVE = 1024  # bytes: control all-reduces (loss, flags) are below, gradient buckets far above


# --------------------------------------------------------------------------- workers
def _global_mean(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _malloc_free_bytes() -> int | None:
    """Bytes glibc malloc holds free in its arenas (``mallinfo2().fordblks``), or None off glibc."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


def _peak_census_class():
    """A ``LiveTensorBytes`` that also keeps, at its peak, the size of every live storage and the operator that
    reached it: what makes up a side's peak (gathered units, saved activations, loss buffers, optimizer state),
    read by size (a census, not names: storages carry none)."""
    from trainmesh.testing.memory import LiveTensorBytes

    class PeakCensus(LiveTensorBytes):
        census: tuple[str, list[int], list[tuple[int, str]]] = ("", [], [])
        op = "outside an operator"

        def track(self, storage):
            before, key = self.peak, storage._cdata
            counted = self._sizes.get(key)
            super().track(storage)
            size = self._sizes.get(key, 0)
            if size >= 2**20 and size != counted:  # which operator made (or resized) each large storage
                self._made = getattr(self, "_made", {})
                self._made[key] = self.op
            if self.live > before:  # a new peak: a copy of the sizes (a few hundred), sorted once at the end
                self.census = (self.op, list(self._sizes.values()), self._large())

        def _large(self) -> list[tuple[int, str]]:
            made = getattr(self, "_made", {})
            return [(n, made.get(k, "?")) for k, n in self._sizes.items() if n >= 2**20]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def reset_peak(self):
            super().reset_peak()
            self.census = (self.op, list(self._sizes.values()), self._large())

        def summary(self, top: int = 8) -> dict:
            """The peak's operator, its largest storage sizes (MiB x count), the rest, and the storages of at least
            1 MiB with the operator that made them (a storage FSDP2 resizes outside the dispatcher shows the last
            operator before it)."""
            op, sizes, large = self.census
            counts: dict[float, int] = {}
            for size in sorted(sizes, reverse=True):
                if size >= 2**18:
                    counts[round(size / 2**20, 2)] = counts.get(round(size / 2**20, 2), 0) + 1
            largest = sorted(counts.items(), reverse=True)[:top]
            shown = sum(mib * 2**20 * n for mib, n in largest)
            made = sorted(((round(n / 2**20, 2), by) for n, by in large), reverse=True)
            return {"op": op, "largest_mib_x_count": largest, "rest_bytes": sum(sizes) - shown, "made_by": made}

    return PeakCensus


def _rss_file_bytes() -> int:
    """Resident pages mapped from files (``RssFile``: code of the libraries a step first runs, e.g. libtorch's
    kernels): a fixed cost every side pays, in its RSS growth, that no tensor explains."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_worker(cfg: dict, side: str) -> dict:
    """One side in fresh processes: peak RSS growth and live tensor bytes over build + M steps, then the
    bytes of one more step's collectives, counted at the dispatcher."""
    import peft  # noqa: F401 - imports before the baseline: they are no side's cost
    import transformers  # noqa: F401

    import trainmesh  # noqa: F401
    from trainmesh.planner.collectives import CollectiveCounter, CollectiveLog
    from trainmesh.testing.rss import PeakRSSGrowth, current_rss_bytes, peak_rss_bytes

    class CallLog(CollectiveLog):
        def add(self, axis, kind, nbytes, count=1):
            super().add(axis, kind, nbytes, count)
            self.calls = getattr(self, "calls", []) + [(kind, int(nbytes))]

    if side.endswith("-notrim"):  # read by memory_trim at each step; these are fresh processes
        os.environ["TRAINMESH_MALLOC_TRIM"] = "0"
        side = side.removesuffix("-notrim")
    if side.endswith("-upcast"):
        finetune_sides.UPCAST_LOSS = True  # read by lm_loss, in finetune_sides
        side = side.removesuffix("-upcast")
    steps = cfg["mem_steps"]
    x, y = token_data(cfg["size"], steps + 1, cfg["seed"] + 1)
    batch = cfg["size"]["rows"] * WORLD
    out = {"rss_start": current_rss_bytes(), "rss_file_start": _rss_file_bytes()}
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakRSSGrowth() as growth, _peak_census_class()("cpu") as live:
            runner = build_side(cfg, side)
            out.update(
                live_after_build=live.live, live_peak_build=live.peak, rss_growth_build=peak_rss_bytes() - growth.start
            )
            live.reset_peak()
            runner.run(x[: steps * batch], y[: steps * batch])
        out.update(
            rss_growth=growth.bytes,
            live_peak=max(live.peak, out["live_peak_build"]),
            live_peak_steps=live.peak,
            malloc_free=_malloc_free_bytes(),
            rss_file_growth=_rss_file_bytes() - out["rss_file_start"],
            peak_census=live.summary(),
        )
        log = CallLog()
        with CollectiveCounter({}, log=log):
            runner.run(x[steps * batch :], y[steps * batch :])
    calls = getattr(log, "calls", [])
    out["collectives"] = {kind: sum(n for k, n in calls if k == kind) for kind in {k for k, _ in calls}}
    # ZeRO-3's gradients: its reduce-scatters, and the one flat all-reduce of a mostly frozen model's replicated
    # adapters (``_torch/replicated_grads.py``); DDP's: its bucket all-reduces
    grad_kinds = (
        ("reduce_scatter", "all_reduce") if side in ("tm-full", "tm-lora", "tm-lora-regather") else ("all_reduce",)
    )
    out["grad_bytes"] = sum(n for k, n in calls if k in grad_kinds and n > SMALL_COLLECTIVE)
    out["gather_bytes"] = sum(n for k, n in calls if k == "all_gather")
    out["vmhwm"] = peak_rss_bytes()
    return out


def timing_worker(cfg: dict) -> dict:
    """Every timed side in these processes, rounds interleaved."""
    import torch.distributed as dist

    sides, captured = {}, io.StringIO()
    with contextlib.redirect_stdout(captured), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for side in cfg["sides"]:
            sides[side] = build_side(cfg, side)
    per_phase = cfg["warmup"] + cfg["steps"]
    batch = cfg["size"]["rows"] * WORLD
    x, y = token_data(cfg["size"], cfg["rounds"] * per_phase, cfg["seed"] + 1)
    times = {side: [] for side in sides}
    losses = {side: [] for side in sides}
    orders = []
    for r in range(cfg["rounds"]):
        order = round_order(list(sides), r)
        orders.append(order)
        rows = slice(r * per_phase * batch, (r + 1) * per_phase * batch)  # every side sees the same batches
        for side in order:
            dist.barrier()  # every process starts the phase together
            with contextlib.redirect_stdout(captured):
                step_times, step_losses = sides[side].run(x[rows], y[rows])
            times[side].append(step_times[cfg["warmup"] :])  # a phase's first step carries fit's own set-up
            losses[side].append(step_losses)
    for side, runner in sides.items():
        if isinstance(runner, LoopSide):  # local losses -> global means (the Trainer reports global ones)
            losses[side] = [_global_mean(values) for values in losses[side]]
    threads = torch.get_num_threads()
    del sides
    return {
        "times": times,
        "losses": losses,
        "orders": orders,
        "threads": threads,
        "trainer_output": captured.getvalue()[-2000:],
    }
