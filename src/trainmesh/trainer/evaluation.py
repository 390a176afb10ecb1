"""The loops of ``evaluate`` and ``predict``: every sample exactly once, exact sums.

Each process sees its share of every global batch (shares may be unequal or empty on the
last batch). Loss and metric states are accumulated as sums and all-reduced once at the
end, so the result is the same on 1, 2 or 4 processes. Under DDP the forward runs on the
unwrapped module (a forward with no collective, so an empty share can simply be skipped);
DTensor models run on the global batch, which every process enters together; FSDP2 (ZeRO
2-3) models all-gather parameters in forward, so every process runs every forward too, with
its local rows (possibly none). Over a sequence axis the model splits each whole sequence over the
axis and gathers its outputs back (``_torch/context_parallel_eval.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from trainmesh._torch.context_parallel_eval import chunk_loss, loss_on_chunks, split_sequences
from trainmesh._torch.reduce import all_reduce_small, gather_batches
from trainmesh._torch.sync import runs_collectives_in_forward, unwrap
from trainmesh.runtime import to_local_device

from .data_input import eval_batches
from .metrics import Metric
from .step import batch_rows, split_batch


def _is_dtensor_model(trainer) -> bool:
    return getattr(trainer.model, "_trainmesh_distribution", None) is not None


def _every_process_forwards(trainer) -> bool:
    return runs_collectives_in_forward(trainer.model)


def _forward_model(trainer) -> torch.nn.Module:
    return trainer.model if _every_process_forwards(trainer) else unwrap(trainer.model)


def _to_model_input(trainer, value: Any, rows: int) -> Any:
    if _is_dtensor_model(trainer):
        return trainer.distribution._batch_to_global_rows(value, rows)
    return value


def _forward(trainer, model: torch.nn.Module, inputs: Any, *, everywhere: bool = False) -> Any:
    """The model's outputs; under a pipeline, the last stage's, passed stage to stage (on the last
    stage only, or on every stage's process when ``everywhere``: predict returns them on all)."""
    pipeline = getattr(trainer.model, "_trainmesh_pipeline", None)
    if pipeline is not None:
        with trainer.precision.forward_context():
            return pipeline.forward_only(inputs, everywhere=everywhere)
    with trainer.precision.forward_context():
        return model(inputs)


def _model_output(trainer, outputs: Any) -> Any:
    """What the loss function gets: under a pipeline, the last stage's tensor in the model's own
    output type (a transformers ModelOutput, a tuple), as it gets it without one."""
    pipeline = getattr(trainer.model, "_trainmesh_pipeline", None)
    return pipeline.model_output(outputs) if pipeline is not None else outputs


def run_evaluation(trainer, data: Any, batch_size: int | None, metrics: list[Metric]) -> tuple[torch.Tensor, dict]:
    """Returns the reduced ``[loss x samples, samples]`` and the reduced metric values."""
    model = _forward_model(trainer)
    was_training = model.training
    model.eval()
    for metric in metrics:
        metric.reset()
    sums = torch.zeros(2, dtype=torch.float64)
    try:
        with (
            torch.no_grad(),
            split_sequences(trainer.model),
            loss_on_chunks(trainer.model, trainer.loss_fn, metrics) as chunked,
        ):
            for step, (rows, batch) in enumerate(eval_batches(data, trainer.distribution, batch_size=batch_size)):
                trainer.callbacks.on_test_batch_begin(step, {})
                if batch is None or (batch_rows(batch) == 0 and not _every_process_forwards(trainer)):
                    trainer.callbacks.on_test_batch_end(step, {})
                    continue
                inputs, targets = split_batch(trainer.precision.convert_input(to_local_device(batch)))
                local_targets = targets
                inputs, targets = _to_model_input(trainer, inputs, rows), _to_model_input(trainer, targets, rows)
                outputs = _forward(trainer, model, inputs)
                if outputs is None:  # a pipeline stage before the last: its share is counted there
                    trainer.callbacks.on_test_batch_end(step, {})
                    continue
                with trainer.precision.forward_context():
                    if chunked is not None:  # a sequence axis, only the loss asked: on this process's chunks
                        loss = chunk_loss(chunked, trainer.loss_fn, outputs, local_targets)
                    else:
                        loss = trainer.loss_fn(_model_output(trainer, outputs), targets)
                value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
                samples = batch_rows(local_targets)
                if samples:
                    sums += torch.tensor([float(value) * samples, samples], dtype=torch.float64)
                if metrics:
                    from trainmesh._torch.tensor_parallel import batch_to_local

                    local_out = batch_to_local(outputs, trainer.distribution).float()
                    for metric in metrics:
                        if samples:
                            metric.update(local_out, local_targets)
                trainer.callbacks.on_test_batch_end(step, {})
    finally:
        model.train(was_training)
    states = [m.state().to(torch.float64) for m in metrics]
    reduced = all_reduce_small(torch.cat([sums, *states]))
    logs, offset = {}, 2
    for metric, state in zip(metrics, states):
        logs[metric.name] = metric.compute(reduced[offset : offset + len(state)])
        offset += len(state)
    return reduced[:2], logs


def run_prediction(trainer, data: Any, batch_size: int | None) -> torch.Tensor:
    model = _forward_model(trainer)
    was_training = model.training
    model.eval()
    shares = []
    try:
        with torch.no_grad(), split_sequences(trainer.model):
            for rows, batch in eval_batches(data, trainer.distribution, batch_size=batch_size):
                if batch is None or (batch_rows(batch) == 0 and not _every_process_forwards(trainer)):
                    shares.append(None)
                    continue
                batch = trainer.precision.convert_input(to_local_device(batch))
                inputs = batch[0] if isinstance(batch, (tuple, list)) else batch  # Keras: predict takes x
                shares.append(_forward(trainer, model, _to_model_input(trainer, inputs, rows), everywhere=True))
    finally:
        model.train(was_training)
    return torch.cat(gather_batches(shares, trainer.distribution))
