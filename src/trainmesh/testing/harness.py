"""Run a function on N real processes (gloo on CPU; gloo and NCCL on GPUs), for tests (yours and ours).

Each process joins a real torch.distributed group through a file rendezvous (no port to
collide on), runs ``fn(*args, **kwargs)``, and sends back its return value. Any process
failing stops the others at once; a run past ``timeout`` is killed and reported, naming
the processes that were still running, so a hang costs seconds, not a CI run.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

# Processes are forked from one server that has already imported these (about 3 s of imports
# on a small CPU, paid once per caller instead of once per process); each child still imports
# ``fn``'s module itself, as a spawned one would. A module missing here is skipped by the server.
_PRELOAD = ["torch", "torch.distributed", "trainmesh", "transformers"]


class DistributedTestError(RuntimeError):
    """A process of a ``run_distributed`` job raised, died or hung."""


@dataclass
class _Outcome:
    ok: bool
    value: Any = None
    error: str = ""


def _worker(fn, rank, world_size, init_file, result_dir, args, kwargs, collective_timeout_s, env, backend):
    # A forkserver child starts with the server's environment, not the caller's: take the caller's
    # as it was at this call (a test's monkeypatched variables included), then the job's own.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        TRAINMESH_TIMEOUT_S=str(collective_timeout_s),
    )
    # A rank killed by a signal (SIGABRT from glibc finding its heap corrupted, SIGSEGV) leaves no
    # Python traceback; faulthandler writes every thread's stack to stderr first, which the caller's
    # log keeps: where the rank was is the first clue to what broke it.
    faulthandler.enable(all_threads=True)
    outcome = _Outcome(ok=False)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend != "gloo":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        from trainmesh import runtime

        runtime.initialize()  # adopts the group started above
        try:
            outcome = _Outcome(ok=True, value=fn(*args, **kwargs))
        finally:
            runtime.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        outcome = _Outcome(ok=False, error=traceback.format_exc())
    # Written whole, then renamed: the parent reads it while this process may still be exiting.
    path = _result_path(result_dir, rank)
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(outcome, fh)
    os.replace(path + ".tmp", path)


def _result_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.pkl")


def _read_outcome(result_dir: str, rank: int) -> _Outcome | None:
    """What ``rank`` left (whole: it is renamed into place), or None when it left nothing."""
    try:
        with open(_result_path(result_dir, rank), "rb") as fh:
            return pickle.load(fh)
    except FileNotFoundError:
        return None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 180.0,
    collective_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` processes; return each rank's result, in rank order.

    ``fn`` must be importable (a module-level function): processes start fresh (forked from a
    server that has imported torch and trainmesh, or spawned), never forked from the caller.
    ``device="cpu"`` (the default) runs on gloo with CUDA hidden, so a job computes the same on a
    machine with GPUs as on one without; ``device="cuda"`` joins gloo and NCCL
    (``"cpu:gloo,cuda:nccl"``), one GPU per process, and needs ``world_size`` GPUs.

    >>> def my_rank():
    ...     import trainmesh as tm
    ...     return tm.rank()
    >>> run_distributed(my_rank, world_size=2)   # doctest: +SKIP
    [0, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1. Received: world_size={world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda'. Received: device={device!r}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:  # NCCL refuses two ranks on one GPU
            raise ValueError(
                f"device='cuda' needs a GPU per process: world_size={world_size}, "
                f"GPUs visible: {torch.cuda.device_count()}"
            )
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    ctx = _context(device)
    child_env = dict(os.environ)
    if device == "cpu":
        # Hidden before the child's first CUDA call (torch reads it then, not at import), so a job
        # computes the same on a machine with GPUs as on one without.
        child_env["CUDA_VISIBLE_DEVICES"] = ""
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="trainmesh-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_file,
                    tmp,
                    args,
                    kwargs or {},
                    collective_timeout,
                    child_env,
                    backend,
                ),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if device == "cpu":
            # Hidden from the start: a child that asks torch about CUDA while it imports (a test
            # module's skip mark) would otherwise see the GPUs and then count none. The forkserver,
            # started by the first CPU call, keeps this environment for every child it forks.
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            for proc in procs:
                proc.start()
        finally:
            if hidden is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        first_failed = _wait(procs, timeout, tmp)
        return _collect(tmp, procs, first_failed)


def _context(device: str):
    """Forked from the preloaded server on CPU; spawned on CUDA, where the test module a child
    imports may ask torch about the GPUs before ``_worker`` runs and must see the caller's."""
    if device == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call), once
    return ctx


def _wait(procs, timeout: float, result_dir: str) -> list[int]:
    """Wait for every rank, or stop them all once one failed; return the ranks seen failing first
    (their peers' errors are usually consequences: a reset connection, a timed-out collective)."""
    deadline = time.monotonic() + timeout
    returned: set[int] = set()  # ranks that ended having returned their result
    first_failed: list[int] = []
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in procs]
        if all(code is not None for code in codes):
            return first_failed
        ended = [rank for rank, code in enumerate(codes) if code is not None and rank not in returned]
        # A rank that returned its result and then died at interpreter exit (a C++ thread torn down
        # with a collective still pending on a stalled peer aborts the process) has done its part;
        # its peers must not be cut short for it. A rank that raised exits cleanly, having written
        # its error: that is a failure, as a crash is.
        returned.update(rank for rank in ended if getattr(_read_outcome(result_dir, rank), "ok", False))
        failed = [rank for rank in ended if rank not in returned]
        if failed:
            first_failed = failed
            # One process failed: its peers may be blocked in a collective with it. Give them
            # a moment to write their own error, then stop them.
            time.sleep(2.0)
            break
        time.sleep(0.05)
    still_running = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(10)
    if still_running and time.monotonic() >= deadline:
        raise DistributedTestError(
            f"run_distributed timed out after {timeout:.0f}s; ranks {still_running} were still running"
        )
    return first_failed


def _collect(result_dir: str, procs, first_failed: list[int]) -> list[Any]:
    results, errors, summary = [], [], []
    for rank, proc in enumerate(procs):
        outcome = _read_outcome(result_dir, rank)
        first = " (failed first)" if rank in first_failed else ""
        if outcome is None:
            errors.append(f"rank {rank}: exited with code {proc.exitcode} and left no result")
            summary.append(f"rank {rank}{first}: exited with code {proc.exitcode}{_signal_name(proc.exitcode)}")
        elif outcome.ok:
            results.append(outcome.value)
        else:
            errors.append(f"rank {rank} raised:\n{outcome.error}")
            last_line = outcome.error.strip().splitlines()[-1] if outcome.error.strip() else "?"
            summary.append(f"rank {rank}{first}: {last_line[:300]}")
    if errors:
        # The summary comes last, so a log cut to its tail (a subprocess's stderr in a test report)
        # still shows every rank's end, and which one failed first: usually the cause.
        raise DistributedTestError("\n".join(errors) + "\nsummary:\n  " + "\n  ".join(summary))
    return results


def _signal_name(exitcode: int | None) -> str:
    """`` (SIGKILL)`` for a process ended by a signal (multiprocessing's negative exit codes)."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        return ""
