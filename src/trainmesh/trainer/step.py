"""One optimizer step: k micro-batches of forward+backward, then unscale, clip, step.

Gradient communication happens once per step: every micro-step but the last runs under
``no_sync`` (DDP's, or trainmesh's for DTensor models), so with k micro-batches of b samples
the update equals one batch of k*b (the loss of each micro-batch is divided by k).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from trainmesh._torch.context_parallel import token_weighted_loss
from trainmesh._torch.moe_balance import recording_aux_terms
from trainmesh._torch.reduce import all_reduce_small
from trainmesh._torch.sync import no_sync
from trainmesh._torch.vocab_parallel import keep_vocab_shards, whole_outputs

from .loss_tracking import LossAccumulator
from .precision import Precision


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` from a batch; Keras-style ``(x, y)`` pairs."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        "Each batch must be an (inputs, targets) pair for fit/evaluate. "
        f"Received: a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def batch_rows(value: Any) -> int:
    """Rows on this process: local rows of a tensor (a DTensor's local shard)."""
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, (tuple, list)) and value:
        return batch_rows(value[0])
    if isinstance(value, dict) and value:
        return batch_rows(next(iter(value.values())))
    raise ValueError(f"Cannot tell the batch size of a {type(value).__name__}")


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list,
    loss_fn: Callable,
    precision: Precision,
    losses: LossAccumulator,
    on_outputs: Callable[[Any, Any], None] | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> None:
    """Accumulate gradients of ``mean(loss over the step)`` over the micro-batches.

    ``before_last_backward`` runs once every micro-batch's loss is in ``losses`` and before the last
    backward (the Trainer starts its loss check there, to run beside backward). A pipeline's
    schedule interleaves the two, so it is not called there."""
    pipeline = getattr(model, "_trainmesh_pipeline", None)
    if pipeline is not None:  # the schedule runs forward and backward over the stages
        return pipeline.forward_backward(micro_batches, loss_fn, precision, losses, on_outputs)
    k = len(micro_batches)
    for index, batch in enumerate(micro_batches):
        inputs, targets = split_batch(precision.convert_input(batch))
        final = index == k - 1
        with no_sync(model) if not final else contextlib.nullcontext():
            # a loss on the vocabulary shards: the head keeps its shard for this forward (vocab_parallel.py)
            with precision.forward_context(), keep_vocab_shards(model, loss_fn) as sharded:
                with recording_aux_terms() as aux:  # global aux losses keep their weight (moe_balance.py)
                    outputs = model(inputs)
                    loss = loss_fn(outputs, targets)
                loss = token_weighted_loss(model, loss, targets, aux=aux)  # a sequence axis only
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a scalar tensor. Received: {type(loss).__name__} "
                    f"with shape {tuple(getattr(loss, 'shape', ()))}"
                )
            scaled = loss.float() / k if k > 1 else loss.float()  # x / 1 == x: no extra node for backward
            if precision.scaler is not None:
                scaled = precision.scaler.scale(scaled)
            losses.add(loss, batch_rows(targets))
            if final and before_last_backward is not None:
                before_last_backward()
            if on_outputs is None:  # nothing reads them after backward, which does not need them either:
                del outputs  # the logits (tokens x vocabulary) are not held through backward's peak
            scaled.backward()
        if on_outputs is not None:
            if sharded:  # metrics see whole logits, as from any other layout
                outputs = whole_outputs(outputs.detach() if torch.is_tensor(outputs) else outputs)
            on_outputs(outputs.detach() if torch.is_tensor(outputs) else outputs, targets)


def _replication(grad: torch.Tensor, world: int | None = None) -> int:
    """On how many processes this very gradient value lives (so the global norm counts it once):
    the job's processes over the number of distinct shards. A DTensor may live on a sub-mesh
    (tensor parallelism's model axis) and be replicated over the rest of the job too. A pipeline
    stage's parameters live on ``world`` processes only (its stage's; twice that for a weight the
    first and last stage share)."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    if hasattr(grad, "placements"):
        mesh = grad.device_mesh
        # (FSDP2's _StridedShard, over a dim TP sharded already, answers False to is_shard())
        return world // math.prod(
            mesh.size(i) for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial())
        )
    return world


def local_grad_square_sum(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """This process's share of the squared global gradient norm (a float64 CPU scalar): summing it over
    every process gives the square of ``global_grad_norm``. It can ride on another all-reduce (the
    Trainer's per-step loss check) instead of taking one of its own."""
    total = None  # summed where the gradients live: one device-to-host copy per step, not one per parameter
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        square = local.detach().double().pow(2).sum() / _replication(
            grad, getattr(param, "_trainmesh_replica_world", None)
        )
        total = square if total is None else total + square.to(total.device)
    return torch.zeros((), dtype=torch.float64) if total is None else total.reshape(()).cpu()


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """L2 norm of all gradients across every process and shard (one float64 all-reduce)."""
    return float(all_reduce_small(local_grad_square_sum(params).reshape(1)).sqrt().item())


def clip_gradients_(params: Iterable[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's 1e-6 guard)."""
    coef = max_norm / (norm + 1e-6)
    if coef >= 1.0 or not math.isfinite(norm):
        return
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, coef)  # one multi-tensor kernel per device and dtype, as torch's clip_grad_norm_


OPTIMIZER_IMPLEMENTATIONS = (None, "fused", "foreach", "for-loop")


def _mixes_dtensors_and_tensors(group: dict) -> bool:
    return len({hasattr(p, "placements") for p in group["params"]}) == 2


def set_optimizer_implementation(optimizer: Any, implementation: str | None) -> None:
    """Point a torch optimizer at its fused, foreach (multi-tensor) or for-loop kernels (torchtitan's
    ``optimizer.implementation``); ``None`` leaves it as built, except that a group holding both
    DTensors and plain tensors (a tensor layout without ZeRO) always gets the for-loop kernels, the
    only ones that take both. On CPU torch defaults to the for-loop kernels; fused AdamW there is
    several times faster per step. Fused kernels take plain tensors: a group holding DTensors only
    (FSDP2 shards) gets foreach instead. An optimizer without
    the switch (a ``ZeroRedundancyOptimizer``'s inner one is switched) is left alone with a warning."""
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer_implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}. "
            f"Received: optimizer_implementation={implementation!r}"
        )
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps a local torch optimizer
    defaults = getattr(inner, "defaults", {})
    mixed = [group for group in getattr(inner, "param_groups", []) if _mixes_dtensors_and_tensors(group)]
    for group in mixed:
        # Tensor layouts shard some parameters (DTensors) and leave others (norms, biases) plain. A
        # foreach or fused kernel takes one kind or the other, never both in one call ("got mixed
        # torch.Tensor and DTensor"), and torch picks foreach by default on CUDA: such a group runs
        # the for-loop kernels, which take each parameter alone.
        if "foreach" in group:
            group["foreach"] = False
        if "fused" in group:
            group["fused"] = False
    if implementation is None:
        return
    if "foreach" not in defaults or (implementation == "fused" and "fused" not in defaults):
        import warnings

        warnings.warn(
            f"{type(inner).__name__} has no {implementation!r} implementation in torch; "
            f"optimizer_implementation={implementation!r} is ignored.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    if mixed and implementation != "for-loop":
        import warnings

        warnings.warn(
            f"optimizer_implementation={implementation!r} is not used for {len(mixed)} parameter group(s) "
            "that hold both DTensors (sharded by a layout) and plain tensors: torch's multi-tensor "
            "kernels take one kind at a time, so those groups run the for-loop kernels.",
            RuntimeWarning,
            stacklevel=2,
        )
    for group in inner.param_groups:
        if any(group is m for m in mixed):
            continue
        fused = implementation == "fused" and not any(hasattr(p, "placements") for p in group["params"])
        group["foreach"] = implementation == "foreach" or (implementation == "fused" and not fused)
        if "fused" in defaults:
            group["fused"] = fused
