"""Run one parameter-server process: ``python -m trainmesh.ps --bind tcp://127.0.0.1:5555 ...``.

The secret is read from an environment variable (``--secret-env``, default
``TRAINMESH_PS_SECRET``) or a 0600 file (``--secret-file``, ``TRAINMESH_PS_SECRET_FILE``, or
``DIR/secret`` with ``--dir``), never from the command line where ``ps`` would show it. Binding a
non-loopback address without one is refused; on loopback the server makes a random one, writes
it to that file (a new private temporary one without a path) and logs where. SIGTERM/SIGINT stop the server gracefully (a last
snapshot when durable); SIGKILL is what the WAL is for.
With ``--parent-pid`` the server also stops once that process is gone (no orphans). Prints ``READY <address>`` once serving.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch

from .auth import SECRET_ENV, SECRET_FILE_ENV, new_secret, read_secret_file, write_secret_file
from .durability import DURABILITY
from .server import ParameterServer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainmesh.ps", description="Run one trainmesh parameter server (see docs/parameter_server.md)."
    )
    parser.add_argument(
        "--bind",
        default="tcp://127.0.0.1:0",
        help="address to listen on (default: loopback, a free port; see READY line)",
    )
    parser.add_argument("--server-id", default=None, help="name in logs and replies (default: the address)")
    parser.add_argument(
        "--num-workers",
        type=_non_negative,
        default=0,
        help="workers expected in the clock table before they register (default 0)",
    )
    parser.add_argument("--durability", choices=DURABILITY, default="none")
    parser.add_argument("--dir", default=None, help="snapshot and write-ahead log directory")
    parser.add_argument("--snapshot-every", type=_positive, default=1000, help="updates between snapshots")
    parser.add_argument("--snapshot-every-s", type=float, default=30.0, help="seconds between snapshots")
    parser.add_argument(
        "--secret-env",
        default=SECRET_ENV,
        help=f"environment variable holding the shared secret (default {SECRET_ENV})",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help=f"0600 file holding the secret when the variable is unset (default: ${SECRET_FILE_ENV}, "
        "else DIR/secret with --dir); on loopback a missing file is created with a new secret",
    )
    parser.add_argument("--dead-after-s", type=float, default=10.0, help="silence after which a worker is dead")
    parser.add_argument(
        "--drop-dead-workers", action="store_true", help="sync pulls stop waiting for dead workers instead of failing"
    )
    parser.add_argument(
        "--parent-pid",
        type=_positive,
        default=None,
        help="stop (gracefully) once this process is gone, so a killed launcher leaves no orphans",
    )
    parser.add_argument(
        "--threads",
        type=_non_negative,
        default=1,
        help="torch intra-op threads for applying updates (default 1; 0 keeps torch's setting: OMP_NUM_THREADS, else one per core)",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie (exited, not yet reaped) is gone for our purposes
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def watch_parent(parent_pid: int, on_gone, interval_s: float = 1.0) -> threading.Thread:
    """Call ``on_gone()`` once ``parent_pid`` has exited (checked every ``interval_s``).

    When it is our actual parent, re-parenting (``os.getppid()`` changes) is the signal: it
    cannot be fooled by the pid being reused. Otherwise the pid itself is probed."""
    direct = os.getppid() == parent_pid

    def loop() -> None:
        while direct and os.getppid() == parent_pid or not direct and _process_alive(parent_pid):
            time.sleep(interval_s)
        logging.getLogger(__name__).warning("parent process %d is gone: stopping", parent_pid)
        on_gone()

    thread = threading.Thread(target=loop, name="ps-parent-watchdog", daemon=True)
    thread.start()
    return thread


def _secret(args: argparse.Namespace) -> bytes:
    """The secret given (variable, then file), else a new one written to a 0600 file (loopback only)."""
    from .transport import check_bind_address

    if os.environ.get(args.secret_env):
        return os.environ[args.secret_env].encode("utf-8")
    path = (
        args.secret_file or os.environ.get(SECRET_FILE_ENV) or (os.path.join(args.dir, "secret") if args.dir else None)
    )
    if path and os.path.lexists(path):
        return read_secret_file(path)
    check_bind_address(args.bind, None)  # off loopback the user must give the secret (clients elsewhere need it)
    secret = new_secret()
    if path and os.path.dirname(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    path = write_secret_file(secret, path)
    logging.getLogger(__name__).warning(
        "no secret in %s: made one for this server, in %s (mode 0600); give it to the job's processes as %s=%s",
        args.secret_env,
        path,
        SECRET_FILE_ENV,
        path,
    )
    return secret.encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s ps %(levelname)s %(message)s"
    )
    if args.durability != "none" and not args.dir:
        raise SystemExit(f"--durability {args.durability} needs --dir")
    from .transport import ZmqServerTransport

    if args.threads:
        # One thread by default: a server applies one request at a time, each a few small ops, and
        # torch's idle intra-op workers spin after every op. A hand-started server (no
        # OMP_NUM_THREADS=1 from LocalCluster) spent 0.75 ms of CPU per 1 MB push in a spinning
        # worker against 0.23 ms in the loop, and cut the 1 MB push rate 2.6x on 2 cores.
        torch.set_num_threads(args.threads)
    try:
        secret = _secret(args)
        transport = ZmqServerTransport(args.bind, secret=secret)
    except (ValueError, OSError) as error:
        raise SystemExit(f"trainmesh ps: {error}") from None
    try:
        server = ParameterServer(
            transport,
            server_id=args.server_id or transport.address,
            num_workers=args.num_workers,
            durability=args.durability,
            directory=args.dir,
            secret=secret,
            dead_after_s=args.dead_after_s,
            drop_dead_workers=args.drop_dead_workers,
            snapshot_every=args.snapshot_every,
            snapshot_every_s=args.snapshot_every_s,
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: server.stop())
        if args.parent_pid is not None:
            watch_parent(args.parent_pid, server.stop)
        print(f"READY {transport.address}", flush=True)
        server.serve_forever()
    finally:
        transport.close()
    return 0
