"""``parallelize``: THE one place that turns a model into its distributed form, in a fixed order.

0. pipeline (a ``pipe`` axis and ``pipeline=``): the model is split into stages first, and steps
   1-3 run on each stage (``pipeline_apply``), as torchtitan applies PP, then TP, then FSDP;
1. tensor parallelism (ModelParallel's layout map -> DTensor parameters): it changes what a
   parameter *is* (a DTensor on the model axis), so everything after sees the final shapes;
2. activation checkpointing: wraps sub-modules, which must happen before FSDP turns them
   into units (FSDP's hooks then run once per unit, around the checkpointed region) and
   after TP (the recomputed forward must redo TP's collectives too);
3. torch.compile (``compile=``, see ``compile.py``): after layouts and checkpointing, so the
   compiled graphs trace the DTensor ops and the checkpointed forward as they will run; before
   DDP / FSDP2, whose communicating hooks then stay outside the compiled regions (dynamo skips
   FSDP2's hooks; DDP's fire on gradients) and whose units are the compiled blocks themselves;
4. data parallelism over the batch axis, last because it wraps or shards whatever the model
   has become: DDP (stage 0), FSDP2 (stages 1-3; ``zero.py`` says how the stages differ).

A model built on the meta device goes through 0-4 as it is (torchtitan's way), and is
materialised where its tensors have their final, local shapes (``materialize.py``): after FSDP2,
after TP when there is no FSDP2, before DDP (which broadcasts real values), per pipeline stage.
``weights=`` (safetensors files) fill it, each process reading its own byte ranges; otherwise
the model's initialisers do, unit by unit. Files are checked against the model first, locally,
so a bad file is the same error on every process and no collective is left waiting.

Arguments left ``None`` mean "the distribution's own setting".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainmesh import runtime
from trainmesh.distribution.memory_options import MemoryOptions

from .activation_checkpointing import apply_activation_checkpointing
from .compile import apply_compile
from .materialize import MaterializePlan, materialize, prepare


def resolve_memory_options(
    distribution, *, zero_stage: int | None = None, cpu_offload: bool | None = None
) -> MemoryOptions:
    own = getattr(distribution, "memory", None) or MemoryOptions()
    return own.replace(zero_stage=zero_stage, cpu_offload=cpu_offload)


def parallelize(
    model: nn.Module,
    distribution,
    *,
    zero_stage: int | None = None,
    activation_checkpointing: Any = None,
    cpu_offload: bool | None = None,
    mixed_precision: torch.dtype | None = None,
    ddp_options: dict | None = None,
    compile: Any = False,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    weights: Any = None,
    init_seed: int | None = None,
) -> nn.Module:
    """Apply ``distribution`` to ``model``; returns the module to train.

    ``model`` may be built on the meta device; ``weights`` (a Hugging Face checkpoint directory or a
    ``.safetensors`` file) fills it, or the model's own initialisers seeded by ``init_seed`` (default:
    the first process's ``torch.initial_seed()``) do. ``weights`` also loads into a real model.

    ``mixed_precision`` is the compute dtype of a mixed-precision run (FSDP2 gathers an fp32 model's
    parameters in it, and a model with a 16-bit frozen base as stored: ``zero.gather_dtype``; the
    fp32 shards stay the optimizer's master copy); DDP stages use autocast alone.

    >>> model = parallelize(MyModel(), tm.DataParallel(zero_stage=3))   # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    options = resolve_memory_options(distribution, zero_stage=zero_stage, cpu_offload=cpu_offload)  # validates
    fill = prepare(model, weights, 0)  # local checks of the files against the model, before any collective
    if fill is not None and fill.meta:
        fill.seed = _agreed_seed(init_seed)
    from trainmesh.distribution.data_parallel import DataParallel
    from trainmesh.distribution.model_parallel import ModelParallel

    if not isinstance(distribution, (DataParallel, ModelParallel)):
        # A user's own Distribution subclass: its distribute_model decides, after checkpointing.
        if activation_checkpointing is not None:
            model = apply_activation_checkpointing(model, activation_checkpointing)
        model = apply_compile(
            model, compile, backend=compile_backend, device_type=runtime.torch_device_type(), inductor_mode=compile_mode
        )
        return distribution.distribute_model(materialize(model, fill, runtime.local_torch_device()))
    is_tp = isinstance(distribution, ModelParallel)
    if is_tp and options.zero_stage == 1:
        raise ValueError(
            "ModelParallel shards optimizer state with its parameters at stages 2-3 (FSDP2 over the "
            "batch axis); stage 1 alone is not offered there. Received: zero_stage=1"
        )
    if ddp_options and options.zero_stage >= 1:
        raise ValueError(
            f"DDP options do not apply to zero_stage {options.zero_stage} (FSDP2). Received: {sorted(ddp_options)}"
        )
    pipeline = getattr(distribution, "pipeline", None)
    if pipeline is not None and distribution.device_mesh.axis_size(pipeline.axis) > 1:
        # 0. pipeline: split first, so that every later step sees one stage's modules only (a stage
        # is a pruned copy of the model, parameter names unchanged); each stage is then laid out,
        # checkpointed and sharded exactly as a whole model would be, on its own sub-mesh.
        from .pipeline_apply import apply_pipeline

        return apply_pipeline(
            model,
            distribution,
            options,
            lambda stage: _apply_layers(
                stage,
                distribution,
                options,
                activation_checkpointing,
                mixed_precision,
                ddp_options,
                pipelined=True,
                compile=compile,
                compile_backend=compile_backend,
                compile_mode=compile_mode,
                fill=fill,
            ),
        )
    return _apply_layers(
        model,
        distribution,
        options,
        activation_checkpointing,
        mixed_precision,
        ddp_options,
        compile=compile,
        compile_backend=compile_backend,
        compile_mode=compile_mode,
        fill=fill,
    )


def _agreed_seed(init_seed: int | None) -> int:
    """The initialisation seed, the same on every process: the user's, or the first process's."""
    if init_seed is not None:
        return int(init_seed)
    seed = torch.tensor([torch.initial_seed() & ((1 << 62) - 1)], dtype=torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast(seed, src=0)
    return int(seed.item())


def _apply_layers(
    model: nn.Module,
    distribution,
    options: MemoryOptions,
    activation_checkpointing: Any,
    mixed_precision: torch.dtype | None,
    ddp_options: dict | None,
    *,
    pipelined: bool = False,
    compile: Any = False,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    fill: MaterializePlan | None = None,
) -> nn.Module:
    """Steps 1-3 on a whole model or one pipeline stage. A stage's gradients over the batch axis are
    reduced by FSDP2 (ZeRO 2-3) or by the pipeline runner after its schedule, never by DDP or TP hooks,
    which would communicate once per microbatch."""
    from trainmesh.distribution.model_parallel import ModelParallel

    is_tp = isinstance(distribution, ModelParallel)
    expert_plan = None
    if is_tp:  # experts laid out over an axis (expert_layout.py): checked here, before any collective
        from trainmesh.distribution.expert_layout import build_expert_plan

        expert_plan = build_expert_plan(model, distribution)
    if expert_plan is not None and fill is not None and fill.meta and options.zero_stage == 0:
        # TP fills a meta model at stage 0: its experts must be this process's shards by then
        from .expert_parallel import lay_out_meta_experts

        lay_out_meta_experts(model, distribution, expert_plan)
    # 1. tensor parallelism (with ZeRO, FSDP2 reduces gradients over the batch axis instead of TP's hooks)
    if is_tp:
        from .tensor_parallel import apply_model_parallel

        model = apply_model_parallel(
            model,
            distribution,
            reduce_grads=options.zero_stage == 0 and not pipelined,
            whole_model=not pipelined,
            fill=fill if options.zero_stage == 0 else None,
            skip_paths=expert_plan.param_paths() if expert_plan else frozenset(),
        )
    # 1b. expert parallelism: after TP's broadcast (every process slices the same experts), before
    # checkpointing, compile and FSDP2, which must see the experts as the Shard(0) DTensors they become.
    if expert_plan is not None:
        from .expert_parallel import apply_expert_parallel

        beside_sequence = getattr(distribution, "sequence", None) is not None
        model = apply_expert_parallel(
            model,
            distribution,
            expert_plan,
            zero_stage=options.zero_stage,
            reduce_grads=options.zero_stage == 0 and not pipelined and not beside_sequence,
        )
        if beside_sequence:  # the sequence axis's processes hold the same experts: their gradients summed too
            from .expert_grads import apply_expert_grads_beside_sequence

            apply_expert_grads_beside_sequence(
                model, distribution, expert_plan, reduce_grads=options.zero_stage == 0 and not pipelined
            )
    # 1c. a sequence axis (context parallelism): attention over the split sequence, set before
    # checkpointing and compile, which recompute and trace the attention as it will run.
    if getattr(distribution, "sequence", None) is not None:
        from .context_parallel import apply_context_parallel

        model = apply_context_parallel(model, distribution)
    # 2. activation checkpointing
    if activation_checkpointing is not None:
        # Compiled experts: torch's hooks, not the model's own checkpointing. Dynamo traces the model's
        # checkpoint call as one region and cannot pass the eager dispatch inside it, so the whole block ran
        # eager; the hooks run outside the compiled forward, which then breaks at the dispatch only.
        own = not pipelined and not (compile is not False and expert_plan is not None)
        model = apply_activation_checkpointing(model, activation_checkpointing, model_mechanism=own)
    # 3. compile: each repeated block (or the whole model) in place, before DDP / FSDP2 wrap them
    model = apply_compile(
        model, compile, backend=compile_backend, device_type=runtime.torch_device_type(), inductor_mode=compile_mode
    )
    device = runtime.local_torch_device()
    if pipelined and options.zero_stage < 2:
        materialize(model, fill, device)
        model.to(device)
        model._trainmesh_memory = {"zero_stage": options.zero_stage, "cpu_offload": "off"}
        return model
    if is_tp and options.zero_stage == 0:
        return materialize(model, fill, device)  # TP already reduces gradients over the batch axis (its grad hooks)
    # 4. data parallelism / ZeRO over the batch axis
    if options.zero_stage >= 1:
        from .mesh import to_torch_mesh
        from .zero import apply_fsdp

        # Tensor-parallel parameters are DTensors on the model axis; FSDP2 shards them (and the
        # plain ones) over the batch axis of the same mesh: torchtitan's 2-D layout.
        torch_mesh = to_torch_mesh(distribution.device_mesh)
        dp_mesh = torch_mesh[distribution.batch_dim_name] if torch_mesh.ndim > 1 else torch_mesh
        if getattr(distribution, "sequence", None) is not None:  # shards over data x seq together
            from .context_parallel import gradient_mesh

            dp_mesh = gradient_mesh(torch_mesh, distribution)
        model = apply_fsdp(
            model,
            dp_mesh,
            zero_stage=options.zero_stage,
            shard_unit=options.shard_unit,
            compute_dtype=mixed_precision,
            reduce_dtype=options.reduce_dtype,
            cpu_offload=options.cpu_offload,
            keep_frozen_gathered=options.keep_frozen_gathered,
        )
        return materialize(model, fill, device)  # FSDP2's shards only
    from .data_parallel import apply_data_parallel

    model = apply_data_parallel(materialize(model, fill, device), distribution, **(ddp_options or {}))
    model._trainmesh_memory = {"zero_stage": options.zero_stage, "cpu_offload": "off"}
    return model
