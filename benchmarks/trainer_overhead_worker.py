"""trainer_overhead.py's worker: every variant of one part (the Trainer, the hand-written loop, Accelerate,
Fabric) trained in the same processes, round after round in ``round_order``, each step timed (and the
Trainer's phases by a callback), the final parameters kept for the same-work check.

It exists apart from the script because it runs inside the measured processes, the script outside them.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
import warnings

import torch
import torch.distributed as torch_dist
from torch import nn

import trainmesh as tm
from trainmesh.trainer.callbacks import Callback

from trainer_overhead_setup import DDP_KWARGS, MULTI, SINGLE, build_model, make_data, round_order


class _PhaseClock(Callback):
    """Times the Trainer's steps from inside ``fit`` and hands control back between phases.

    A step is the time between two ``on_train_batch_end`` calls: the Trainer's batch fetch, hooks,
    forward/backward/step/zero_grad, loss bookkeeping and (when due) its loss all-reduce. The timed
    steps of a phase run between two barriers, as for the other variants. After a phase's last step
    the callback blocks (off the clock) until the main thread asks for the next phase.
    """

    def __init__(self, warmup: int, steps: int, phases: int):
        self.warmup, self.steps, self.phases = warmup, steps, phases
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.finished_phases: list[tuple[list[float], float]] = []  # (per-step seconds, barrier-to-barrier seconds)
        self._count, self._times, self._last, self._start = 0, [], 0.0, 0.0

    def _start_phase(self) -> None:
        self._count, self._times = 0, []
        if self.warmup == 0:
            torch_dist.barrier()
            self._last = self._start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._start_phase()

    def on_train_batch_end(self, step, logs=None):
        now = time.perf_counter()
        self._count += 1
        if self._count > self.warmup:
            self._times.append(now - self._last)
        if self._count == self.warmup:  # warmup over: start the clock with every process at the same point
            torch_dist.barrier()
            now = self._start = time.perf_counter()
        self._last = now
        if self._count == self.warmup + self.steps:
            torch_dist.barrier()  # the phase ends when the slowest process is done
            self.finished_phases.append((self._times, time.perf_counter() - self._start))
            self.done.release()
            self.go.acquire()  # paused here while the other variants run
            if len(self.finished_phases) < self.phases:
                self._start_phase()


class _TrainerRunner:
    """One ``Trainer.fit`` in a daemon thread, advanced one phase at a time by ``run_phase``."""

    def __init__(self, trainer: tm.Trainer, clock: _PhaseClock, data, batch: int):
        self.trainer, self.clock, self.error = trainer, clock, None
        self.thread = threading.Thread(target=self._fit, args=(data, batch), daemon=True)
        self.thread.start()

    def _fit(self, data, batch: int) -> None:
        self.clock.go.acquire()
        try:
            self.trainer.fit(data, epochs=1, batch_size=batch, shuffle=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            self.error = exc
        finally:
            self.clock.done.release()

    def _advance(self) -> None:
        self.clock.go.release()
        self.clock.done.acquire()
        if self.error is not None:
            raise RuntimeError("Trainer.fit failed in its benchmark thread") from self.error

    def run_phase(self) -> tuple[list[float], float]:
        self._advance()
        return self.clock.finished_phases[-1]

    def finish(self) -> None:
        self._advance()  # lets fit end its epoch (one all-reduce) while nothing else runs
        self.thread.join()


def worker(cfg: dict, part: str) -> dict:
    torch.set_num_threads(1)  # one core per process: 2 processes on 2 cores, no oversubscription
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    variants = SINGLE if part == "single" else MULTI
    x, y = make_data(cfg)
    batch, local = cfg["batch"], cfg["batch"] // world
    warmup, steps = cfg["warmup"], cfg["steps"]
    mse = nn.functional.mse_loss
    captured = io.StringIO()  # the Trainer prints its plan; keep it out of the table (it goes to the JSON)

    def slicer():
        """This process's rows of global batch k, as views: the cheapest honest input for a hand loop."""
        k = 0

        def next_batch():
            nonlocal k
            start = k * batch + rank * local
            k += 1
            return x[start : start + local], y[start : start + local]

        return next_batch

    raw, sides, runners = {}, {}, {}
    with contextlib.redirect_stdout(captured), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in variants:
            model = raw[name] = build_model(cfg["seed"])
            if name.startswith("trainmesh"):
                # the Trainer as users get it; the unchecked diagnostic makes no per-step collective (its
                # loss is reduced at the epoch's last step, one step in all its rounds)
                options = (
                    dict(nonfinite_loss=None, log_every_n_steps=10**9)
                    if name == "trainmesh-unchecked"
                    else dict(log_every_n_steps=1)
                )
                clock = _PhaseClock(warmup, steps, cfg["rounds"])
                trainer = tm.Trainer(
                    model,
                    torch.optim.SGD(model.parameters(), lr=cfg["lr"]),
                    mse,
                    progress=False,
                    callbacks=[clock],
                    **options,
                )
                runners[name] = _TrainerRunner(trainer, clock, (x, y), batch)
            elif name.startswith("hand-written"):  # one process: no wrapper at all (or DDP, the diagnostic)
                if name == "hand-written-ddp":
                    model = nn.parallel.DistributedDataParallel(model, **DDP_KWARGS)
                opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])

                def hand_step(inputs, targets, model=model, opt=opt):
                    mse(model(inputs), targets).backward()
                    opt.step()
                    opt.zero_grad()

                sides[name] = (hand_step, slicer())
            elif name == "accelerate":
                from accelerate import Accelerator
                from accelerate.utils import DistributedDataParallelKwargs

                accelerator = Accelerator(
                    cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**DDP_KWARGS)]
                )  # MULTI_CPU: adopts the gloo group from RANK/WORLD_SIZE
                assert accelerator.num_processes == world, accelerator.state
                acc_model, acc_opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=cfg["lr"]))

                def acc_step(inputs, targets, model=acc_model, opt=acc_opt, accelerator=accelerator):
                    accelerator.backward(mse(model(inputs), targets))
                    opt.step()
                    opt.zero_grad()

                sides[name] = (acc_step, slicer())
            elif name == "fabric":
                from lightning_fabric import Fabric
                from lightning_fabric.strategies import DDPStrategy

                fabric = Fabric(
                    accelerator="cpu", strategy=DDPStrategy(**DDP_KWARGS), devices=world, precision="32-true"
                )
                fabric.launch()  # processes exist (LOCAL_RANK set): starts none, adopts the group
                assert fabric.world_size == world and fabric.global_rank == rank
                fab_model, fab_opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=cfg["lr"]))

                def fab_step(inputs, targets, model=fab_model, opt=fab_opt, fabric=fabric):
                    fabric.backward(mse(model(inputs), targets))
                    opt.step()
                    opt.zero_grad()

                sides[name] = (fab_step, slicer())
        torch.set_num_threads(1)
        warning_texts = sorted({f"{w.category.__name__}: {w.message}" for w in caught})

        def run_phase(name: str) -> tuple[list[float], float]:
            if name in runners:
                return runners[name].run_phase()
            step, next_batch = sides[name]
            for _ in range(warmup):  # refill caches the other variants just evicted
                step(*next_batch())
            torch_dist.barrier()  # start the clock with every process at the same point
            times = []
            start = time.perf_counter()
            for _ in range(steps):
                t0 = time.perf_counter()
                step(*next_batch())  # fetching the batch is part of the cost
                times.append(time.perf_counter() - t0)
            torch_dist.barrier()  # the phase ends when the slowest process is done
            return times, time.perf_counter() - start

        times = {name: [] for name in variants}
        walls = {name: [] for name in variants}
        orders = []
        for r in range(cfg["rounds"]):
            order = round_order(variants, r)
            orders.append(order)
            for name in order:
                step_times, wall = run_phase(name)
                times[name].append(step_times)
                walls[name].append(wall)
        for runner in runners.values():
            runner.finish()
    threads = torch.get_num_threads()

    # Same seed, same batches, same number of steps: the parameters must match.
    reference = variants[0]
    with torch.no_grad():
        init = list(build_model(cfg["seed"]).parameters())
        diffs = {
            name: max((a - b).abs().max().item() for a, b in zip(raw[reference].parameters(), raw[name].parameters()))
            for name in variants
        }
        moved = max((a - b).abs().max().item() for a, b in zip(raw[reference].parameters(), init))
        finite = all(bool(torch.isfinite(p).all()) for m in raw.values() for p in m.parameters())
    return {
        "times": times,
        "walls": walls,
        "orders": orders,
        "max_abs_diff": diffs,
        "max_change_from_init": moved,
        "finite": finite,
        "trainer_output": captured.getvalue(),
        "warnings": warning_texts,
        "torch_threads": threads,
    }
