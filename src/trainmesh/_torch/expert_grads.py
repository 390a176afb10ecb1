"""Expert gradients beside a sequence axis: averaged over every process that holds the same experts.

With a sequence axis (``sequence_dim_name=``) the processes of that axis share their samples but hold
different tokens of them. When the experts are laid out over another axis (the batch axis, usually),
the sequence axis's processes hold the same experts and route different tokens to them. The dispatch
(``expert_parallel``) gives an expert the gradient summed over its EP group's processes times 1/EP; the
rows the other holders routed reach their own copy of the expert. Left there, each copy trained on its
own tokens only: at data 2 x seq 2 the experts were 5.3e-3 from one process after 3 AdamW steps.

The *holders* of an expert are the processes of the batch and sequence axes (those that route
different tokens) that hold the same experts:

* experts over the batch axis, EP the whole axis: the sequence axis;
* experts over the batch axis, ``expert_parallel_size`` below it: the batch axis's replicas x the
  sequence axis;
* experts over the sequence axis itself (the tokens of one sequence travel along it to their expert's
  owner): the batch axis;
* experts over another axis (a model axis, whose processes route the same tokens): batch x sequence.

Each process's loss is weighted so that its mean over batch x sequence is the global token mean
(``context_parallel.token_weighted_loss``), so the dispatch's 1/EP and the average over the
``batch x sequence / EP`` holders make the sum of every process's contribution over batch x
sequence: one process's gradient on the global batch.

ZeRO 0: one ``DataAxisGradReducer`` per experts module over the holders, overlapped with backward.
ZeRO 2-3: the holders' mesh is the experts' own FSDP2 mesh (``zero.apply_fsdp`` shards each experts
module over ``_trainmesh_expert_replica_mesh``; its reduce-scatter averages there).
"""

from __future__ import annotations

from torch import nn

from trainmesh.distribution.expert_layout import ExpertPlan

from .mesh import to_torch_mesh

__all__ = ["apply_expert_grads_beside_sequence", "holders_mesh"]


def holders_mesh(distribution, plan: ExpertPlan):
    """The 1-D torch mesh of the processes that hold the same experts as this one and route other tokens
    (see the module docstring), or None when there are none."""
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    names = list(torch_mesh.mesh_dim_names or ())
    token_axes = [a for a in names if a in (distribution.batch_dim_name, distribution.sequence.axis)]
    if plan.axis in token_axes and plan.replicas > 1:
        # EP below the batch axis: the axis split into (replicas, EP) as the dispatch split it, so the
        # holders' mesh and the experts' DTensor mesh share one root (FSDP2 composes them at ZeRO 2-3)
        from .expert_parallel import _expert_group, _split_meshes

        _expert_group(distribution, plan)
        split = _split_meshes[(id(torch_mesh), plan.axis, plan.size)]
        others = [f"{plan.axis}_expert_replica" if a == plan.axis else a for a in token_axes]
        return split[tuple(others)]._flatten("_".join(others)) if len(others) > 1 else split[others[0]]
    others = [a for a in token_axes if a != plan.axis]
    if not others:
        return None
    if len(others) == 1:
        return torch_mesh[others[0]] if torch_mesh.ndim > 1 else torch_mesh
    return torch_mesh[tuple(others)]._flatten("_".join(others))


def apply_expert_grads_beside_sequence(model: nn.Module, distribution, plan: ExpertPlan, *, reduce_grads: bool) -> None:
    """After ``apply_expert_parallel`` (called with ``reduce_grads=False``) on a model beside a sequence
    axis: the experts' gradients averaged over their holders. ``reduce_grads``: ZeRO 0, no pipeline
    (hooks here); otherwise the holders' mesh is left for FSDP2."""
    from .data_axis_grads import DataAxisGradReducer

    mesh = holders_mesh(distribution, plan)
    model._trainmesh_expert_replica_mesh = mesh
    if reduce_grads and mesh is not None and mesh.size() > 1:
        group, size = mesh.get_group(), mesh.size()
        model._trainmesh_expert_grad_reducers = [
            DataAxisGradReducer(model.get_submodule(m.path), group, size) for m in plan.modules
        ]
