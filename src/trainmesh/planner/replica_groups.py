"""Planning a job of torchft replica groups (``trainmesh run --replica-groups G``): per-group memory.

Each replica group holds a whole replica of the model under the group's own layout (ZeRO, TP, ...), so a
process's memory is that of the group's layout on ``world_size / G`` processes, whatever ``G``: the plan
of one group is the plan of every process. What the groups add is one all-reduce a step across them:
each process averages the gradient it holds at the step (its ZeRO shard, or the whole gradient without
ZeRO) with the processes of the same group rank in the other live groups, through torchft's
``manager.allreduce`` (``ft/replica_groups.py``). A ring all-reduce of ``B`` bytes over ``G`` peers moves
``2 (G - 1) / G * B`` bytes a process.
"""

from __future__ import annotations

from typing import Any

from .report import format_bytes

__all__ = ["group_world_size", "replica_group_summary"]


def group_world_size(world_size: int, groups: int) -> int:
    """Processes in one replica group; a clear error where ``groups`` does not divide the world."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"--replica-groups must be a positive integer. Received: {groups!r}")
    if world_size % groups:
        raise ValueError(
            f"--replica-groups {groups} does not divide --world-size {world_size}: every replica group "
            f"runs the same layout on the same number of processes"
        )
    return world_size // groups


def replica_group_summary(plan, groups: int) -> tuple[list[str], dict[str, Any]]:
    """Lines for the table and a JSON entry: the groups, the per-group memory (the plan's per-process
    peak, which is every group's) and the cross-group gradient all-reduce of each process."""
    grads = max(rank.grads for rank in plan.ranks)
    wire = 2 * (groups - 1) * grads // groups
    peak = plan.peak_bytes
    data = {
        "groups": groups,
        "processes_per_group": plan.mesh.world_size,
        "world_size": groups * plan.mesh.world_size,
        "per_process_peak_bytes": peak,
        "cross_group_allreduce_bytes": grads,
        "cross_group_wire_bytes_per_process": wire,
    }
    lines = [
        f"replica groups (torchft): {groups} groups x {plan.mesh.world_size} processes = {groups * plan.mesh.world_size}; "
        f"the plan above is one group's, and every group holds the same",
        f"  per process: peak {format_bytes(peak)} in every group; across groups each step all-reduces the "
        f"{format_bytes(grads)} of gradient each process holds ({format_bytes(wire)} on the wire per process as a ring of {groups})",
    ]
    return lines, data
