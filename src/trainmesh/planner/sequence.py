"""A sequence axis and sequence parallelism in plans (``trainmesh plan --mesh data=2,seq=4 --seq-len N``).

**A sequence axis** (``seq``, ``cp`` or ``context``: context parallelism) splits every sequence over its
processes, and its processes average gradients (and, under ZeRO, shard states) together with the batch
axis: ``gradient_mesh`` in ``_torch/context_parallel.py`` flattens data x seq into one group. For memory,
a process of ``data=D, seq=C`` at sequence S is a process of ``data=D*C`` at sequence ``S / C``:

* parameters, gradients and optimizer state: the same (DDP replicates, FSDP2 shards over data x seq);
* activations: the process holds and saves ``micro_batch x S/C`` tokens. Attention saves the same bytes
  either way: Ulysses turns ``[B, S/C, H, D]`` into ``[B, S, H/C, D]``, and ring attention re-gathers
  K/V in backward rather than keeping them. Measured against real runs: within 10% (tests).

So the dry run (``dry_run.run_rank``, trainmesh's own parallelize on a fake process group) runs that
mesh at ``S / C`` tokens; the plan keeps the user's mesh and sequence, the step estimate keeps the
whole sequence's attention FLOPs (each token still attends over S), and a note gives the K/V traffic a
layer moves per process: Ulysses 4 all-to-alls of Q, K, V and O forward, ring one all-gather of K/V.

**Sequence parallelism** (``sequence_parallel=True``, beside a model axis): the dry run builds
``ModelParallel(..., sequence_parallel=True)``, so the norms and residual stream are measured at 1/TP
of the sequence by the real parallelize, not estimated.

Beside a pipe axis, each stage holds the chunk's activations (the stages pass ``[B, S/C, H]``), so the
dry run is the pipeline at ``S / C`` tokens, as for any other mesh.

Refused before anything is built, as training refuses them: a sequence that does not divide into
``2 x axis`` chunks, sequence parallelism without a model axis.

>>> s = sequence_axis_plan("data=2,seq=4", world_size=8, seq_len=4096)
>>> s.spec.text(), s.local_seq_len
('data=8', 1024)
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmesh.distribution.auto_layout import SEQUENCE_AXIS_NAMES as SEQUENCE_AXES

from .mesh_spec import MeshSpec
from .report import format_bytes


@dataclass(frozen=True)
class _SequenceParallelMesh(MeshSpec):
    """A ``MeshSpec`` whose distribution turns on sequence parallelism beside its model axis."""

    def distribution(self, model, *, zero_stage: int, microbatches: int = 1, schedule: str = "1f1b"):
        from trainmesh.distribution import ModelParallel

        plain = super().distribution(model, zero_stage=zero_stage, microbatches=microbatches, schedule=schedule)
        return ModelParallel(
            layout_map=plain.layout_map,
            batch_dim_name=self.batch_axis,
            zero_stage=zero_stage,
            pipeline=plain.pipeline,
            sequence_parallel=True,
        )


@dataclass(frozen=True)
class SequenceAxisPlan:
    """The user's mesh, the mesh and sequence length the dry run uses, and the sequence axis."""

    user_spec: MeshSpec
    spec: MeshSpec
    axis: str | None
    size: int
    seq_len: int | None
    sequence_parallel: bool

    @property
    def local_seq_len(self) -> int | None:
        return self.seq_len // self.size if self.seq_len else self.seq_len

    def kv_traffic(self, config, micro_batch: int, element_bytes: int, tp: int = 1) -> tuple[str, int]:
        """``(method, bytes one process receives per layer forward)`` for a transformers ``config``
        (``auto``'s choice: Ulysses where the heads divide over the axis), of this process's heads under
        a model axis of ``tp``."""
        heads = config.num_attention_heads // tp
        kv_heads = max((getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp, 1)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        n, local = self.size, micro_batch * self.local_seq_len * head_dim * element_bytes
        if heads % n == 0:
            # Q and O of every head; K and V of kv_heads, repeated to the heads when they do not divide
            kv = kv_heads if kv_heads % n == 0 else heads
            return "ulysses", (2 * heads + 2 * kv) * local * (n - 1) // n
        return "ring", 2 * kv_heads * local * (n - 1)

    def annotate(self, plan, meta_model, micro_batch: int, element_bytes: int) -> None:
        """Put the user's mesh and sequence back on ``plan`` and say what was assumed."""
        plan.mesh, plan.seq_len = self.user_spec, self.seq_len
        if self.sequence_parallel:
            plan.notes.append(
                "sequence parallelism on the model axis: norms and the residual stream measured at 1/"
                f"{self.spec.size(self.spec.model_axis)} of the sequence"
            )
        if self.axis is None:
            return
        note = (
            f"sequence axis {self.axis}={self.size}: each process holds {self.local_seq_len} of {self.seq_len} "
            f"tokens a sequence (dry run as {self.spec.text()} at {self.local_seq_len} tokens; gradients "
            f"and ZeRO shards over the batch and sequence axes together)"
        )
        config = getattr(meta_model, "config", None)
        if config is not None and getattr(config, "num_attention_heads", None):
            layers = getattr(config, "num_hidden_layers", None) or 1
            tp = self.user_spec.size(self.user_spec.model_axis)
            method, per_layer = self.kv_traffic(config, micro_batch, element_bytes, tp)
            note += (
                f"; {method} attention moves {format_bytes(per_layer)} per layer forward per process "
                f"({format_bytes(layers * per_layer)} a forward)"
            )
        plan.notes.append(note)


def sequence_axis_plan(
    mesh: str | None, *, world_size: int, seq_len: int | None, sequence_parallel: bool = False
) -> SequenceAxisPlan | None:
    """What a plan needs for a sequence axis or sequence parallelism; ``None`` when there is neither."""
    user = MeshSpec.parse(mesh, world_size)
    axes = [a for a in user.names if a in SEQUENCE_AXES]
    if len(axes) > 1:
        raise ValueError(f"At most one sequence axis {SEQUENCE_AXES}. Received: mesh={user.text()!r}")
    axis = axes[0] if axes and user.size(axes[0]) > 1 else None
    if axis is None and not sequence_parallel:
        return None
    model_axis = user.model_axis if user.size(user.model_axis) > 1 else None
    if sequence_parallel and model_axis is None:
        raise ValueError(
            "sequence_parallel splits the sequence over the model axis: it needs a model axis of size > 1. "
            f"Received: mesh={user.text()!r}, sequence_parallel=True"
        )
    if axis is None:
        return SequenceAxisPlan(user, _SequenceParallelMesh(user.axes, world_size), None, 1, seq_len, True)
    size = user.size(axis)
    if not seq_len or seq_len % (2 * size):
        raise ValueError(
            f"A sequence axis {axis}={size} splits every sequence into 2 x {size} chunks (head-tail): --seq-len must "
            f"be given and divisible by {2 * size}. Received: seq_len={seq_len}"
        )
    # the sequence axis joins the batch axis: one gradient group over both, as training averages
    batch = next((a for a in user.names if a not in SEQUENCE_AXES and a == user.batch_axis), None)
    merged, placed = [], False
    for name, n in user.axes:
        if name == axis:
            continue
        if name == batch or (batch is None and not placed and name not in (user.model_axis, user.pipe_axis)):
            name, n, placed = name, n * size, True
        merged.append((name, n))
    if not placed:  # after a pipe axis, as the search's meshes are written (pipe=2,data=2)
        names = [name for name, _ in merged]
        merged.insert(names.index(user.pipe_axis) + 1 if user.pipe_axis in names else 0, ("data", size))
    spec = (_SequenceParallelMesh if sequence_parallel else MeshSpec)(tuple(merged), world_size)
    return SequenceAxisPlan(user, spec, axis, size, seq_len, sequence_parallel)
