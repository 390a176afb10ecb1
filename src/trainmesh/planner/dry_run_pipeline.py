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
                raise ValueError("A later pipeline stage needs the activation shape the first stage sends; "
                                 "dry-run the first stage's rank first.")
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
