"""``parallelize``: THE one place that turns a model into its distributed form, in a fixed order.

1. tensor parallelism (ModelParallel's layout map -> DTensor parameters): it changes what a
   parameter *is* (a DTensor on the model axis), so everything after sees the final shapes;
2. activation checkpointing: wraps sub-modules, which must happen before FSDP turns them
   into units (FSDP's hooks then run once per unit, around the checkpointed region) and
   after TP (the recomputed forward must redo TP's collectives too);
3. data parallelism over the batch axis, last because it wraps or shards whatever the model
   has become: DDP (stage 0), DDP + sharded optimizer (stage 1; the optimizer part is
   ``Distribution.prepare_optimizer``), FSDP2 (stages 2-3).

Arguments left ``None`` mean "the distribution's own setting".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainmesh.distribution.memory_options import MemoryOptions

from .activation_checkpointing import apply_activation_checkpointing


def resolve_memory_options(distribution, *, zero_stage: int | None = None, cpu_offload: bool | None = None
                           ) -> MemoryOptions:
    own = getattr(distribution, "memory", None) or MemoryOptions()
    return own.replace(zero_stage=zero_stage, cpu_offload=cpu_offload)


def parallelize(model: nn.Module, distribution, *, zero_stage: int | None = None,
                activation_checkpointing: Any = None, cpu_offload: bool | None = None,
                mixed_precision: torch.dtype | None = None, ddp_options: dict | None = None) -> nn.Module:
    """Apply ``distribution`` to ``model``; returns the module to train.

    ``mixed_precision`` is the compute dtype of a mixed-precision run (FSDP2 gathers parameters
    in it; the fp32 shards stay the optimizer's master copy); DDP stages use autocast alone.

    >>> model = parallelize(MyModel(), tm.DataParallel(zero_stage=3))   # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"distribute_model expects a torch.nn.Module. Received: {type(model).__name__}")
    options = resolve_memory_options(distribution, zero_stage=zero_stage, cpu_offload=cpu_offload)  # validates
    from trainmesh.distribution.data_parallel import DataParallel
    from trainmesh.distribution.model_parallel import ModelParallel

    if not isinstance(distribution, (DataParallel, ModelParallel)):
        # A user's own Distribution subclass: its distribute_model decides, after checkpointing.
        if activation_checkpointing is not None:
            model = apply_activation_checkpointing(model, activation_checkpointing)
        return distribution.distribute_model(model)
    is_tp = isinstance(distribution, ModelParallel)
    if is_tp and options.zero_stage == 1:
        raise ValueError("ModelParallel shards optimizer state with its parameters at stages 2-3 (FSDP2 over the "
                         f"batch axis); stage 1 alone is not offered there. Received: zero_stage=1")
    if ddp_options and options.zero_stage >= 2:
        raise ValueError(f"DDP options do not apply to zero_stage {options.zero_stage} (FSDP2). "
                         f"Received: {sorted(ddp_options)}")

    # 1. tensor parallelism (with ZeRO, FSDP2 reduces gradients over the batch axis instead of TP's hooks)
    if is_tp:
        from .tensor_parallel import apply_model_parallel

        model = apply_model_parallel(model, distribution, reduce_grads=options.zero_stage == 0)
    # 2. activation checkpointing
    if activation_checkpointing is not None:
        model = apply_activation_checkpointing(model, activation_checkpointing)
    if is_tp and options.zero_stage == 0:
        return model  # TP already reduces gradients over the batch axis (its grad hooks)
    # 3. data parallelism / ZeRO over the batch axis
    if options.zero_stage >= 2:
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
