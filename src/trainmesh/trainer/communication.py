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
  DataParallel over every process) and hosts holding equal numbers of processes (any rank
  order: the hosts are discovered, ``trainmesh.comm.topology``).
* ``communication="auto"`` probes once at start (``trainmesh.comm.probe``) and picks hierarchy,
  bucket merging and int8 compression; an explicit ``compression`` or ``hierarchical_allreduce``
  setting wins over its choice.
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
    "compression={spec!r} (PowerSGD) works with zero_stage 0, where DDP reduces whole gradients. "
    "ZeRO stage {stage} reduce-scatters FSDP2's flat rows of padded parameter slices (every stage from "
    "zero_stage=1 on shards gradients that way), and PowerSGD needs each parameter's matrix. Use "
    "zero_stage=0 with PowerSGD, or an elementwise compressor (fp16, bf16, int8, topk) at stage {stage}."
)


def _local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return runtime.cluster_env().local_world_size or runtime.world_size()


def host_groups_for(setting: bool | None, whole_world: bool, stage: int, model: torch.nn.Module):
    """``(topology, (intra, inter) or None)`` for ``hierarchical_allreduce=setting`` (collective).

    The hosts come from the processes themselves (``trainmesh.comm.topology``): ``None`` (auto)
    turns hierarchy on when the job spans several hosts of equal size; ``True`` requires it.
    """
    world = runtime.world_size()
    if setting is True and not whole_world:
        raise ValueError(
            "hierarchical_allreduce=True needs DDP over every process (a 1-D DataParallel, "
            f"zero_stage 0). Received: model {type(model).__name__}, zero_stage={stage}"
        )
    if world == 1 or not whole_world or setting is False:
        return None, None
    from trainmesh.comm.topology import discover, host_groups

    topology = discover()
    groups = host_groups(topology)
    if groups is None and setting is True:
        raise ValueError(
            "hierarchical_allreduce=True needs processes on several hosts holding equal numbers of processes; "
            f"this job has {topology.describe()} (hosts told apart by host name and interface address, or "
            f"TRAINMESH_HOST_ID). Received: WORLD_SIZE={world}, LOCAL_WORLD_SIZE={_local_world_size()}"
        )
    return topology, groups


def _two_phase_key(key: str) -> bool:
    """A residual of the two-phase exchange (``"<bucket>|row j/N"``, ``"<bucket>|sum/N"``)."""
    return "|row " in key or "|sum/" in key


class GradientCommunication:
    """What the Trainer installed: the compressor (checkpointed per rank) and the byte counter."""

    def __init__(
        self,
        compressor: Compressor | None,
        counter: ByteCounter,
        *,
        hierarchical: bool,
        zero_stage: int = 0,
        plan=None,
        topology=None,
    ) -> None:
        self.compressor = compressor
        self.counter = counter
        self.hierarchical = hierarchical
        self.zero_stage = zero_stage
        self.plan = plan  # communication="auto": what was chosen and why (trainmesh.comm.probe.CommPlan)
        self.topology = topology

    def describe(self) -> str:
        parts = [f"compression {self.compressor!r}" if self.compressor else "no compression"]
        if self.hierarchical:
            parts.append(f"hierarchical all-reduce (in host, across hosts, in host; {self.topology.describe()})")
        if self.plan is not None:
            parts.append(self.plan.describe())
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
        return {
            "compressor": self.compressor.name,
            "world_size": runtime.world_size(),
            "state": self.compressor.state_dict(),
        }

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
            warnings.warn(
                f"The checkpoint's compressor state is for {states[0].get('compressor')!r}, this run "
                f"compresses with {self.compressor.name!r}: its residuals start from zero.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        world, saved_world = runtime.world_size(), int(states[0]["world_size"])
        if len(states) == 1 and saved_world == world:
            self.compressor.load_state_dict(states[0]["state"])
            return
        if len(states) != saved_world:
            raise ValueError(
                f"Resizing compressor state needs all {saved_world} saved ranks' states. Received: {len(states)}"
            )
        resized = type(self.compressor).resize_residuals([s["state"] for s in states], world)
        mine = resized[runtime.rank()]
        from trainmesh.comm.reduce_scatter import KEY_MARK

        # ZeRO-2/3 rows, and the two-phase exchange's rows/sums, are laid out for the old world size.
        stale = [k for k in mine.get("residuals", {}) if KEY_MARK in k or _two_phase_key(k)]
        if stale:  # ZeRO-2/3 rows of the old world size: nothing in this run uses those keys
            warnings.warn(
                f"{len(stale)} error-feedback residuals of ZeRO stage 2-3 units or two-phase rows were saved for "
                f"{saved_world} processes; their padded row layout does not exist on {world}, so they "
                "restart from zero.",
                RuntimeWarning,
                stacklevel=2,
            )
            for field in ("residuals", "momentum"):
                mine[field] = {
                    k: v for k, v in mine.get(field, {}).items() if KEY_MARK not in k and not _two_phase_key(k)
                }
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


COMMUNICATION_MODES = (None, "auto")


def install_communication(model: torch.nn.Module, config) -> GradientCommunication:
    """Register the gradient communication ``config`` asks for on ``model`` (before any backward)."""
    mode = getattr(config, "communication", None)
    if mode not in COMMUNICATION_MODES:
        raise ValueError(f"communication must be one of {COMMUNICATION_MODES}. Received: communication={mode!r}")
    compressor = get_compressor(config.compression)
    memory = getattr(model, "_trainmesh_memory", None) or {}
    stage = memory.get("zero_stage", 0)
    if compressor is not None and stage >= 1 and compressor.name == "powersgd":
        raise ValueError(_UNSUPPORTED_STAGE.format(spec=config.compression, stage=stage))
    is_ddp = isinstance(model, DistributedDataParallel)
    counter = ByteCounter()
    whole_world = is_ddp and dist.get_world_size(model.process_group) == runtime.world_size()
    # FSDP2 (stages 1-3) has no DDP to hook: no hierarchy there.
    topology, groups = host_groups_for(config.hierarchical_allreduce, whole_world, stage, model)
    plan, bucket_bytes = None, 0
    if mode == "auto" and whole_world and runtime.world_size() > 1:
        from trainmesh.comm import probe

        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        plan = probe.choose(topology, groups, gradient_bytes)
        if runtime.rank() == 0:
            print(f"[trainmesh] {plan.describe()}", flush=True)
        if config.compression is None and plan.compression is not None:
            compressor = get_compressor(plan.compression)  # an explicit compression setting wins
        if config.hierarchical_allreduce is None and not plan.hierarchical:
            groups = None
        bucket_bytes = plan.bucket_bytes
    if compressor is not None and stage >= 1:
        from trainmesh.comm.reduce_scatter import install_compressed_reduce_scatter

        # A ModelParallel model's parameters live on a 2-D mesh (batch x model): its own reduction rules.
        two_d = any(getattr(getattr(p, "device_mesh", None), "ndim", 1) > 1 for p in model.parameters())
        if two_d or not install_compressed_reduce_scatter(model, compressor, counter):
            raise ValueError(
                f"compression={config.compression!r} at ZeRO stage {stage} needs a DataParallel "
                f"(1-D) FSDP2 model; tensor parallelism reduces its own gradients. "
                f"Received: {type(model).__name__}"
            )
        return GradientCommunication(compressor, counter, hierarchical=False, zero_stage=stage)
    if compressor is not None and not is_ddp:
        if runtime.world_size() > 1:
            raise ValueError(
                f"compression={config.compression!r} compresses the gradients DDP reduces; this "
                f"model ({type(model).__name__}) is not reduced by DDP (tensor parallelism reduces "
                "its own gradients). Use DataParallel (any zero_stage)."
            )
        compressor = None  # one process: nothing travels
    if getattr(compressor, "rounding", None) == "stochastic" and hasattr(compressor, "generator"):
        compressor.generator.manual_seed(compressor.seed + 7919 * runtime.rank())  # independent noise per rank
    all_reduce = None
    overlap = not getattr(model, "find_unused_parameters", False)
    if groups is not None:
        from trainmesh.comm.hierarchical import hierarchical_all_reduce_

        intra, inter = groups

        def all_reduce(tensor: torch.Tensor) -> None:
            hierarchical_all_reduce_(tensor, intra_group=intra, inter_group=inter)

    if compressor is None and (groups is not None or bucket_bytes):
        from trainmesh.comm.ddp_hooks import DenseHookState, dense_allreduce_hook

        reduce = all_reduce or (lambda tensor: dist.all_reduce(tensor, group=model.process_group))
        model.register_comm_hook(
            DenseHookState(runtime.world_size(), reduce, overlap=overlap, bucket_bytes=bucket_bytes),
            dense_allreduce_hook,
        )
    if compressor is not None:
        from trainmesh.comm.ddp_hooks import CompressionHookState, compressed_allreduce_hook

        intra, inter = groups if groups is not None else (None, None)
        state = CompressionHookState.for_model(
            model,
            compressor,
            counter=counter,
            all_reduce=all_reduce,
            intra_group=intra,
            inter_group=inter,
            bucket_bytes=bucket_bytes,
        )
        model.register_comm_hook(state, compressed_allreduce_hook)
    return GradientCommunication(
        compressor, counter, hierarchical=groups is not None, zero_stage=stage, plan=plan, topology=topology
    )
