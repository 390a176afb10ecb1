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


def resolve_memory_options(distribution, *, zero_stage: int | None = None, cpu_offload: bool | None = None
                           ) -> MemoryOptions:
    own = getattr(distribution, "memory", None) or MemoryOptions()
    return own.replace(zero_stage=zero_stage, cpu_offload=cpu_offload)


def parallelize(model: nn.Module, distribution, *, zero_stage: int | None = None,
                activation_checkpointing: Any = None, cpu_offload: bool | None = None,
                mixed_precision: torch.dtype | None = None, ddp_options: dict | None = None,
                compile: Any = False, compile_backend: str = "inductor",
                compile_mode: str | None = None) -> nn.Module:
    """Apply ``distribution`` to ``model``; returns the module to train.

    ``mixed_precision`` is the compute dtype of a mixed-precision run (FSDP2 gathers parameters
    in it; the fp32 shards stay the optimizer's master copy); DDP stages use autocast alone.

    >>> model = parallelize(MyModel(), tm.DataParallel(zero_stage=3))   # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    options = resolve_memory_options(distribution, zero_stage=zero_stage, cpu_offload=cpu_offload)  # validates
    _refuse_meta_tensors(model)
    from trainmesh.distribution.data_parallel import DataParallel
    from trainmesh.distribution.model_parallel import ModelParallel

    if not isinstance(distribution, (DataParallel, ModelParallel)):
        # A user's own Distribution subclass: its distribute_model decides, after checkpointing.
        if activation_checkpointing is not None:
            model = apply_activation_checkpointing(model, activation_checkpointing)
        model = apply_compile(model, compile, backend=compile_backend, device_type=runtime.torch_device_type(),
                              inductor_mode=compile_mode)
        return distribution.distribute_model(model)
    is_tp = isinstance(distribution, ModelParallel)
    if is_tp and options.zero_stage == 1:
        raise ValueError("ModelParallel shards optimizer state with its parameters at stages 2-3 (FSDP2 over the "
                         f"batch axis); stage 1 alone is not offered there. Received: zero_stage=1")
    if ddp_options and options.zero_stage >= 1:
        raise ValueError(f"DDP options do not apply to zero_stage {options.zero_stage} (FSDP2). "
                         f"Received: {sorted(ddp_options)}")
    pipeline = getattr(distribution, "pipeline", None)
    if pipeline is not None and distribution.device_mesh.axis_size(pipeline.axis) > 1:
        # 0. pipeline: split first, so that every later step sees one stage's modules only (a stage
        # is a pruned copy of the model, parameter names unchanged); each stage is then laid out,
        # checkpointed and sharded exactly as a whole model would be, on its own sub-mesh.
        from .pipeline_apply import apply_pipeline

        return apply_pipeline(model, distribution, options, lambda stage: _apply_layers(
            stage, distribution, options, activation_checkpointing, mixed_precision, ddp_options, pipelined=True,
            compile=compile, compile_backend=compile_backend, compile_mode=compile_mode))
    return _apply_layers(model, distribution, options, activation_checkpointing, mixed_precision, ddp_options,
                         compile=compile, compile_backend=compile_backend, compile_mode=compile_mode)


def _refuse_meta_tensors(model: nn.Module) -> None:
    """A model on the meta device has no values to start the processes from. Every layout here
    starts every copy from the first process's weights (DDP's rule); initialising sharded meta
    parameters in place would need DTensor's random-number tracker, which on CPU meshes gives
    every shard the same draws. Say so before any collective, instead of torch's copy error."""
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if meta:
        raise ValueError(f"distribute_model needs real weights; {len(meta)} parameters/buffers of this model are on "
                         f"the meta device (first: {meta[0]!r}). Build the model on the CPU (ZeRO-3 and the pipeline "
                         f"keep only this process's share once it is distributed), or materialise it first "
                         f"(model.to_empty(device='cpu') and your initialiser). Received: {type(model).__name__}")


def _apply_layers(model: nn.Module, distribution, options: MemoryOptions, activation_checkpointing: Any,
                  mixed_precision: torch.dtype | None, ddp_options: dict | None, *, pipelined: bool = False,
                  compile: Any = False, compile_backend: str = "inductor",
                  compile_mode: str | None = None) -> nn.Module:
    """Steps 1-3 on a whole model or one pipeline stage. A stage's gradients over the batch axis are
    reduced by FSDP2 (ZeRO 2-3) or by the pipeline runner after its schedule, never by DDP or TP hooks,
    which would communicate once per microbatch."""
    from trainmesh.distribution.model_parallel import ModelParallel

    is_tp = isinstance(distribution, ModelParallel)
    # 1. tensor parallelism (with ZeRO, FSDP2 reduces gradients over the batch axis instead of TP's hooks)
    if is_tp:
        from .tensor_parallel import apply_model_parallel

        model = apply_model_parallel(model, distribution, reduce_grads=options.zero_stage == 0 and not pipelined,
                                     whole_model=not pipelined)
    # 2. activation checkpointing
    if activation_checkpointing is not None:
        model = apply_activation_checkpointing(model, activation_checkpointing, model_mechanism=not pipelined)
    # 3. compile: each repeated block (or the whole model) in place, before DDP / FSDP2 wrap them
    model = apply_compile(model, compile, backend=compile_backend, device_type=runtime.torch_device_type(),
                          inductor_mode=compile_mode)
    if pipelined and options.zero_stage < 2:
        model.to(runtime.local_torch_device())
        model._trainmesh_memory = {"zero_stage": options.zero_stage, "cpu_offload": "off"}
        return model
    if is_tp and options.zero_stage == 0:
        return model  # TP already reduces gradients over the batch axis (its grad hooks)
    # 4. data parallelism / ZeRO over the batch axis
    if options.zero_stage >= 1:
        from .mesh import to_torch_mesh
        from .zero import apply_fsdp

        # Tensor-parallel parameters are DTensors on the model axis; FSDP2 shards them (and the
        # plain ones) over the batch axis of the same mesh: torchtitan's 2-D layout.
        torch_mesh = to_torch_mesh(distribution.device_mesh)
        dp_mesh = torch_mesh[distribution.batch_dim_name] if torch_mesh.ndim > 1 else torch_mesh
        return apply_fsdp(model, dp_mesh, zero_stage=options.zero_stage, shard_unit=options.shard_unit,
                          compute_dtype=mixed_precision, reduce_dtype=options.reduce_dtype,
                          cpu_offload=options.cpu_offload)
    from .data_parallel import apply_data_parallel

    model = apply_data_parallel(model, distribution, **(ddp_options or {}))
    model._trainmesh_memory = {"zero_stage": options.zero_stage, "cpu_offload": "off"}
    return model
