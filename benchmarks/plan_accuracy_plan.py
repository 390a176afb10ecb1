"""plan_accuracy.py's planned side: every rank of a case dry-run on the fake process group, and the step
priced with the machine's figures (those measured before the run, or a round's own probes).

It exists apart from the script because it is the planner's answer alone, computed before (and apart
from) anything measured.
"""

from __future__ import annotations

import statistics


from plan_accuracy_setup import MICROBATCHES, SEQ, _rows, build_model


def _round_hardware(hardware, measured: list[dict], k: int, index: int):
    """Round ``k``'s figures for case ``index``: rank 0's per-op probe, and the core-sharing curve
    ((1, 1), (2, alone / rate of 2 at once), (n, alone / rate of n at once around the step)), each
    rate of several processes the slowest one's (``calibrate_cores.pace_of``), as in the plan's own
    calibration: the step waits for its slowest process."""
    from dataclasses import replace

    from trainmesh.planner.calibrate_cores import pace_of
    from trainmesh.planner.hardware import Hardware

    n = len(measured)
    alone = measured[0]["shares"][k][1]
    curve = [(1, 1.0)]
    if n > 2:
        curve.append((2, alone / pace_of([measured[r]["shares"][k][2] for r in range(2)])))
    curve.append((n, alone / pace_of([measured[r]["shares"][k]["cases"][index] for r in range(n)])))
    probe = Hardware.from_dict(measured[0]["probes"][k])
    return replace(
        hardware,
        flops=probe.flops,
        flops_curve=probe.flops_curve,
        bandwidth_curve=probe.bandwidth_curve,
        memory_bandwidth=probe.memory_bandwidth,
        op_overhead=probe.op_overhead,
        op_kind_curves=probe.op_kind_curves,
        external_load=probe.external_load,
        contention_curve=tuple(curve),
    )


def _median_hardware(hardware, probes: list[dict]):
    """``hardware`` with each per-op figure the median of the rounds' probes (curves point by point)."""
    from dataclasses import replace

    from trainmesh.planner.hardware import Hardware

    probes = [Hardware.from_dict(p) for p in probes]

    def curve(name):
        return tuple(
            (size, statistics.median(getattr(p, name)[i][1] for p in probes))  # noqa: E731
            for i, (size, _) in enumerate(getattr(probes[0], name))
        )

    flops_curve, bandwidth_curve = curve("flops_curve"), curve("bandwidth_curve")
    kinds = tuple(
        (
            kind,
            tuple(
                (size, statistics.median(dict(p.op_kind_curves)[kind][i][1] for p in probes))
                for i, (size, _) in enumerate(points)
            ),
        )
        for kind, points in probes[0].op_kind_curves
    )
    return replace(
        hardware,
        flops=max(r for _, r in flops_curve),
        flops_curve=flops_curve,
        bandwidth_curve=bandwidth_curve,
        memory_bandwidth=bandwidth_curve[-1][1],
        op_kind_curves=kinds,
        op_overhead=statistics.median(p.op_overhead for p in probes),
        external_load=statistics.median(p.external_load for p in probes),
    )


def _dry_run(case) -> list:
    """Every rank of ``case`` dry-run on the fake process group (trainmesh's parallelize, fake tensors)."""
    from trainmesh.planner.dry_run import run_rank
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.meta_model import build_meta_model

    n, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, n)
    meta = build_meta_model(build_model)
    results, boundary = [], None
    for rank in range(n):  # rank order is pipe order: the first stage tells the others what they receive
        result = run_rank(
            meta,
            spec,
            rank,
            zero_stage=zero,
            activation_checkpointing=checkpointing,
            precision="fp32",
            micro_batch=_rows(mesh),
            seq_len=SEQ,
            microbatches=MICROBATCHES,
            boundary=boundary,
        )
        boundary = boundary or result.boundary
        results.append(result)
    return results


def _price(case, results: list, hardware) -> dict:
    from trainmesh.planner.collectives import wire_bytes
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.parallel import ParallelPlan, estimate_step

    n, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, n)
    step = estimate_step(results, spec, hardware, tokens_per_rank=None, shape={})
    plan = ParallelPlan(
        model="bench",
        mesh=spec,
        zero_stage=zero,
        activation_checkpointing=checkpointing,
        precision="fp32",
        micro_batch=_rows(mesh),
        seq_len=SEQ,
        num_parameters=0,
        ranks=results,
        step=step,
        hardware=hardware,
        device_memory=None,
    )
    wire = [
        sum(wire_bytes(row["kind"], row["bytes"], row["group_size"], hardware.backend) for row in r.collectives.rows())
        for r in results
    ]
    return {
        "peaks": [plan.peak(r) for r in results],
        "step": step,
        "wire": wire,
        "flops": [r.flops for r in results],
        "ops": [r.ops.ops() for r in results],
    }
