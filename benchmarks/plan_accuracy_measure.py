"""plan_accuracy.py's measured side: each case set up on real processes as training does, its steps timed
round after round with the per-op and core-sharing probes around them, and the socket bytes and live
tensor peak of a step counted (``_worker``, run on every rank).

It exists apart from the script because it runs inside the measured processes, and never sees the plan.
"""

from __future__ import annotations

import os
import time

import torch

from trainmesh.testing.memory import LiveTensorBytes

from plan_accuracy_setup import MICROBATCHES, MODEL, SEQ, _is_pipe, _rows, build_model


def _socket_bytes() -> int:
    """Bytes this process has written with write-family calls (gloo's sockets; nothing else writes while timed)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split(":")[1]) for line in f if line.startswith("wchar"))
    except (OSError, StopIteration):
        return -1


def _raise_priority(enabled: bool) -> str:
    """A plan is for a machine the job has to itself; this one is shared. The measured processes (and the
    probes that price them) run at a raised priority where the OS allows it, so other users' load
    moves them less; where it does not (not root), they run as they are and the output says so."""
    if not enabled:
        return "priority not raised (--no-priority)"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "measured at raised priority (nice -10)"
    except (OSError, AttributeError) as exc:
        return f"priority not raised ({type(exc).__name__}): other load on this machine is in the timings"


def _setup(case):
    """Parallelize one case as training does; returns a function that runs one training step."""
    import trainmesh as tm
    from trainmesh._torch.parallelize import parallelize
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.model_states import resolve_optimizer
    from trainmesh.trainer.loss_tracking import LossAccumulator
    from trainmesh.trainer.precision import build_precision

    _, mesh, zero, checkpointing, _ = case
    spec = MeshSpec.parse(mesh, tm.world_size())
    torch.manual_seed(0)
    model = build_model()
    distribution = spec.distribution(model, zero_stage=zero, microbatches=MICROBATCHES)
    model = parallelize(model, distribution, zero_stage=zero, activation_checkpointing=checkpointing)
    model.train()
    opt = distribution.prepare_optimizer(resolve_optimizer("adam")([p for p in model.parameters()]), model)
    ids = torch.randint(0, MODEL["vocab_size"], (_rows(mesh) * (MICROBATCHES if _is_pipe(mesh) else 1), SEQ))
    runner = getattr(model, "_trainmesh_pipeline", None)
    precision, losses = build_precision("fp32"), LossAccumulator()

    def lm_loss(output, target):  # the loss the planner's dry run computes on a last stage
        logits = output.logits  # the model's own output type, with or without a pipe axis (one loss contract)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def step():
        if runner is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            runner.forward_backward([(ids, ids)], lm_loss, precision, losses)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _worker(cases, rounds: int, hardware, priority: bool) -> dict:
    import trainmesh as tm

    _raise_priority(priority)
    from trainmesh.planner.calibrate_ops import measure_compute
    from trainmesh.planner.flops import LocalFlops
    from trainmesh.planner.op_costs import OpProfile

    from trainmesh.planner.calibrate_cores import probe_work, run_window

    steps, peaks, flops, ops = [], [], [], []
    for case in cases:
        with LiveTensorBytes("cpu") as tracker:
            step = _setup(case)
            # A pipeline builds the whole model on every process before it keeps its stage: that is
            # construction, not a step; the plan is the peak of a training step.
            tracker.reset_peak()
            step()  # the first step creates the optimizer state; the second runs with it
            with LocalFlops() as counter, OpProfile() as profile:
                step()
        steps.append(step)
        peaks.append(tracker.peak)
        flops.append(counter.total)
        ops.append(profile.ops())
    times = [[] for _ in cases]
    cpu = [[] for _ in cases]  # CPU seconds the process spent in the step (a diagnostic: wall minus this is waiting)
    wire = [[] for _ in cases]
    probes, shares = [], []
    work = probe_work()
    n = tm.world_size()
    window = 0.2
    for r in range(rounds):
        # The machine is shared and its load moves by the second: the per-op figures are measured again
        # every round by one process alone (the others wait in a barrier), and so is the rate of the
        # core-sharing probe (calibrate_cores) alone and with 2 processes at once; right before each
        # case's step, all n processes run the probe at once. Each step is priced with its own round's
        # figures (how much slower a process runs among n than alone, beside the step it prices).
        rates: dict = {"cases": {}}
        if tm.rank() == 0:
            probes.append(measure_compute(hardware, repeats=3).to_dict())
            units, wall, _ = run_window(work, window)
            rates[1] = units / wall
        for p in [2] if n > 2 else []:
            tm.barrier()
            if tm.rank() < p:
                units, wall, _ = run_window(work, window)
                rates[p] = units / wall
        for i in [(r + k) % len(cases) for k in range(len(cases))]:  # interleaved, in a rotating order
            tm.barrier()
            units, wall, _ = run_window(work, window)
            before = wall / units
            tm.barrier()
            written = _socket_bytes()
            start, used = time.perf_counter(), time.process_time()
            steps[i]()
            times[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - used)
            wire[i].append(_socket_bytes() - written)
            units, wall, _ = run_window(work, window)  # and right after it: the load during the step is between
            rates["cases"][i] = 2 / (before + wall / units)
        shares.append(rates)
    return {
        "times": times,
        "cpu": cpu,
        "wire": wire,
        "peaks": peaks,
        "flops": flops,
        "ops": ops,
        "probes": probes,
        "shares": shares,
    }
