"""Issue 45: what a local job of replica groups listens on. With the Lighthouse on loopback, every socket
the groups' processes listen on (each group's store, torchft's Manager server, the quorum's gloo pairs)
is on 127.0.0.1: torchft alone would bind its Manager server, and torch a TCPStore master, on every
interface. The sockets are read from /proc (the processes' socket inodes, then /proc/net/tcp{,6})."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from ft_processes import group_env, lighthouse_on_loopback, records, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(150),
    pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ft_replica_groups.py")
LISTEN = "0A"  # the kernel's TCP_LISTEN


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # IPv6: four 32-bit words, each in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening(pid: int) -> list[str]:
    """``host:port`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as fh:
            for line in list(fh)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == LISTEN and inode in inodes:
                    host, port = local.split(":")
                    found.append(f"{_address(host)}:{int(port, 16)}")
    return found


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def test_the_reader_sees_a_socket_on_every_interface():
    # so that the job test below can fail: a socket on 0.0.0.0 in this process is found and is not loopback
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        mine = [a for a in listening(os.getpid()) if a.endswith(f":{port}")]
    assert mine == [f"0.0.0.0:{port}"] and not _loopback(mine[0])


def test_a_local_job_listens_on_loopback_only(tmp_path):
    lighthouse, url = lighthouse_on_loopback()
    procs = []
    log = {g: str(tmp_path / f"g{g}.jsonl") for g in (0, 1)}
    try:
        for g in (0, 1):
            # no advertise_host in the example: the default follows the Lighthouse's loopback URL
            command = [sys.executable, EXAMPLE, "--replica-group", str(g), "--lighthouse", url, "--steps", "500"]
            command += ["--step-sleep", "0.1", "--log", log[g]]
            with open(tmp_path / f"g{g}.out", "w") as out:
                procs.append(subprocess.Popen(command, env=group_env(), stdout=out, stderr=subprocess.STDOUT))
        wait_for(
            lambda: sum(r["committed"] and r["replicas"] == 2 for r in records(log[1])) >= 3,
            120,
            "3 committed steps with both groups",
            procs,
        )
        sockets = {proc.pid: listening(proc.pid) for proc in procs}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        lighthouse.shutdown()
    print(sockets)
    for pid, addresses in sockets.items():
        # the store, the Manager server and the quorum's gloo pair at least
        assert len(addresses) >= 3, sockets
        assert all(_loopback(a) for a in addresses), sockets
