"""``Trainer``: the training loop, and only the loop.

Where tensors live comes from the distribution (DDP or DTensor underneath); how to run a
step from ``step.py``; precision from ``precision.py``; the rest are callbacks, metrics and
logs. Read ``fit`` top to bottom: that is the whole algorithm.
"""

from __future__ import annotations

import copy
import math
import sys
import time
import warnings
from typing import Any, Callable, Iterable

import torch

from trainmesh import runtime
from trainmesh._torch.parallelize import parallelize
from trainmesh._torch.reduce import all_reduce_small
from trainmesh._torch.sync import unwrap
from trainmesh.checkpoint.survey import check_on_invalid
from trainmesh.comm import ProgressBeacon
from trainmesh.distribution import DataParallel, Distribution, distribution as current_distribution
from trainmesh.distribution.adapters import check_lora_targets
from trainmesh.ft.trainer_hook import TrainerReplicaGroups, check_fault_tolerance

from .callbacks import Callback, CallbackList
from .communication import install_communication
from .expert_load import ExpertLoad
from .config import Plan, TrainerConfig
from .data_input import TrainSteps
from .evaluation import run_evaluation, run_prediction
from .history import History
from .log_writer import LogWriter
from .metrics import Metric, resolve_metric
from .precision import build_precision
from .progress import ProgressBar
from .schedules import scale_lr
from .loss_tracking import LossAccumulator
from .step import (
    clip_gradients_,
    forward_backward,
    global_grad_norm,
    local_grad_square_sum,
    set_optimizer_implementation,
)
from .throughput import ThroughputMeter, meta_copy
from .trainer_state import TrainerState


def _resolve_distribution(distribution: Any) -> Distribution:
    if distribution is None:
        distribution = current_distribution() or DataParallel()
    distribution = getattr(distribution, "distribution", distribution)  # a Strategy adapts a Distribution
    if not isinstance(distribution, Distribution):
        raise TypeError(f"distribution must be a trainmesh Distribution or Strategy. Received: {distribution!r}")
    return distribution


class Trainer(TrainerState):
    """Keras-``fit``-style training on any trainmesh distribution.

    >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss(),
    ...                   precision="bf16-mixed", grad_accum_steps=2)   # doctest: +SKIP
    >>> history = trainer.fit(dataset, epochs=3, batch_size=64)        # doctest: +SKIP
    >>> history.history["loss"]                                          # doctest: +SKIP
    [0.91, 0.62, 0.47]
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Callable,
        loss_fn: Callable,
        *,
        distribution: Any = None,
        metrics: Iterable[str | Metric] | None = None,
        callbacks: Iterable[Callback] | None = None,
        config: TrainerConfig | None = None,
        fault_tolerance: Any = None,
        **options: Any,
    ):
        self.config = TrainerConfig.from_kwargs(config, options)
        self._fault_tolerance = check_fault_tolerance(fault_tolerance)  # a tm.ReplicaGroups: ft/trainer_hook.py
        self._ft: TrainerReplicaGroups | None = None
        self.replica_summary: dict[str, int] | None = None  # after a fault-tolerant fit: its replica counters
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable. Received: {loss_fn!r}")
        check_lora_targets(model)  # local, before any process group exists
        runtime.initialize()
        self.distribution = _resolve_distribution(distribution)
        self._device_type = runtime.torch_device_type()
        self.precision = build_precision(self.config.precision, self._device_type)
        names_before = {id(p): name for name, p in model.named_parameters()}
        # every name of every parameter -> its first name (a tied head's weight -> the embedding's)
        self._canonical = {name: names_before[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        self._meta_model = meta_copy(model)  # FLOPs per sample are counted on it at the first step (throughput.py)
        model = self.precision.convert_module(model)
        with self.distribution.scope():
            self.model = parallelize(
                model,
                self.distribution,
                zero_stage=self.config.zero_stage,
                activation_checkpointing=self.config.activation_checkpointing,
                cpu_offload=self.config.cpu_offload or None,
                mixed_precision=getattr(self.precision, "dtype", None),
                compile=self.config.compile,
                compile_backend=self.config.compile_backend,
                compile_mode=self.config.compile_mode,
                weights=self.config.weights,
                init_seed=self.config.seed,
            )
        self.communication = install_communication(self.model, self.config)  # compression, hierarchical
        self._expert_load = ExpertLoad(self.model, self.distribution)  # MoE tokens per expert (expert_load.py)
        self.optimizer = self._bind_optimizer(optimizer, names_before)
        set_optimizer_implementation(self.optimizer, self.config.optimizer_implementation)  # fused / foreach kernels
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.scheduler = None  # built in fit, after any lr scaling, so it starts from the scaled lr
        self.loss_fn = loss_fn
        self.metrics = [resolve_metric(m) for m in (metrics or [])]
        self.callbacks = CallbackList(callbacks or [], self)
        self.history = History()
        self.global_step = 0
        self.epoch = 0
        self.plan: Plan | None = None
        self._stop_local = False
        self.stop_requested = False
        self.stop_reason = ""
        self.nonfinite_steps = 0
        self.rollbacks = 0
        self._steps: TrainSteps | None = None

    # --- small public surface ---------------------------------------------------------
    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return unwrap(self.model)

    @property
    def is_main_process(self) -> bool:
        return runtime.is_main_process()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def request_stop(self, reason: str = "") -> None:
        """Ask every process to stop; all stop after the same step (at the next synchronisation)."""
        self._stop_local = True
        self.stop_reason = reason or self.stop_reason

    # --- fit ----------------------------------------------------------------------------
    def fit(
        self,
        train_data: Any,
        *,
        epochs: int = 1,
        batch_size: int | None = None,
        eval_data: Any = None,
        shuffle: bool = True,
        resume: bool | str = False,
        on_invalid_checkpoint: str = "raise",
    ) -> History:
        """Train for ``epochs`` (counted from 0, so a resumed run finishes the same schedule).

        ``resume=True`` continues from the newest valid checkpoint of the ``ShardedCheckpoint`` (or
        ``ModelCheckpoint``) callback, skipping damaged ones with a warning; with no checkpoint yet it
        starts from step 0. ``resume="path/to/last.pt"`` loads that file. When checkpoints exist and
        none is valid, it raises ``NoValidCheckpointError`` listing each one and why, on every process,
        before training; ``on_invalid_checkpoint="start_over"`` starts from step 0 instead (the
        rejected checkpoints are renamed ``*.rejected``).

        >>> trainer.fit(data, epochs=10, resume=True)                                       # doctest: +SKIP
        >>> trainer.fit(data, epochs=10, resume=True, on_invalid_checkpoint="start_over")   # doctest: +SKIP
        """
        check_on_invalid(on_invalid_checkpoint)
        steps = TrainSteps(
            train_data,
            self.distribution,
            global_batch_size=batch_size,
            grad_accum_steps=self.config.grad_accum_steps,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_remainder=self.config.drop_remainder,
        )
        self._steps = steps  # its data position goes into checkpoints
        self.plan = Plan.derive(
            self.config,
            global_batch_size=batch_size,
            data_parallel_size=steps.dp,
            num_samples=steps.num_samples,
            epochs=epochs,
            base_lr=self._base_lrs[0],
        )
        pipeline = getattr(self.model, "_trainmesh_pipeline", None)
        if pipeline is not None:  # before any step: every process raises, none waits in a collective
            pipeline.check_batches(
                self.plan.micro_batch_size,
                steps.num_samples,
                self.plan.global_batch_size,
                drop_remainder=self.config.drop_remainder,
            )
        self._meter = ThroughputMeter.for_job(
            peak_flops=self.config.peak_flops,
            dtype=getattr(self.precision, "dtype", None) or torch.float32,
            device_type=runtime.torch_device_type(),
            world_size=runtime.world_size(),
            local_world_size=runtime.cluster_env().local_world_size,
            meta_model=self._meta_model,
        )
        self._apply_lr_scaling(batch_size)
        if self.scheduler is None and self.config.scheduler is not None:
            self.scheduler = self.config.scheduler(self.optimizer)
        if self.is_main_process:
            print(f"[trainmesh] {self.plan.describe()}", flush=True)
            memory = getattr(self.model, "_trainmesh_memory", None)
            if memory and (memory["zero_stage"] or memory["cpu_offload"] != "off"):
                print(f"[trainmesh] memory: {', '.join(f'{k} {v}' for k, v in memory.items())}", flush=True)
            if pipeline is not None:
                print(f"[trainmesh] {pipeline.describe()}", flush=True)
            if self.communication.compressor or self.communication.hierarchical:
                print(f"[trainmesh] gradients: {self.communication.describe()}", flush=True)
        self._stop_local = self.stop_requested = False
        self._beacon = ProgressBeacon()
        self.callbacks.on_train_begin({})
        if resume:  # after on_train_begin, which resets callbacks, so their saved state survives
            self._resume(resume, on_invalid_checkpoint)
        writer = (
            LogWriter(self.config.log_dir, append=bool(resume))
            if self.config.log_dir and self.is_main_process
            else None
        )
        self._expert_load.start(checked=self.config.nonfinite_loss is not None)  # else it reduces on logged steps
        try:
            if self._fault_tolerance is not None:  # joins the Lighthouse; a group behind heals at its first step
                self._ft = TrainerReplicaGroups(self, self._fault_tolerance)
            while self.epoch < epochs and not self.stop_requested:
                if self.epoch_batches_done():  # resumed from a save taken after the epoch's last step
                    logs = self._end_of_resumed_epoch(epochs)
                else:
                    logs = self._train_epoch(steps, epochs, writer)
                if eval_data is not None:
                    logs.update({f"val_{k}": v for k, v in self.evaluate(eval_data, batch_size=batch_size).items()})
                self.history.record_epoch(self.epoch, logs)
                if writer:
                    writer.log_epoch({"epoch": self.epoch, **logs})
                self._bar.close(logs)  # the epoch's closing line, Keras-style
                self.epoch += 1
                self.callbacks.on_epoch_end(self.epoch - 1, logs)
                self._agree_on_stop()
        finally:
            self._expert_load.stop()
            if self._ft is not None:
                self.replica_summary = self._ft.close()  # step, batches_committed, uncommitted_steps
                self._ft = None
            steps.close()
            self._beacon.close()
            if writer:
                writer.close()
        self.callbacks.on_train_end(self.history.last_epoch())
        return self.history

    def _end_of_resumed_epoch(self, epochs: int) -> dict[str, float]:
        """A checkpoint taken after an epoch's last step but before its end (one written by
        ``ModelCheckpoint``/``ShardedCheckpoint`` before they saved that step at the epoch's end
        only, or a user's own save): the epoch's batches are done, so none is trained again; the
        end-of-epoch work (evaluation, history, callbacks) runs once, now. The epoch's training
        loss is not in such a checkpoint and is recorded as nan."""
        if self.is_main_process:
            warnings.warn(
                f"resumed after the last step of epoch {self.epoch + 1} and before its end: running its "
                f"end-of-epoch work now; its training loss is not in the checkpoint (nan)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._bar = ProgressBar(0, epoch=self.epoch + 1, epochs=epochs, enabled=False)
        return {"loss": math.nan}

    def _train_epoch(self, steps: TrainSteps, epochs: int, writer: LogWriter | None) -> dict[str, float]:
        self.model.train()
        for metric in self.metrics:
            metric.reset()
        steps.set_epoch(self.epoch)
        self.callbacks.on_epoch_begin(self.epoch, {})
        self._bar = ProgressBar(
            len(steps) if steps.has_length() else None,
            epoch=self.epoch + 1,
            epochs=epochs,
            enabled=self._show_progress(),
        )
        losses = LossAccumulator()  # since the last sync
        epoch_loss_sum, epoch_samples = 0.0, 0.0
        sized = steps.has_length()
        num_steps = len(steps) if sized else None
        skipped_before = self._skipped()
        iterator = iter(steps)
        step = 0
        self._meter.restart()
        while True:
            started = time.perf_counter()
            if self._ft is not None:
                self._ft.position()  # before the fetch: where this step's batch starts, if it must come again
            micro_batches = next(iterator, None)
            data_wait = time.perf_counter() - started
            if micro_batches is None:
                break
            if self._ft is not None and self._ft.begin_step():  # quorum; True: healed to a peer's state
                iterator = iter(steps)  # at the peers' data position: their batch for this step
                micro_batches, num_steps = next(iterator), step + 1 + len(steps)
            self._meter.observe(micro_batches, self.loss_fn)  # FLOPs per sample, the first time only
            self.callbacks.on_train_batch_begin(step, {})
            self._beacon.mark(self.global_step + 1)
            try:
                record = self._optimizer_step(micro_batches, losses)
                if record is None:  # a fault-tolerant step that did not commit: its batch comes again
                    iterator = iter(steps)
                    continue
            except RuntimeError as error:  # a collective failed: name who did not arrive
                diagnosed = self._beacon.diagnose(error)
                if diagnosed is None:
                    raise
                raise diagnosed from error
            last = sized and step + 1 == num_steps
            logged = (self.global_step % self.config.log_every_n_steps == 0) or last
            record.update(
                epoch=self.epoch,
                step=step,
                data_wait_s=data_wait,
                step_time_s=time.perf_counter() - started,
                **self.communication.step_record(),
                **self._expert_load.step_record(logged),
                **(self._ft.step_record() if self._ft is not None else {}),
            )
            if logged:
                loss, samples = self._sync(losses)
                if samples:  # a window of skipped steps only has no loss (nan), and adds nothing
                    epoch_loss_sum, epoch_samples = epoch_loss_sum + loss * samples, epoch_samples + samples
                rates = self._meter.report(samples)  # over the wall time since the last log, the whole job's
                record.update(loss=loss, **rates)
                self.history.record_step(record)
                if writer:
                    writer.log_step(record)
                shown = {"loss": loss}
                if self.precision.scaler is not None:
                    shown["skipped"] = self._skipped() - skipped_before
                if "comm_bytes" in record:  # this rank's gradient bytes sent / uncompressed (ratio)
                    shown["comm"] = self.communication.progress_text(record)
                if "moe_imbalance" in record:  # the busiest expert's tokens over the mean (expert_load.py)
                    shown["moe"] = record["moe_imbalance"]
                shown.update(self._meter.progress_values(rates))
                self._bar.update(step + 1, shown, record["samples_per_s"])
            self.callbacks.on_train_batch_end(step, record)
            step += 1
            if self.stop_requested:
                break
        if losses.pending:  # steps after the last sync point (unsized data)
            loss, samples = self._sync(losses)
            if samples:
                epoch_loss_sum, epoch_samples = epoch_loss_sum + loss * samples, epoch_samples + samples
        logs = {"loss": epoch_loss_sum / epoch_samples if epoch_samples else math.nan}
        logs.update(self._reduced_metrics(self.metrics))
        if self.nonfinite_steps:
            logs["nonfinite_steps"] = self.nonfinite_steps
        if self.precision.scaler is not None:
            logs["skipped_steps"] = self._skipped() - skipped_before
            logs["loss_scale"] = self.precision.scaler.scale_value
        return logs

    def _optimizer_step(self, micro_batches: list, losses: LossAccumulator) -> dict[str, Any] | None:
        guard = self.config.nonfinite_loss
        scaler = self.precision.scaler
        # Without a loss scaler the gradients are final after backward: their norm rides on the loss
        # check's all-reduce (one collective per step instead of two). A scaler unscales them first, below.
        ft = self._ft  # replica groups: the gradients change (cross-group average) after backward
        ride = guard is not None and scaler is None and self.config.max_grad_norm is not None and ft is None
        # Otherwise the check needs only the losses: on CPU it starts before the last backward and runs
        # beside it (loss_tracking.py); on an accelerator reading the loss early would stall the device.
        early = guard is not None and not ride and self._device_type == "cpu" and ft is None
        self._beacon.phase = "forward/backward and gradient reduction"
        on_outputs = self._update_metrics if ft is None else ft.defer(self._update_metrics)
        forward_backward(
            self.model,
            micro_batches if ft is None else ft.share(micro_batches),
            self.loss_fn,
            self.precision,
            losses,
            on_outputs=on_outputs if self.metrics else None,
            before_last_backward=(lambda: losses.start_check(stop_local=self._stop_local)) if early else None,
        )
        if ft is not None and not ft.commit():  # should_commit gates all that follows
            losses.discard_step()
            return None
        self._beacon.phase = "loss all-reduce (non-finite check, stop request)"
        nonfinite, stop = losses.end_step(
            check=guard is not None,
            stop_local=self._stop_local,
            grad_square=local_grad_square_sum(self.params) if ride else None,
        )
        self.stop_requested = self.stop_requested or stop
        if nonfinite and scaler is None:
            return self._nonfinite_step(guard)
        # Under fp16 a non-finite loss is an overflow like any other: the scaler skips and backs off.
        found_inf = nonfinite or (scaler.unscale_(self.params) if scaler is not None else False)
        grad_norm = None
        self._beacon.phase = "gradient clipping and optimizer step"
        if self.config.max_grad_norm is not None and not found_inf:
            grad_norm = losses.grad_norm if ride else global_grad_norm(self.params)
            clip_gradients_(self.params, self.config.max_grad_norm, grad_norm)
        if not found_inf:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update(found_inf)
        self.global_step += 1
        record: dict[str, Any] = {
            "global_step": self.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped": bool(found_inf),
        }
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if scaler is not None:
            record["loss_scale"] = scaler.scale_value
        return record

    def _nonfinite_step(self, policy: str) -> dict[str, Any]:
        """A non-finite loss somewhere: every process takes the same branch (the flag was all-reduced)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_steps += 1
        self.global_step += 1
        if policy == "stop":
            self.request_stop(f"non-finite loss at step {self.global_step}")
            self.stop_requested = True
        elif policy == "rollback":
            self._rollback()
        if self.is_main_process and self.nonfinite_steps <= 5:
            print(f"[trainmesh] non-finite loss at step {self.global_step}: {policy}", file=sys.stderr, flush=True)
        return {
            "global_step": self.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped": True,
            "nonfinite": True,
        }

    def _sync(self, losses: LossAccumulator) -> tuple[float, float]:
        """One small all-reduce: the loss since the last sync, and whether anyone wants to stop."""
        loss, samples, stop = losses.sync(self._stop_local)
        self.stop_requested = self.stop_requested or stop
        return loss, samples

    def _agree_on_stop(self) -> None:
        if self.stop_requested:
            return
        reduced = all_reduce_small(torch.tensor([1.0 if self._stop_local else 0.0], dtype=torch.float64))
        self.stop_requested = bool(reduced[0] > 0)

    # --- metrics ------------------------------------------------------------------------
    def _update_metrics(self, outputs: Any, targets: Any) -> None:
        from trainmesh._torch.tensor_parallel import batch_to_local

        outputs, targets = batch_to_local(outputs, self.distribution), batch_to_local(targets, self.distribution)
        for metric in self.metrics:
            metric.update(outputs.float() if torch.is_tensor(outputs) else outputs, targets)

    @staticmethod
    def _reduced_metrics(metrics: list[Metric]) -> dict[str, float]:
        """Exact across processes: sums of states are reduced, never means of per-process results."""
        if not metrics:
            return {}
        states = [m.state().to(torch.float64) for m in metrics]
        reduced = all_reduce_small(torch.cat(states))
        out, offset = {}, 0
        for metric, state in zip(metrics, states):
            out[metric.name] = metric.compute(reduced[offset : offset + len(state)])
            offset += len(state)
        return out

    # --- evaluate / predict -------------------------------------------------------------
    def evaluate(self, data: Any, *, batch_size: int | None = None) -> dict[str, float]:
        """Loss and metrics over every sample exactly once; the same number on 1 or N processes."""
        batch_size = batch_size or self.config.eval_batch_size or (self.plan.global_batch_size if self.plan else None)
        metrics = [copy.deepcopy(m) for m in self.metrics]
        self.callbacks.on_test_begin({})
        sums, metric_logs = run_evaluation(self, data, batch_size, metrics)
        logs = {"loss": float(sums[0] / sums[1]) if sums[1] > 0 else math.nan}
        logs.update(metric_logs)
        self.callbacks.on_test_end(logs)
        return logs

    def predict(self, data: Any, *, batch_size: int | None = None) -> torch.Tensor:
        """Outputs for every sample, in dataset order, on every process."""
        batch_size = batch_size or self.config.eval_batch_size or (self.plan.global_batch_size if self.plan else None)
        self.callbacks.on_predict_begin({})
        result = run_prediction(self, data, batch_size)
        self.callbacks.on_predict_end({})
        return result

    # --- helpers ------------------------------------------------------------------------
    def _bind_optimizer(self, optimizer: Any, names_before: dict[int, str]) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise TypeError(
                    f"optimizer must be a torch Optimizer or a callable params -> Optimizer. Received: {optimizer!r}"
                )
            # Frozen parameters (``requires_grad=False``: a fine-tuned base under LoRA) get no optimizer
            # state and, under ZeRO-1, no partition or broadcast: the optimizer sees the trainable ones.
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            return self.distribution.prepare_optimizer(optimizer(trainable), self.model)
        # A distribution may replace parameters (DTensor); point the optimizer at the new ones. A pipeline
        # stage holds some of them only (under any of their names: a tied head's weight on the last stage).
        pipelined = getattr(self.model, "_trainmesh_pipeline", None) is not None
        new_by_name: dict[str, list] = {}
        for name, param in unwrap(self.model).named_parameters():
            new_by_name.setdefault(self._canonical.get(name, name) if pipelined else name, []).append(param)
        for group in optimizer.param_groups:
            rebound = []
            for param in group["params"]:
                name = names_before.get(id(param))
                if name is None or (name not in new_by_name and not pipelined):
                    raise ValueError(
                        "The optimizer holds parameters that are not the model's. Build it from "
                        "model.parameters(), or pass a callable params -> optimizer."
                    )
                rebound.extend(new_by_name.get(name, []))
            if any(p is not q for p, q in zip(group["params"], rebound)) and optimizer.state:
                raise ValueError("The optimizer already has state; pass a fresh one (or a callable) to the Trainer.")
            group["params"] = rebound
        return self.distribution.prepare_optimizer(optimizer, self.model)  # ZeRO-1 shards its state

    def _apply_lr_scaling(self, batch_size: int | None) -> None:
        if self.config.lr_scaling is None or batch_size is None:
            return
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = scale_lr(base, batch_size, self.config.base_batch_size, rule=self.config.lr_scaling)
            group.pop("initial_lr", None)  # a scheduler built later takes the scaled lr as its base

    def _skipped(self) -> int:
        return self.precision.scaler.skipped_steps if self.precision.scaler is not None else 0

    def _show_progress(self) -> bool:
        if not self.is_main_process or self.config.progress is False:
            return False
        return True if self.config.progress is True else (sys.stdout is not None)
