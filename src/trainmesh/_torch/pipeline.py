"""Pipeline parallelism on torch's own engine: ``torch.distributed.pipelining`` stages and schedules.

``apply_pipeline`` (called first by ``parallelize``) splits the model into stage copies
(``pipeline_split``); ``parallelize`` then lays out, checkpoints and shards each stage; and
``PipelineRunner`` runs a step through torch's schedule. What the runner adds around it:

* the loss of each microbatch is divided by their number (``scale_grads=False``): a step's
  gradient is the mean over its microbatches, as one batch on one process gives (each weighted
  by its tokens where padding leaves them unequal: ``pipeline_loss``);
* gradients over the data axis: FSDP2 (ZeRO 2-3) reduces them itself; otherwise one flattened
  all-reduce per dtype after the schedule (no per-microbatch traffic);
* a weight shared by the first and last stage (a tied embedding and head) lives on both; their
  gradients are summed after each step so the two copies stay equal;
* the zero-bubble schedules split each backward; what that asks of a stage (no view as its
  output, ZeRO-3 gathered through the step) and what it refuses (activation checkpointing,
  compile) is in ``pipeline_zero_bubble``;
* on CPU (gloo), each step's receives are posted when it starts (``pipeline_receives``), not
  when each microbatch is due;
* evaluation and prediction pass activations stage to stage with plain send/recv, one
  microbatch, no schedule (batches there may be uneven or empty: ``pipeline_forward``);
* the loss function gets the model's own output type, rebuilt around the last stage's tensor
  (``pipeline_output``): ``outputs.logits`` and ``outputs[0]`` read as they do without a pipeline;
* the loss exists on the last stage; the Trainer's loss all-reduce reports it everywhere.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .context_parallel import global_token_count, sequence_context, token_weighted_loss
from .pipeline_experts import average_expert_replicas, data_averaged
from .pipeline_forward import forward_only
from .pipeline_inputs import check_sequence_rules, split_inputs
from .pipeline_loss import loss_under_precision, microbatch_weighted, real_tokens_if_padded, scaled_loss
from .pipeline_receives import ReceivePlan, posts_receives_ahead
from .pipeline_split import KeyedBlocks, assign_blocks, build_stage_model, split_at
from .pipeline_stage import StageModule, make_pipeline_stage  # noqa: F401 - StageModule is imported from here too
from .pipeline_zero_bubble import SPLIT_BACKWARD, check_split_backward, gathered_through_step


def stage_indices(pipe_rank: int, pipe_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Which stages a process holds: looped (r, r+p, ...) or, for V schedules, r and 2p-1-r."""
    if schedule == "zbv":
        return [pipe_rank, 2 * pipe_size - 1 - pipe_rank]
    return [pipe_rank + v * pipe_size for v in range(stages_per_rank)]


def stage_owner(stage: int, pipe_size: int, schedule: str) -> int:
    if schedule == "zbv":
        return stage if stage < pipe_size else 2 * pipe_size - 1 - stage
    return stage % pipe_size


def plan_split(model: nn.Module, pipeline, pipe_size: int) -> tuple[str | None, list[list[str]]]:
    """The blocks (children, for an nn.Sequential) of every stage; validates, communicates nothing."""
    num_stages = pipeline.num_stages(pipe_size)
    pipeline.validate(pipe_size)
    if isinstance(model, nn.Sequential):
        names = [n for n, _ in model.named_children()]
        if num_stages > len(names):
            raise ValueError(
                f"{num_stages} pipeline stages need at least {num_stages} children; the nn.Sequential has {len(names)}."
            )
        if not isinstance(pipeline.split_points, str):
            return None, split_at(names, pipeline.split_points, num_stages)
        from .pipeline_split import _balanced

        costs = [float(sum(p.numel() for p in c.parameters())) or 1.0 for c in model.children()]
        return None, _balanced(names, costs, num_stages)
    return assign_blocks(model, num_stages, pipeline.split_points, pipeline.balance)


def split_for_pipeline(
    model: nn.Module, pipeline, pipe_rank: int, pipe_size: int, plan=None
) -> tuple[list[int], list[nn.Module]]:
    """This process's stage indices and stage copies (parameter names those of the whole model)."""
    container, parts = plan or plan_split(model, pipeline, pipe_size)
    mine = stage_indices(pipe_rank, pipe_size, pipeline.stages_per_rank, pipeline.schedule)
    if container is None:  # nn.Sequential: the stage is its run of children
        return mine, [KeyedBlocks({n: model.get_submodule(n) for n in parts[i]}) for i in mine]
    return mine, [build_stage_model(model, container, parts, i, copy_model=True) for i in mine]


class PipelineRunner:
    """Runs training steps and forward-only passes of this process's stages."""

    batch_axis: str | None = None  # set by apply_pipeline: experts laid out over it reduce apart
    expert_layers: list[tuple[str, int]] = []  # every stage's experts modules, set by apply_pipeline

    def __init__(
        self,
        stage_models: list[nn.Module],
        indices: list[int],
        pipeline,
        *,
        pipe_group,
        data_group,
        data_size: int,
        reduce_data_grads: bool,
        tied_groups: dict[str, Any],
        device: torch.device,
    ):
        self.pipeline = pipeline
        self.indices = indices
        self.num_stages = pipeline.num_stages(dist.get_world_size(pipe_group))
        self.pipe_group, self.pipe_size = pipe_group, dist.get_world_size(pipe_group)
        self.pipe_rank = dist.get_rank(pipe_group)
        self.data_group, self.data_size = data_group, data_size
        self.reduce_data_grads = reduce_data_grads
        self.tied_groups = tied_groups
        self.device = device
        self.stage_models = stage_models
        check_split_backward(stage_models, pipeline.schedule)  # before torch builds anything
        self.root: nn.Module = stage_models[0]  # the module the Trainer holds (train/eval is set on it)
        self._context: list[Callable] = [_null_context]
        self.modules = [StageModule(m, i == 0, lambda: self._context[0]()) for m, i in zip(stage_models, indices)]
        self.stages = [
            make_pipeline_stage(module, index, self.num_stages, device, pipe_group)
            for module, index in zip(self.modules, indices)
        ]
        self._loss_fn: list[Callable | None] = [None]
        self._step_tokens: list[float | None] = [None]  # a sequence axis: the schedule step's global tokens
        self._replica_tokens: list[float | None] = [None]  # no sequence axis: the step's tokens, where some are -100
        self.schedule = self._build_schedule()
        self.receive_plan = ReceivePlan(self.stages) if posts_receives_ahead(self.stages, pipe_group) else None

    @property
    def holds_first(self) -> bool:
        return 0 in self.indices

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def model_output(self, tensor: torch.Tensor) -> Any:
        """The last stage's output tensor in the model's own output type, as the loss function gets it
        without a pipeline (``pipeline_output``); only on the process holding the last stage."""
        return self.modules[self.indices.index(self.num_stages - 1)].model_output(tensor)

    def describe(self) -> str:
        return self.pipeline.describe(self.pipe_size) + f"; this process holds stage(s) {self.indices}"

    def check_batches(
        self,
        micro_batch_size: int | None,
        num_samples: int | None,
        global_batch_size: int | None,
        *,
        drop_remainder: bool,
    ) -> None:
        """Every step's rows per data replica must divide into the microbatches, the last one too (the
        stages' buffers are shaped by the first step)."""
        if micro_batch_size is not None:
            self.pipeline.validate(self.pipe_size, micro_batch_size)
        if num_samples and global_batch_size and num_samples % global_batch_size and not drop_remainder:
            raise ValueError(
                f"A pipeline runs every step with the same microbatch shapes; the dataset's "
                f"{num_samples} samples leave a last batch of {num_samples % global_batch_size} rows "
                f"(global batch {global_batch_size}). Pass drop_remainder=True or a dataset that "
                f"divides. Received: {num_samples} samples"
            )

    def install_hooks(self) -> None:
        for module in self.modules:
            module.install_entry_hook()

    def _build_schedule(self):
        import torch.distributed.pipelining as pipelining
        from trainmesh.distribution.pipeline import SCHEDULES

        cls = getattr(pipelining, SCHEDULES[self.pipeline.schedule][0])
        m = self.pipeline.microbatches

        def loss(output, target):  # the model's own output type (one loss contract); mean over microbatches
            return self._loss_fn[0](self.model_output(output), target) / m

        stages = self.stages[0] if SCHEDULES[self.pipeline.schedule][1] == 1 else self.stages
        return cls(stages, n_microbatches=m, loss_fn=loss, scale_grads=False)

    # --- training ------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list, loss_fn: Callable, precision, losses, on_outputs=None) -> None:
        """One step's gradients: every micro-batch of the Trainer is one run of the schedule."""
        from trainmesh.trainer.step import batch_rows, split_batch

        k = len(micro_batches)
        self._context[0] = precision.forward_context
        scaler = precision.scaler
        self._loss_fn[0] = lambda out, y: scaled_loss(
            self._token_weighted(loss_under_precision(precision, loss_fn, out, y), y), k, scaler
        )
        self._follow_mode()
        for batch in micro_batches:
            inputs, targets = split_batch(precision.convert_input(batch))
            tokens, side = self._split_inputs(inputs, training=True)  # every process, before any message
            self.pipeline.validate(self.pipe_size, batch_rows(targets))
            step_losses: list[torch.Tensor] = []
            args = (tokens,) if self.holds_first else ()
            if self.holds_last:  # before the schedule: every process of the last stage's data x seq group
                self._step_tokens[0] = global_token_count(self._last_stage_model(), targets)
                self._replica_tokens[0] = real_tokens_if_padded(targets)
            if self.receive_plan is not None:
                self.receive_plan.before_step(self.schedule)
            with self._step_context():
                outputs = self.schedule.step(
                    *args,
                    target=targets if self.holds_last else None,
                    losses=step_losses,
                    return_outputs=on_outputs is not None and self.holds_last,
                    **side,  # every stage's forward gets its microbatch of them (pipeline_inputs)
                )
            if self.receive_plan is not None:
                self.receive_plan.after_step()
            if self.holds_last:
                total = torch.stack([l.detach().float() for l in step_losses]).sum()
                unscaled = total * k / (scaler.scale_value if scaler is not None else 1.0)
                losses.add(unscaled, batch_rows(targets))
                if on_outputs is not None:
                    on_outputs(outputs.detach(), targets)
        self._sync_tied_grads()
        if self.reduce_data_grads and self.data_size > 1:  # experts over the batch axis: pipeline_experts
            dense = data_averaged(self.stage_models, self.parameters(), self.batch_axis)
            _average_grads(dense, self.data_group, self.data_size)
            average_expert_replicas(self.stage_models)

    def _split_inputs(self, inputs: Any, *, training: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """The first stage's token ids and every stage's side inputs (``pipeline_inputs``); tells the
        stages whether to hand their model a dict, as the user's batch is."""
        context = sequence_context(self.stage_models[0]) if training else None  # evaluation: whole sequences
        tokens, side = split_inputs(
            inputs,
            sequential=isinstance(self.stage_models[0], KeyedBlocks),
            seq_factor=context.split.axis_size if context is not None else 1,
        )
        if context is not None:
            check_sequence_rules(self.stage_models[0], context, tokens, side)
        for module in self.modules:
            module.dict_inputs = isinstance(inputs, dict)
        return tokens, side

    def _token_weighted(self, loss: torch.Tensor, targets) -> torch.Tensor:
        """Over a sequence axis, the last stage's microbatch loss weighted to the global token mean of the
        whole schedule step (``token_weighted_loss``, with the step's tokens counted by one 8-byte
        all-reduce over data x seq before the schedule): microbatches with more padding weigh less, as
        their tokens do in one process's mean over the batch. Without one, the same weighting to the token
        mean of this data replica's batch (``pipeline_loss.microbatch_weighted``, no collective)."""
        if sequence_context(self._last_stage_model()) is None:
            return microbatch_weighted(loss, targets, self._replica_tokens[0], self.pipeline.microbatches)
        return token_weighted_loss(
            self._last_stage_model(), loss, targets, total=self._step_tokens[0], parts=self.pipeline.microbatches
        )

    def _last_stage_model(self) -> nn.Module:
        return self.stage_models[self.indices.index(self.num_stages - 1)]

    def _step_context(self):
        if self.pipeline.schedule in SPLIT_BACKWARD:  # ZeRO-3 keeps a stage gathered through the step
            return gathered_through_step(self.stage_models)
        return _null_context()

    def _follow_mode(self) -> None:
        for module in self.modules:  # the copies' own dropouts too, not only the merged tree's
            module.train(self.root.training)

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for model in self.stage_models:
            for p in model.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _sync_tied_grads(self) -> None:
        """The copies of a weight shared by the first and last stage get the sum of their gradients."""
        for name, (group, params) in self.tied_groups.items():
            for p in params:  # the same sharding on both sides (a tensor-parallel embedding's gradient
                if p.grad is None:  # may come out replicated where its weight is sharded); never skip a
                    p.grad = torch.zeros_like(p)  # side, or its partner would wait in the all-reduce
                g = p.grad
                if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
                    p.grad = g.redistribute(p.device_mesh, p.placements)
            grads = [p.grad for p in params]
            locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            total = locals_[0] if len(locals_) == 1 else sum(locals_[1:], locals_[0].clone())
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in locals_:
                if g is not total:
                    g.copy_(total)

    # --- forward only ----------------------------------------------------------------------
    def forward_only(self, inputs: Any, *, everywhere: bool = False) -> torch.Tensor | None:
        """The last stage's output for ``inputs`` (whole batch, one microbatch), by send/recv along the
        stages (``pipeline_forward``); on every pipeline process when ``everywhere``, else on the last
        stage's only."""
        self._follow_mode()
        return forward_only(self, inputs, everywhere=everywhere)

    def owner_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return stage_owner(stage, self.pipe_size, self.pipeline.schedule)


def _null_context():
    import contextlib

    return contextlib.nullcontext()


def _average_grads(params: list[nn.Parameter], group, size: int) -> None:
    """Mean of the gradients over the data axis: one flattened all-reduce per dtype."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, value in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(value)
