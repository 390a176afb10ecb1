"""``Trainer``: the training loop, and only the loop.

Where tensors live comes from the distribution (DDP or DTensor underneath); how to run a
step from ``step.py``; precision from ``precision.py``; the rest are callbacks, metrics and
logs. Read ``fit`` top to bottom: that is the whole algorithm. Its parts, one module each:
an epoch's steps (``epoch.py``), one optimizer step (``optimizer_step.py``), what the
constructor checks and binds (``construction.py``), evaluation (``evaluation.py``) and the
state a checkpoint holds (``trainer_state.py``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch

from trainmesh import runtime
from trainmesh._torch.parallelize import parallelize
from trainmesh._torch.sync import unwrap
from trainmesh.checkpoint.survey import check_on_invalid
from trainmesh.comm import ProgressBeacon
from trainmesh.distribution.adapters import check_lora_targets
from trainmesh.ft.trainer_hook import TrainerReplicaGroups, check_fault_tolerance

from .callbacks import Callback, CallbackList
from .communication import install_communication
from .construction import bind_optimizer, resolve_distribution
from .epoch import EpochLoop
from .expert_load import ExpertLoad
from .config import Plan, TrainerConfig
from .data_input import TrainSteps
from .evaluation import run_evaluation, run_prediction
from .history import History
from .log_writer import LogWriter
from .metrics import Metric, resolve_metric
from .optimizer_step import OptimizerStep
from .precision import build_precision
from .schedules import scale_lr
from .step import set_optimizer_implementation
from .throughput import ThroughputMeter, meta_copy
from .trainer_state import TrainerState


class Trainer(EpochLoop, OptimizerStep, TrainerState):
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
        self.distribution = resolve_distribution(distribution)
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
        self.optimizer = bind_optimizer(optimizer, self.model, self.distribution, names_before, self._canonical)
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
    def _apply_lr_scaling(self, batch_size: int | None) -> None:
        if self.config.lr_scaling is None or batch_size is None:
            return
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = scale_lr(base, batch_size, self.config.base_batch_size, rule=self.config.lr_scaling)
            group.pop("initial_lr", None)  # a scheduler built later takes the scaled lr as its base
