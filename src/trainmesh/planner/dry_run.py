"""A dry run of the real parallelization code for one rank of an N-rank world, on torch's fake
process group, with fake tensors: nothing is allocated, nothing is sent.

For a representative rank ``r``:

1. ``init_process_group("fake", FakeStore(), rank=r, world_size=N)``: every collective returns
   at once without moving data, but the process groups, their sizes and ranks are real;
2. the model (built on the meta device) is copied into fake tensors that claim the CPU
   (``meta_model.to_fake``), so kernels dispatch as on a real CPU run;
3. trainmesh's own ``parallelize`` (tensor layouts, activation checkpointing, DDP/FSDP2, the
   pipeline split) runs on it, unchanged: the parameters it leaves behind are the ones training
   would have, and their local shards' storages are what this rank holds;
4. the optimizer is built over those parameters (``Distribution.prepare_optimizer`` for ZeRO-1)
   and one forward, backward and optimizer step run under ``FakeTensorMode`` with three
   observers: ``CollectiveCounter`` (collectives per axis), ``op_costs.OpProfile`` (every op with
   its FLOPs, by ``flops.LocalFlops``'s formulas on the local shards, and bytes) and saved-tensor
   hooks (bytes autograd keeps for backward; with checkpointing, the checkpointed modules'
   inputs and the largest re-run in backward, ``recompute.RecomputeBytes``). A pipeline stage runs its
   ``StageModule`` on one microbatch (``dry_run_pipeline.py``).

``measure_step`` (``step_measurement.py``) is steps 3-4 alone: on a real process group with real
tensors it measures a real step the same way, which is how the tests and
``benchmarks/plan_accuracy.py`` check plans.

Two things are bridged, each for a reason in torch, not in trainmesh (see ``_bridge_*``):

* ``nn.Module.to`` swaps FakeTensor parameters (``torch.utils.swap_tensors``), which torch
  refuses for fakes it tracks; the fakes are already on the target device, so the planner's
  copy of the model gets a ``to`` that returns it unchanged (this instance only);
* DDP's C++ reducer cannot finish an all-reduce on the fake backend (its hook future carries no
  tensor), so DDP's backward runs under ``no_sync`` and its all-reduces are read from DDP's
  own bucket assignment (``_get_ddp_logging_data()["bucket_sizes"]``).
"""

from __future__ import annotations

import time
import types
import warnings
from typing import Any

import torch
from torch import nn

from .mesh_spec import MeshSpec
from .rank_result import RankResult
from .step_measurement import _storage_bytes, measure_step

# torch warnings a dry run sets off that do not apply to it, kept out of the planner's output:
# * ``copy.deepcopy`` of a FakeTensor (the pipeline split copies the fake model into its stages)
#   reads the fake's data pointer inside torch's own ``Tensor.__deepcopy__``; the copy is right;
# * FSDP2 warns when the root module returns a view (a transformers model's logits under fake
#   tensors), because an in-place op on it would skip the all-gather; the dry run's loss
#   (``_loss``, or the model's own) is out of place.
_FALSE_ALARMS = (
    r"Accessing the data pointer of FakeTensor is deprecated",
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
)


def _bridge_module_to(model: nn.Module) -> None:
    model.to = types.MethodType(lambda self, *args, **kwargs: self, model)


def _default_batch(model: nn.Module, micro_batch: int, seq_len: int | None, mode) -> tuple[tuple, dict]:
    """Token ids for a model that starts with an embedding (``labels=`` too for a transformers model)."""
    vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if vocab is None or seq_len is None:
        raise ValueError(
            "The dry run feeds token ids: the model needs an nn.Embedding and seq_len must be given. "
            f"Received: seq_len={seq_len!r}, embedding={'yes' if vocab else 'none'}"
        )
    with mode:
        ids = torch.zeros((micro_batch, seq_len), dtype=torch.long)
    if _is_hf(model):
        return (), {"input_ids": ids, "labels": ids}
    return (ids,), {}


def _is_hf(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def run_rank(
    meta_model: nn.Module,
    spec: MeshSpec,
    rank: int,
    *,
    zero_stage: int,
    activation_checkpointing: Any,
    precision: str,
    micro_batch: int,
    seq_len: int | None,
    optimizer: Any = "adam",
    example_input: Any = None,
    microbatches: int = 1,
    schedule: str = "1f1b",
    boundary: tuple | None = None,
) -> RankResult:
    """Dry-run ``parallelize`` for ``rank`` of ``spec``; see the module docstring. ``boundary`` is the
    (shape, dtype) a pipeline stage receives (from the first stage's dry run)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmesh import runtime

    from .activations import _to_fake_input
    from .meta_model import to_fake

    if dist.is_initialized():
        raise RuntimeError("run_rank needs a process without a process group (it starts a fake one)")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        source = meta_model.to(torch.bfloat16) if precision == "bf16-true" else meta_model
        model = to_fake(source, mode, "cpu")
        _bridge_module_to(model)
        if example_input is not None:
            args = _to_fake_input(example_input, mode, "cpu", precision)
            args, kwargs = (args if isinstance(args, tuple) else (args,)), {}
        else:
            args, kwargs = _default_batch(model, micro_batch, seq_len, mode)
        with warnings.catch_warnings():
            for message in _FALSE_ALARMS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            result = measure_step(
                model,
                spec,
                rank,
                args,
                kwargs,
                zero_stage=zero_stage,
                activation_checkpointing=activation_checkpointing,
                precision=precision,
                optimizer=optimizer,
                microbatches=microbatches,
                schedule=schedule,
                mode=mode,
                boundary=boundary,
            )
        result.seconds = time.perf_counter() - start
        return result
    finally:
        runtime.shutdown()  # forgets the torch meshes and the adopted group (not owned: not destroyed)
        if dist.is_initialized():
            dist.destroy_process_group()
        # DTensor caches sharding decisions keyed by mesh *shape*: the next rank's mesh compares equal
        # to this one but has new process groups, so a cached spec would name a destroyed group.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


# RankResult, measure_step and _storage_bytes are imported from here by callers and tests.
__all__ = ["RankResult", "measure_step", "run_rank", "_storage_bytes"]
