"""How the Trainer's gradients travel: compression and hierarchical all-reduce, installed once.

``install_communication`` registers a DDP communication hook (stage 0 and ZeRO-1, whose
gradients DDP reduces; ``trainmesh.comm.ddp_hooks``) or gives every FSDP2 unit a compressed
reduce-scatter (ZeRO stages 2-3; ``trainmesh.comm.reduce_scatter``), and returns a
:class:`GradientCommunication`: the compressor (its error-feedback residuals go into
checkpoints, per rank) and the byte counter behind the ``comm_bytes`` /
``comm_bytes_uncompressed`` / ``comm_ratio`` step records.

What is not supported, and why:

* ZeRO stages 2-3 + PowerSGD: FSDP2 reduce-scatters flat rows of padded parameter slices;
  PowerSGD factors each parameter's matrix, which those rows no longer hold. A clear error.
* ZeRO stages 2-3 + a resume on a different number of processes: the residuals belong to
  rows of the old world size's padded layout; they restart from zero, with a warning (at
  stages 0-1 they are kept per parameter and redistributed).
* ModelParallel (tensor parallelism) + compression: its gradients are reduced by its own
  hooks over the batch axis, not by DDP.
* hierarchical all-reduce needs the data-parallel group to be the whole job (a 1-D
  DataParallel over every process) and a job of equal-sized nodes, ranks node-major.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainmesh import runtime
from trainmesh.comm.accounting import ByteCounter, describe_step, StepBytes
from trainmesh.compression import Compressor, get_compressor

_UNSUPPORTED_STAGE = (
    "compression={spec!r} (PowerSGD) works with zero_stage 0 and 1, where DDP reduces whole "
    "gradients. ZeRO stage {stage} reduce-scatters FSDP2's flat rows of padded parameter slices, "
    "and PowerSGD needs each parameter's matrix. Use zero_stage=1 (sharded optimizer state) with "
    "PowerSGD, or an elementwise compressor (fp16, bf16, int8, topk) at stage {stage}."
)


def _local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return runtime.cluster_env().local_world_size or runtime.world_size()


def hierarchical_layout(setting: bool | None) -> tuple[int, int] | None:
    """``(nnodes, nproc_per_node)`` when hierarchical all-reduce is to be used, else None.

    ``None`` (auto): on when the job spans more than one node (LOCAL_WORLD_SIZE < WORLD_SIZE,
    as with ``torchrun --nnodes 2``); ``True`` requires a layout of equal-sized nodes.
    """
    world = runtime.world_size()
    local = _local_world_size()
    multi_node = 1 <= local < world and world % local == 0
    if setting is False or (setting is None and not multi_node):
        return None
    if setting is True and not multi_node:
        raise ValueError(
            "hierarchical_allreduce=True needs a job of several equal-sized nodes (LOCAL_WORLD_SIZE < "
            f"WORLD_SIZE, WORLD_SIZE a multiple of it). Received: WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}")
    return world // local, local


class GradientCommunication:
    """What the Trainer installed: the compressor (checkpointed per rank) and the byte counter."""

    def __init__(self, compressor: Compressor | None, counter: ByteCounter, *, hierarchical: bool,
                 zero_stage: int = 0) -> None:
        self.compressor = compressor
        self.counter = counter
        self.hierarchical = hierarchical
        self.zero_stage = zero_stage

    def describe(self) -> str:
        parts = [f"compression {self.compressor!r}" if self.compressor else "no compression"]
        if self.hierarchical:
            parts.append("hierarchical all-reduce (in node, across nodes, in node)")
        return "; ".join(parts)

    def step_record(self) -> dict[str, Any]:
        """The bytes this rank sent since the last call (one optimizer step); {} without compression."""
        if self.compressor is None:
            return {}
        return self.counter.take().as_record()

    @staticmethod
    def progress_text(record: dict[str, Any]) -> str | None:
        if "comm_bytes" not in record:
            return None
        return describe_step(StepBytes(int(record["comm_bytes"]), int(record["comm_bytes_uncompressed"])))

    # --- checkpoint state: this rank's compressor state ----------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.compressor is None:
            return {}
        return {"compressor": self.compressor.name, "world_size": runtime.world_size(),
                "state": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_resharded_state([state])  # one saved rank's state, for the same rank now

    def load_resharded_state(self, states: list[dict[str, Any]]) -> None:
        """Restore from every saved rank's state (CheckpointManager on a different world size),
        or from this rank's own (a list of one): residuals are redistributed with the
        compressor's ``resize_residuals`` when the world size changed."""
        states = [s for s in states if s]
        if self.compressor is None or not states:
            return
        if any(s.get("compressor") != self.compressor.name for s in states):
            warnings.warn(f"The checkpoint's compressor state is for {states[0].get('compressor')!r}, this run "
                          f"compresses with {self.compressor.name!r}: its residuals start from zero.",
                          RuntimeWarning, stacklevel=2)
            return
        world, saved_world = runtime.world_size(), int(states[0]["world_size"])
        if len(states) == 1 and saved_world == world:
            self.compressor.load_state_dict(states[0]["state"])
            return
        if len(states) != saved_world:
            raise ValueError(f"Resizing compressor state needs all {saved_world} saved ranks' states. "
                             f"Received: {len(states)}")
        resized = type(self.compressor).resize_residuals([s["state"] for s in states], world)
        mine = resized[runtime.rank()]
        from trainmesh.comm.reduce_scatter import KEY_MARK

        stale = [k for k in mine.get("residuals", {}) if KEY_MARK in k]
        if stale:  # ZeRO-2/3 rows of the old world size: nothing in this run uses those keys
            warnings.warn(f"{len(stale)} error-feedback residuals of ZeRO stage 2-3 units were saved for "
                          f"{saved_world} processes; their padded row layout does not exist on {world}, so they "
                          "restart from zero.", RuntimeWarning, stacklevel=2)
            for field in ("residuals", "momentum"):
                mine[field] = {k: v for k, v in mine.get(field, {}).items() if KEY_MARK not in k}
        if self.compressor.summable:
            # Summable compressors see gradient / N (see ddp_hooks): rescale to the new N.
            mine["residuals"] = {k: v * (saved_world / world) for k, v in mine.get("residuals", {}).items()}
        self.compressor.load_state_dict(mine)

    def gathered_state(self) -> dict[str, Any] | None:
        """Every rank's state on the main process (collective), for single-file checkpoints."""
        if self.compressor is None:
            return None
        mine = self.state_dict()
        if runtime.world_size() == 1:
            return {"ranks": [mine]}
        everyone = [None] * runtime.world_size() if runtime.rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        return {"ranks": everyone} if runtime.rank() == 0 else None

    def load_gathered_state(self, saved: dict[str, Any] | None) -> None:
        if self.compressor is None or not saved:
            return
        ranks = saved["ranks"]
        if len(ranks) == runtime.world_size():
            self.load_state_dict(ranks[runtime.rank()])
        else:
            self.load_resharded_state(ranks)


def install_communication(model: torch.nn.Module, config) -> GradientCommunication:
    """Register the gradient communication ``config`` asks for on ``model`` (before any backward)."""
    compressor = get_compressor(config.compression)
    memory = getattr(model, "_trainmesh_memory", None) or {}
    stage = memory.get("zero_stage", 0)
    if compressor is not None and stage >= 2 and compressor.name == "powersgd":
        raise ValueError(_UNSUPPORTED_STAGE.format(spec=config.compression, stage=stage))
    is_ddp = isinstance(model, DistributedDataParallel)
    counter = ByteCounter()
    whole_world = is_ddp and dist.get_world_size(model.process_group) == runtime.world_size()
    layout = hierarchical_layout(config.hierarchical_allreduce)  # FSDP2 (stages 2-3) has no DDP to hook
    if layout and not whole_world:
        if config.hierarchical_allreduce:
            raise ValueError("hierarchical_allreduce=True needs DDP over every process (a 1-D DataParallel, "
                             f"zero_stage 0 or 1). Received: model {type(model).__name__}, zero_stage={stage}")
        layout = None
    if compressor is not None and stage >= 2:
        from trainmesh.comm.reduce_scatter import install_compressed_reduce_scatter

        # A ModelParallel model's parameters live on a 2-D mesh (batch x model): its own reduction rules.
        two_d = any(getattr(getattr(p, "device_mesh", None), "ndim", 1) > 1 for p in model.parameters())
        if two_d or not install_compressed_reduce_scatter(model, compressor, counter):
            raise ValueError(f"compression={config.compression!r} at ZeRO stage {stage} needs a DataParallel "
                             f"(1-D) FSDP2 model; tensor parallelism reduces its own gradients. "
                             f"Received: {type(model).__name__}")
        return GradientCommunication(compressor, counter, hierarchical=False, zero_stage=stage)
    if compressor is not None and not is_ddp:
        if runtime.world_size() > 1:
            raise ValueError(f"compression={config.compression!r} compresses the gradients DDP reduces; this "
                             f"model ({type(model).__name__}) is not reduced by DDP (tensor parallelism reduces "
                             "its own gradients). Use DataParallel with zero_stage 0 or 1.")
        compressor = None  # one process: nothing travels
    if getattr(compressor, "rounding", None) == "stochastic" and hasattr(compressor, "generator"):
        compressor.generator.manual_seed(compressor.seed + 7919 * runtime.rank())  # independent noise per rank
    all_reduce = None
    if layout is not None:
        from trainmesh.comm.hierarchical import HierarchicalState, hierarchical_all_reduce_, hierarchical_hook

        groups = HierarchicalState.from_layout(*layout)
        if compressor is None:
            model.register_comm_hook(groups, hierarchical_hook)

        def all_reduce(tensor: torch.Tensor) -> None:
            hierarchical_all_reduce_(tensor, intra_group=groups.intra_group, inter_group=groups.inter_group)
    if compressor is not None:
        from trainmesh.comm.ddp_hooks import CompressionHookState, compressed_allreduce_hook

        state = CompressionHookState.for_model(model, compressor, counter=counter, all_reduce=all_reduce)
        model.register_comm_hook(state, compressed_allreduce_hook)
    return GradientCommunication(compressor, counter, hierarchical=layout is not None, zero_stage=stage)
