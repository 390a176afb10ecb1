"""A pipeline stage in the dry run: what ``PipelineRunner`` runs on a rank, one microbatch at a time.

``parallelize`` (through the project's ``apply_pipeline``) leaves a module whose runner holds this
rank's ``StageModule``s; torch's schedule would call each on every microbatch and pass activations
point-to-point. The fake process group cannot run the schedule (its receives carry nothing), so the
dry run calls each ``StageModule`` itself on one microbatch: the first stage on token ids, a later
one on an activation of the shape the first stage produced (``boundary``). The send/recv traffic is
then counted from those measured shapes, and the runner's own per-step reductions (the data-axis
gradient average, the sum of a tied weight's gradients) run for real on the fake group.
"""

from __future__ import annotations

import torch

from .collectives import CollectiveCounter, CollectiveLog
from .mesh_spec import MeshSpec


def stage_forwards(runner, args: tuple, kwargs: dict, boundary: tuple | None):
    """One microbatch through each stage this rank holds, as the schedule runs them (``StageModule``):
    the first stage on the token ids, a later one on a received activation of the boundary's shape."""
    ids = args[0] if args else kwargs.get("input_ids")
    outputs, inputs = [], []
    for module, index in zip(runner.modules, runner.indices):
        if index == 0:
            x = ids
        else:
            if boundary is None:
                raise ValueError(
                    "A later pipeline stage needs the activation shape the first stage sends; "
                    "dry-run the first stage's rank first."
                )
            shape, dtype = boundary
            x = torch.zeros(shape, dtype=dtype, requires_grad=True)
        inputs.append(x)
        outputs.append(module(x))
    return outputs, inputs


def stage_backwards(runner, outputs: list) -> None:
    for index, out in sorted(zip(runner.indices, outputs), key=lambda pair: -pair[0]):
        if index == runner.num_stages - 1:
            logits = out.float()
            if logits.dim() == 3:  # a language model head: the loss a Trainer's lm loss computes
                target = torch.zeros(logits.shape[:2], dtype=torch.long)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            else:
                loss = logits.mean()
            loss.backward()
        else:
            out.backward(torch.ones_like(out))


def pipeline_traffic(runner, outputs, inputs, distribution, spec: MeshSpec, axis_of: dict, mode):
    """Per-step traffic besides each microbatch's stage compute: the activations and their gradients a
    stage sends (torch's schedule sends them point-to-point; the fake group does not run the schedule,
    so they are counted from the shapes measured here), and the runner's own per-step reductions (its
    data-axis gradient average, the tied-weight sum), run for real on the fake group."""
    from trainmesh._torch.pipeline import _average_grads

    log = CollectiveLog()
    pipe = runner.pipeline.axis
    m = runner.pipeline.microbatches
    boundary = None
    for out, x, index in zip(outputs, inputs, runner.indices):
        if index == 0 and out is not None:
            boundary = (tuple(out.shape), out.dtype)
        if index < runner.num_stages - 1:
            log.add(pipe, "send_recv", out.numel() * out.element_size() * m, m)
        if index > 0:
            log.add(pipe, "send_recv", x.numel() * x.element_size() * m, m)
    log.group_sizes[pipe] = runner.pipe_size
    counter = CollectiveCounter(axis_of, log)
    with mode, counter:
        runner._sync_tied_grads()
        if runner.reduce_data_grads and runner.data_size > 1:
            _average_grads(runner.parameters(), runner.data_group, runner.data_size)
    return boundary, log


def fsdp_stage(runner):
    """The FSDP-wrapped stage model of a runner holding one stage, or None. torch's schedule drives such
    a stage itself (``PipelineStage.backward_maybe_with_nosync`` / ``perform_reduce_grad``): gradients
    are reduce-scattered once per step, and parameters stay gathered between microbatches' backwards,
    so its traffic is not one microbatch's times the microbatches."""
    from torch.distributed.fsdp import FSDPModule

    if len(runner.modules) != 1:
        return None
    inner = getattr(runner.modules[0], "stage_model", None)
    return inner if isinstance(inner, FSDPModule) else None


def schedule_order(stage_index: int, num_stages: int, microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """The forward/backward order torch's GPipe or 1F1B runs on one stage (warm-up forwards, then one
    backward and one forward in turn, then the remaining backwards)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warm = min(microbatches, num_stages - stage_index)
    order, forward = [("F", i) for i in range(warm)], warm
    for backward in range(microbatches):
        order.append(("B", backward))
        if forward < microbatches:
            order.append(("F", forward))
            forward += 1
    return order


def run_fsdp_schedule(
    runner, stage, first_output, args: tuple, kwargs: dict, boundary, microbatches: int, schedule: str, autocast, ops
) -> None:
    """Run the rest of a step's microbatches on an FSDP stage in the schedule's order, with the FSDP
    settings torch's stage applies (the first microbatch's forward has run: ``first_output``). ``ops``
    (an ``op_costs.OpProfile``) files each microbatch's ops under its own phase, forward or backward,
    as the schedule interleaves them."""
    from torch.distributed.fsdp import fully_shard

    outputs = {0: first_output}
    for kind, k in schedule_order(runner.indices[0], runner.num_stages, microbatches, schedule)[1:]:
        ops.phase = "forward" if kind == "F" else "backward"
        if kind == "F":
            with autocast:
                outputs[k] = stage_forwards(runner, args, kwargs, boundary)[0]
            continue
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
        stage_backwards(runner, outputs.pop(k))
    ops.phase = "backward"  # the final reduce-scatter's work
    stage.set_is_last_backward(True)
    stage.set_reshard_after_backward(True)
    stage.set_requires_gradient_sync(True)
    state = fully_shard.state(stage)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
