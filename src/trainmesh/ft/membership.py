"""Which replica groups are in each step's quorum, and a group that left it named in the log.

A group that dies closes its sockets, and the survivors' all-reduce with it fails at once. A group that
is *stalled* (a SIGSTOPped process, a machine swapping, a hung kernel) closes nothing: the survivors'
all-reduce with it waits until ``ReplicaGroups.timeout_s``, fails, and the step does not commit. By then
the stalled group has sent the Lighthouse no heartbeat for longer than its heartbeat timeout (a stopped
process's heartbeat thread stops with it), so the next quorum forms without it and the survivors go on.
The survivors are therefore never stuck; a stalled group costs at most ``timeout_s`` plus one quorum.

torchft says none of this: its quorum result lists the replica ids in the quorum and nothing about who
left. ``QuorumWatch`` records each quorum's ids (it stands in for the Manager's client, forwarding every
call), and ``left`` compares one step's quorum with the previous one's, so that the survivors' log names
the group that left: its number, replica id, host and ranks, and what this group's last all-reduce with
it said (a time-out: stalled; a closed connection: dead).

A group's replica id carries its host (``replica_id_for``): the quorum result has no addresses, and the
log should say which machine to look at. torchft reads the group number from the trailing digits before
the ``:`` it appends, which this format keeps.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["replica_id_for", "LeftGroup", "QuorumWatch"]

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")
_ID = re.compile(r"^trainmesh_(?P<host>[A-Za-z0-9.-]*)_group_(?P<group>\d+)$")


def replica_id_for(group: int, host: str) -> str:
    """``trainmesh_<host>_group_<g>`` (characters other than letters, digits, ``.`` and ``-`` become ``-``:
    an IPv6 address's ``:`` would end torchft's id early)."""
    return f"trainmesh_{_UNSAFE.sub('-', host)}_group_{group}"


@dataclass(frozen=True)
class LeftGroup:
    """A group that was in the previous step's quorum and is not in this one."""

    replica_id: str  # torchft's, with its per-start uuid
    group: int | None  # None for a replica id not written by trainmesh
    host: str | None
    ranks: range | None  # its processes' ranks in the whole job (groups of equal size)

    def describe(self) -> str:
        where = f"host {self.host}" if self.host else "host unknown"
        ranks = f"job ranks {self.ranks.start}-{self.ranks.stop - 1}" if self.ranks is not None else "ranks unknown"
        name = f"replica group {self.group}" if self.group is not None else "a replica group"
        return f"{name} (replica id {self.replica_id}, {where}, {ranks})"


def _parse(replica_id: str, group_world: int) -> LeftGroup:
    match = _ID.match(replica_id.split(":", 1)[0])
    if match is None:
        return LeftGroup(replica_id, None, None, None)
    group = int(match["group"])
    return LeftGroup(replica_id, group, match["host"] or None, range(group * group_world, (group + 1) * group_world))


class QuorumWatch:
    """Stands in for a torchft Manager's client (``manager._client``: torchft exposes the quorum's replica
    ids nowhere else) and records the replica ids of each quorum it returns."""

    def __init__(self, manager: Any, group_world: int, *, announce: bool = True):
        self._client = manager._client
        self._group_world = group_world
        self._announce = announce  # one line per lost group: from the group's rank 0 only
        self.members: tuple[str, ...] = ()
        self._previous: tuple[str, ...] = ()
        self.last_error: str | None = None  # what this group's last failed all-reduce said
        self.last_error_after_s = 0.0
        manager._client = self

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.members = tuple(result.replica_ids)
        return result

    def __getattr__(self, name: str) -> Any:  # should_commit, _checkpoint_metadata: torchft's own
        return getattr(self._client, name)

    def note_error(self, error: BaseException | None, after_s: float) -> None:
        self.last_error = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0][:300]
        self.last_error_after_s = after_s

    def left(self, step: int) -> list[LeftGroup]:
        """The groups in the previous quorum and not in this one, each named once on stderr."""
        gone = [rid for rid in self._previous if rid not in self.members] if self.members else []
        if self.members:
            self._previous = self.members
        groups = [_parse(rid, self._group_world) for rid in gone]
        for group in groups if self._announce else ():
            print(f"[trainmesh] {group.describe()} left the quorum at step {step}: {self._cause()}", file=sys.stderr)
        sys.stderr.flush()
        return groups

    def _cause(self) -> str:
        if self.last_error is None:
            return "it stopped sending the Lighthouse heartbeats (dead or stalled before the step's all-reduce)"
        kind = "stalled: it stopped answering" if "timed out" in self.last_error.lower() else "dead or unreachable"
        return (
            f"{kind}; the last all-reduce with it failed after {self.last_error_after_s:.1f} s "
            f"({self.last_error}), and the Lighthouse no longer hears its heartbeats"
        )
