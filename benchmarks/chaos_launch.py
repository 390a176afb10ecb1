"""chaos.py's launch of one faulted job: ``trainmesh run`` with restarts until it exits, the faults
injected from outside (SIGKILL, SIGSTOP and the SIGCONT once a peer has reported the hang), and the
job's processes found and stopped by pid.

It exists apart from the script because it is the process handling alone: what a run's result means
is ``chaos_analysis.py``'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from chaos_job import HANG_TIMEOUT_S, TIMEOUT_S

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chaos.py")  # the script, run with --worker


def _launch(out: str, ckpt: str, plan: dict, timeout_s: float, nproc: int) -> dict:
    """One `trainmesh run -n nproc` job (with restarts) until it exits; a stopped rank gets SIGCONT once a
    peer's CollectiveTimeoutError is in the job's stderr, or 2 collective timeouts after it stopped."""
    hang_timeout = HANG_TIMEOUT_S if plan["kind"] == "sigstop" else TIMEOUT_S
    cmd = [
        sys.executable,
        "-m",
        "trainmesh",
        "run",
        "-n",
        str(nproc),
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
        HERE,
        "--worker",
        "--out",
        out,
        "--ckpt",
        ckpt,
        "--fault",
        plan["kind"],
        "--fault-step",
        str(plan.get("step", 0)),
        "--fault-rank",
        str(plan["rank"]),
        "--phase",
        plan["phase"],
        "--fault-seed",
        str(plan["seed"]),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(TRAINMESH_TIMEOUT_S=str(hang_timeout), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    stopped_at, continued, continued_after = None, False, None
    with open(os.path.join(out, "stdout.txt"), "w") as so, open(os.path.join(out, "stderr.txt"), "w") as se:
        proc = subprocess.Popen(cmd, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                pid_file = os.path.join(out, "stopped.pid")
                if stopped_at is None and os.path.exists(pid_file):
                    stopped_at = time.monotonic()
                # Continued as soon as the hang is reported: waiting on to 2 timeouts held the agent that long in
                # its SIGTERM grace period for the stopped rank (~10 s a sigstop run), and proved nothing more.
                if (
                    stopped_at is not None
                    and not continued
                    and (time.monotonic() - stopped_at > 2 * hang_timeout or _hang_reported(out))
                ):
                    continued = _continue(pid_file)
                    if continued:  # seconds the rank stayed stopped (as seen by this loop)
                        continued_after = round(time.monotonic() - stopped_at, 1)
                if time.monotonic() - started > timeout_s:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # the agent and its workers (in sessions of their own)
                for pid in [*_descendants(proc.pid), proc.pid]:
                    _kill(pid)
                proc.wait()
    for pid in _worker_pids(out):  # e.g. a stopped rank the agent failed to end
        _kill(pid, only_if=HERE)
    with open(os.path.join(out, "stdout.txt")) as fh:
        stdout = fh.read()
    with open(os.path.join(out, "stderr.txt")) as fh:
        stderr = fh.read()
    return {
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
        "sigcont_sent": continued,
        "sigcont_after_s": continued_after,
        "stdout": stdout,
        "stderr": stderr,
    }


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _worker_pids(out: str) -> list[int]:
    pids = []
    for name in os.listdir(out):
        if name.startswith("log.rank"):
            with open(os.path.join(out, name)) as fh:
                pids += [int(line.split()[2]) for line in fh if line.startswith("PID ")]
    return pids


def _kill(pid: int, only_if: str | None = None) -> None:
    """SIGKILL ``pid`` (a process this driver started), if it still runs ``only_if`` (a script path)."""
    try:
        if only_if is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if only_if.encode() not in fh.read():
                    return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _hang_reported(out: str) -> bool:
    """A peer of the stopped rank has raised its CollectiveTimeoutError (printed to the job's stderr)."""
    try:
        with open(os.path.join(out, "stderr.txt")) as fh:
            return "CollectiveTimeoutError" in fh.read()
    except OSError:
        return False


def _continue(pid_file: str) -> bool:
    try:
        pid = int(open(pid_file).read())
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        if state == "T" and HERE in open(f"/proc/{pid}/cmdline").read():
            os.kill(pid, signal.SIGCONT)
            return True
    except (OSError, ValueError):
        pass
    return False
