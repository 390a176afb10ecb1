"""``TrainerConfig``: every knob of the loop, validated at construction, and the values derived
from it (``Plan``) computed and printed before the first step.

global batch = micro-batch x accumulation steps x data-parallel size
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from .precision import PRECISIONS
from .schedules import scale_lr

_LR_RULES = ("linear", "sqrt")


@dataclass(kw_only=True)
class TrainerConfig:
    """Configuration of :class:`trainmesh.Trainer` (all keyword-only).

    >>> TrainerConfig(precision="bf16-mixed", grad_accum_steps=2).grad_accum_steps
    2
    """

    precision: str = "fp32"
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    lr_scaling: str | None = None  # "linear" | "sqrt": scale the optimizer's lr by global / base batch
    base_batch_size: int | None = None
    scheduler: Callable[[Any], Any] | None = None  # optimizer -> LRScheduler, stepped once per optimizer step
    log_dir: str | Path | None = None
    log_every_n_steps: int = 1  # also how often a stop request is looked for, and the loss all-reduced
    progress: bool | str = "auto"
    seed: int = 0
    # Initial weights (see trainmesh._torch.materialize): a Hugging Face checkpoint directory or a .safetensors
    # file, each process reading only its own shards; a meta-built model without it is initialised (seed `seed`)
    weights: str | Path | None = None
    drop_remainder: bool = False
    eval_batch_size: int | None = None
    # What a non-finite loss on any process does to its step: "skip" it, "stop" training, or
    # "rollback" to the last checkpoint (then skip); None: no check (and no per-step all-reduce).
    nonfinite_loss: str | None = "skip"
    # Memory (see trainmesh._torch.parallelize): None = the distribution's own setting.
    zero_stage: int | None = None  # 0..3: DDP, + sharded optimizer state, + sharded gradients, + sharded parameters
    cpu_offload: bool = False
    activation_checkpointing: str | None = None  # None | "full" | "selective" | "every:K" | a regex on module paths
    # torch.compile (see trainmesh._torch.compile): False, True (the whole model), "regional" (each repeated
    # block, torchtitan-style); compile_backend is torch.compile's backend ("inductor"; "aot_eager" traces only);
    # compile_mode is its mode (None: torch's default; "reduce-overhead": CUDA graphs; "max-autotune", ...)
    compile: bool | str = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    # torch's optimizer kernels: "fused", "foreach", "for-loop"; None = as the optimizer was built
    optimizer_implementation: str | None = None
    # The hardware's FLOP/s for MFU (per node on CPU, per GPU): None = the cached `trainmesh env --peak` probe
    peak_flops: float | None = None
    # Gradient communication (see trainmesh.trainer.communication): a compressor spec for the
    # data-parallel reduction ("fp16", "int8", "topk:0.01", "powersgd:2", a Compressor), and
    # hierarchical all-reduce (None: on when the job spans more than one node).
    compression: Any = None
    hierarchical_allreduce: bool | None = None
    communication: str | None = None  # "auto": probe the links once, pick hierarchy/buckets/compression

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}. Received: precision={self.precision!r}")
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ValueError(
                f"grad_accum_steps must be an int >= 1. Received: grad_accum_steps={self.grad_accum_steps!r}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None. Received: max_grad_norm={self.max_grad_norm!r}")
        if self.lr_scaling is not None:
            if self.lr_scaling not in _LR_RULES:
                raise ValueError(
                    f"lr_scaling must be one of {_LR_RULES} or None. Received: lr_scaling={self.lr_scaling!r}"
                )
            if not self.base_batch_size or self.base_batch_size < 1:
                raise ValueError(
                    f"lr_scaling={self.lr_scaling!r} needs base_batch_size (the batch the lr was tuned for). "
                    f"Received: base_batch_size={self.base_batch_size!r}"
                )
        if self.log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1. Received: log_every_n_steps={self.log_every_n_steps!r}")
        if self.progress not in (True, False, "auto"):
            raise ValueError(f"progress must be True, False or 'auto'. Received: progress={self.progress!r}")
        if self.nonfinite_loss not in (None, "skip", "stop", "rollback"):
            raise ValueError(
                "nonfinite_loss must be 'skip', 'stop', 'rollback' or None. "
                f"Received: nonfinite_loss={self.nonfinite_loss!r}"
            )
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2, 3 or None. Received: zero_stage={self.zero_stage!r}")
        if not (self.hierarchical_allreduce is None or isinstance(self.hierarchical_allreduce, bool)):
            raise ValueError(
                "hierarchical_allreduce must be True, False or None (auto: on across nodes). "
                f"Received: hierarchical_allreduce={self.hierarchical_allreduce!r}"
            )
        if self.compression is not None:
            from trainmesh.compression import get_compressor

            try:  # parse now (a bad spec fails here, not at the first backward); the Trainer builds its own
                get_compressor(self.compression)
            except (TypeError, ValueError) as error:
                raise ValueError(f"compression: {error} Received: compression={self.compression!r}") from error
        from trainmesh._torch.compile import check_compile_mode, check_inductor_mode

        check_compile_mode(self.compile)
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(
                f"compile_backend must be a torch.compile backend name. "
                f"Received: compile_backend={self.compile_backend!r}"
            )
        check_inductor_mode(self.compile_mode, self.compile_backend)
        from .step import OPTIMIZER_IMPLEMENTATIONS

        if self.optimizer_implementation not in OPTIMIZER_IMPLEMENTATIONS:
            raise ValueError(
                f"optimizer_implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}. "
                f"Received: optimizer_implementation={self.optimizer_implementation!r}"
            )
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float)) and self.peak_flops > 0):
            raise ValueError(
                f"peak_flops must be a FLOP/s figure > 0 or None. Received: peak_flops={self.peak_flops!r}"
            )
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1. Received: eval_batch_size={self.eval_batch_size!r}")

    @classmethod
    def from_kwargs(cls, config: "TrainerConfig | None", kwargs: dict) -> "TrainerConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown Trainer option(s) {unknown}. Known: {sorted(names)}")
        if config is None:
            return cls(**kwargs)
        if kwargs:
            raise ValueError(
                f"Pass either config=TrainerConfig(...) or keyword options, not both. Received: {sorted(kwargs)}"
            )
        return config


@dataclass(frozen=True)
class Plan:
    """What one ``fit`` will do, derived from the config, the batch size and the data."""

    global_batch_size: int | None  # None: set by the batches an iterable yields
    micro_batch_size: int | None
    grad_accum_steps: int
    data_parallel_size: int
    steps_per_epoch: int | None
    epochs: int
    base_lr: float | None
    lr: float | None
    precision: str

    @classmethod
    def derive(
        cls,
        config: TrainerConfig,
        *,
        global_batch_size: int | None,
        data_parallel_size: int,
        num_samples: int | None,
        epochs: int,
        base_lr: float | None,
    ) -> "Plan":
        per_step = config.grad_accum_steps * data_parallel_size
        if global_batch_size is None:
            if config.lr_scaling is not None:
                raise ValueError(f"lr_scaling={config.lr_scaling!r} needs fit(batch_size=...), the global batch.")
            return cls(
                None,
                None,
                config.grad_accum_steps,
                data_parallel_size,
                None,
                epochs,
                base_lr,
                base_lr,
                config.precision,
            )
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ValueError(
                "batch_size (the global batch) must be a multiple of grad_accum_steps x data-parallel size "
                f"= {config.grad_accum_steps} x {data_parallel_size} = {per_step}. "
                f"Received: batch_size={global_batch_size}"
            )
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1. Received: epochs={epochs}")
        steps = None
        if num_samples is not None:
            steps = (
                num_samples // global_batch_size
                if config.drop_remainder
                else math.ceil(num_samples / global_batch_size)
            )
            if steps == 0:
                raise ValueError(
                    f"The dataset ({num_samples} samples) is smaller than one global batch of {global_batch_size}."
                )
        lr = base_lr
        if base_lr is not None and config.lr_scaling is not None:
            lr = scale_lr(base_lr, global_batch_size, config.base_batch_size, rule=config.lr_scaling)
        return cls(
            global_batch_size,
            global_batch_size // per_step,
            config.grad_accum_steps,
            data_parallel_size,
            steps,
            epochs,
            base_lr,
            lr,
            config.precision,
        )

    def describe(self) -> str:
        lr = (
            "-"
            if self.lr is None
            else f"{self.lr:.6g}" + ("" if self.lr == self.base_lr else f" (scaled from {self.base_lr:.6g})")
        )
        if self.global_batch_size is None:
            return (
                f"global batch from the data; accumulation {self.grad_accum_steps} x data-parallel "
                f"{self.data_parallel_size}; epochs {self.epochs}; lr {lr}; precision {self.precision}"
            )
        return (
            f"global batch {self.global_batch_size} = micro-batch {self.micro_batch_size} x accumulation "
            f"{self.grad_accum_steps} x data-parallel {self.data_parallel_size}; "
            f"steps/epoch {self.steps_per_epoch if self.steps_per_epoch is not None else 'unknown'}; "
            f"epochs {self.epochs}; lr {lr}; precision {self.precision}"
        )
