"""The ``ip`` commands the namespace hosts and their cluster share, the hosts' addressing, and the
cleanup of namespaces left behind by a process that died.

It exists apart from ``cluster.py`` so that ``Host`` (``netns_host.py``) and ``Cluster`` both use
these without importing each other.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

SUBNET = "198.18.0"
IFACE = "eth0"
# Namespace names carry the creating process's pid, so a later run can tell leftovers of a
# process that died (SIGKILL skips atexit) from a cluster another live process still uses.
_PREFIX = "tmc-"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]+-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by clusters whose creating process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed
