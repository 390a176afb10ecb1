"""Expert parallelism: the experts' dim 0 over a mesh axis, tokens sent to their experts by all-to-all.

``apply_expert_parallel`` runs after tensor parallelism (which broadcast every parameter from the
first process, so every process slices the same experts) and before activation checkpointing,
compile and FSDP2 (which must see the experts as the ``Shard(0)`` DTensors they now are, and leave
them alone: ``zero.apply_fsdp`` ignores parameters marked ``_trainmesh_expert``).

Each experts module (``expert_layout.ExpertsModule``) keeps its parameter names; its parameters
become DTensors ``Shard(0)`` on the expert axis (this process holds ``num_experts / EP`` experts,
checkpoints and ``get_model_state_dict`` see the whole tensors), and its ``forward`` is replaced, on
the instance only, by the dispatch below (torchtitan's ``expert_parallel.py``, Megatron's all-to-all
token dispatcher):

1. order this process's (token, expert) pairs by expert; count them per expert;
2. exchange the counts with one ``all_to_all_single`` (each process learns how many rows it will
   receive for each of its experts from each process);
3. send the rows with ``all_to_all_single_autograd`` (uneven splits; gloo refuses the list form);
4. run the local experts with the model's own expert computation (transformers' experts interface:
   ``grouped_mm`` by default) on the received rows, each row's weight 1;
5. send the results back with the same autograd all-to-all, restore the pairs' order, apply the
   routing weights and sum over the top-k, as transformers' own ``grouped_mm`` forward does.

Backward runs the two token exchanges in reverse (two more all-to-alls); the count exchange has no
backward. Every process runs the same sequence whatever its tokens (a process that receives no row
still calls its experts on zero rows, which gives zero gradients as one process would), so skewed
routing cannot hang.

Gradients: an expert's gradient arrives summed over the processes whose tokens it computed. Over the
batch axis each of those processes' losses is a mean over its own slice, so dividing by the batch
axis size gives exactly one process's gradient on the global batch. Over another axis (a model axis,
whose processes share a batch slice) every row arrives once per process of the axis: the gradient
is divided by that size and then averaged over the batch axis like every other parameter.
The 1/EP is applied to the gradient of the expert rows (output rows times 1/EP, input rows times EP:
rows x hidden elements a layer) rather than to the experts' own gradients (every local weight, every
step), which is the same number bit for bit when EP is a power of two (``_DispatchState``).
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from trainmesh import runtime
from trainmesh.distribution.expert_layout import ExpertPlan

from .mesh import to_torch_mesh

__all__ = ["apply_expert_parallel", "dispatch_states", "dispatch_stats", "reset_dispatch_stats"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` in backward. Applied where the local experts are
    read (``to_local``), so it holds whatever later wraps or swaps the parameter objects (a hook on the
    parameter did not survive FSDP2's ``model.to``, which swaps DTensor parameters in place)."""

    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _DispatchState:
    """Per experts module: where its experts live, and counters of what the dispatch did."""

    def __init__(self, group, size: int, index: int, num_experts: int, grad_scale: float):
        self.group, self.size, self.index, self.grad_scale = group, size, index, grad_scale
        self.num_experts, self.num_local = num_experts, num_experts // size
        self.local_ids = torch.arange(self.num_local).repeat(size)
        # Scaling the experts' gradients by ``grad_scale`` (1/EP) where they are made costs a pass over every
        # local expert's weights per backward (75% of a Qwen3-MoE's parameters). Scaling the gradient of
        # the expert outputs' rows by it instead, and that of their input rows back by 1/grad_scale, gives
        # the same weight gradients and input gradients in rows x hidden elements; exactly the same when
        # grad_scale is a power of two (the backward is linear in the incoming gradient: each product and
        # sum is the same binary exponent shift). Otherwise the weights' gradients are scaled as made.
        self.rows_grad_scale = grad_scale != 1.0 and math.frexp(grad_scale)[0] == 0.5
        # tokens per expert routed by this process in training forwards (not in no-grad evaluation nor in
        # the forward activation checkpointing recomputes in backward), read and zeroed by the Trainer
        self.train_tokens = torch.zeros(num_experts, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        self.stats = {
            "count_exchanges": 0,
            "token_exchanges_forward": 0,
            "token_exchanges_backward": 0,
            "bytes_to_others": 0,
            "tokens_per_expert": torch.zeros(self.num_experts, dtype=torch.int64),
        }


def _count_backward(state: _DispatchState, rows_to_others: int, row_bytes: int):
    def hook(grad):
        state.stats["token_exchanges_backward"] += 1
        state.stats["bytes_to_others"] += rows_to_others * row_bytes
        return grad

    return hook


def _dispatch_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    return _dispatch(self, hidden_states, top_k_index, top_k_weights)


# Under torch.compile the dispatch runs eager: its split sizes are host ints read from the exchanged
# counts (``.tolist()``) and its row counts depend on the routing, which dynamo can only trace with
# process-wide settings (capture_scalar_outputs) and a recompile per new split. Disabled here, dynamo
# breaks the graph once per experts call and compiles the router before it and the combine after it.
# The disabled function is an inner one, so the module's ``forward`` does not look compiled in place.
@torch.compiler.disable
def _dispatch(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    state: _DispatchState = self._trainmesh_ep
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # 1.
    send = hidden_states[order // top_k]
    counts = torch.bincount(flat, minlength=state.num_experts)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=state.group)  # 2. num_experts/EP per process
    # one host read of both splits (the layer's one sync), as transformers' AllToAllEP does
    send_splits, recv_splits = torch.stack(
        [counts.view(state.size, state.num_local).sum(1), received_counts.view(state.size, state.num_local).sum(1)]
    ).tolist()
    received = all_to_all_single_autograd(send, recv_splits, send_splits, state.group)  # 3.
    # Rows arrive grouped by source process, then by local expert: their local expert ids.
    local_ids = state.local_ids.to(counts.device).repeat_interleave(received_counts, output_size=received.shape[0])
    rows_scale = state.rows_grad_scale and torch.is_grad_enabled()
    if rows_scale:  # the experts' gradients scaled through their rows (see _DispatchState.rows_grad_scale)
        received = _ScaleGrad.apply(received, 1.0 / state.grad_scale)
    ones = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=received.device)
    out = _run_local_experts(self, state, received, local_ids[:, None], ones, scale_params=not rows_scale)  # 4.
    if rows_scale:
        out = _ScaleGrad.apply(out, state.grad_scale)
    back = all_to_all_single_autograd(out, send_splits, recv_splits, state.group)  # 5.
    # Back to the pairs' order by a scatter (its backward a gather) rather than a gather through the
    # inverse permutation, whose backward is an accumulating index_put
    pairs = torch.empty_like(back).index_copy(0, order, back).view(num_tokens, top_k, hidden)
    result = (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
    _record(state, counts, send, out, send_splits, recv_splits, hidden_states.element_size() * hidden)
    return result.to(hidden_states.dtype)


def _run_local_experts(self: nn.Module, state: _DispatchState, rows, ids, weights, *, scale_params: bool):
    """The model's own expert computation (``type(self).forward``: transformers' experts interface,
    ``grouped_mm`` by default) on this process's experts only: the DTensor parameters swapped for their
    local shards for the call (what transformers' ``_use_local_dtensor_params`` does; cheaper than
    ``torch.func.functional_call``), ``num_experts`` the local count."""
    originals = {name: p for name, p in self._parameters.items() if isinstance(p, DTensor)}
    scale = state.grad_scale if scale_params else 1.0
    saved_num = self.__dict__.get("num_experts")
    self._parameters.update({name: _local_experts(p, scale) for name, p in originals.items()})
    if saved_num is not None:
        self.num_experts = state.num_local
    try:
        return type(self).forward(self, rows, ids, weights)
    finally:
        self._parameters.update(originals)
        if saved_num is not None:
            self.num_experts = saved_num


def _local_experts(param: DTensor, grad_scale: float) -> torch.Tensor:
    local = param.to_local()
    return _ScaleGrad.apply(local, grad_scale) if grad_scale != 1.0 and local.requires_grad else local


def _record(state: _DispatchState, counts, send, out, send_splits, recv_splits, row_bytes: int) -> None:
    sent_away = sum(send_splits) - send_splits[state.index]
    returned_away = sum(recv_splits) - recv_splits[state.index]
    stats = state.stats
    stats["count_exchanges"] += 1
    stats["token_exchanges_forward"] += 2
    stats["bytes_to_others"] += (sent_away + returned_away) * row_bytes
    stats["tokens_per_expert"] += counts.detach().cpu()
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # -1: not inside a backward
        state.train_tokens += counts.detach().cpu()
    if torch.is_grad_enabled():
        # Backward of the combine sends the gradient of ``back`` (the rows returned) to the owners;
        # backward of the dispatch sends the gradient of ``received`` back to the senders.
        if out.requires_grad:
            out.register_hook(_count_backward(state, sent_away, row_bytes))
        if send.requires_grad:
            send.register_hook(_count_backward(state, returned_away, row_bytes))


_split_meshes: dict = {}


def _expert_group(distribution, plan: ExpertPlan):
    """The experts' own 1-D mesh, its group and this process's index on it, and the mesh of the processes
    that hold the same experts (None when EP is the whole axis). EP smaller than the axis splits the axis
    into (replicas, EP), EP the inner (neighbouring ranks), as torchtitan borrows EP from the data axis."""
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    axis_mesh = torch_mesh[plan.axis] if torch_mesh.ndim > 1 else torch_mesh
    if plan.replicas == 1:
        return axis_mesh, axis_mesh.get_group(), axis_mesh.get_local_rank(), None
    key = (id(torch_mesh), plan.axis, plan.size)
    if key not in _split_meshes:  # _unflatten makes new process groups: once per mesh and split
        names = (f"{plan.axis}_expert_replica", f"{plan.axis}_expert")
        _split_meshes[key] = torch_mesh._unflatten(plan.axis, (plan.replicas, plan.size), names)
    split = _split_meshes[key]
    ep_mesh, replica_mesh = split[f"{plan.axis}_expert"], split[f"{plan.axis}_expert_replica"]
    return ep_mesh, ep_mesh.get_group(), ep_mesh.get_local_rank(), replica_mesh


def _forget_split_meshes() -> None:
    _split_meshes.clear()


def _shard_experts(module: nn.Module, experts, plan: ExpertPlan, ep_mesh, index: int) -> None:
    num_local = experts.num_experts // plan.size
    for name in experts.param_names:
        full = getattr(module, name)
        local = full.detach()[index * num_local : (index + 1) * num_local].clone()
        param = nn.Parameter(
            DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False), requires_grad=full.requires_grad
        )
        param._trainmesh_expert = True  # zero.apply_fsdp leaves it to us
        module._parameters[name] = param


def lay_out_meta_experts(model: nn.Module, distribution, plan: ExpertPlan) -> None:
    """A meta-built model's experts as ``Shard(0)`` meta DTensors, before TP fills the model at stage 0
    (``materialize`` then allocates and reads only this process's experts: with ``weights=``, only their
    tensors in the files); ``apply_expert_parallel`` does the rest after TP."""
    ep_mesh, _, index, _ = _expert_group(distribution, plan)
    for experts in plan.modules:
        module = model.get_submodule(experts.path)
        if not isinstance(getattr(module, experts.param_names[0]), DTensor):
            _shard_experts(module, experts, plan, ep_mesh, index)
            module._trainmesh_ep_meta = True


def apply_expert_parallel(
    model: nn.Module, distribution, plan: ExpertPlan, *, zero_stage: int = 0, reduce_grads: bool = True
) -> nn.Module:
    """Lay ``plan``'s experts out over their axis and dispatch their tokens by all-to-all (see the module
    docstring); returns ``model``, changed in place. ``reduce_grads``: average expert gradients over the
    batch axis when the expert axis is another one (stage 0 without a pipeline, as TP's own hooks do)."""

    batch_axis = distribution.batch_dim_name
    if plan.axis != batch_axis and zero_stage > 0:
        raise ValueError(
            f"Experts laid out over {plan.axis!r} with zero_stage={zero_stage}: under ZeRO the experts go over the "
            f"batch axis {batch_axis!r} (expert_axis={batch_axis!r}), where no other reduction is needed. "
            f"Received: expert axis {plan.axis!r}, zero_stage={zero_stage}"
        )
    ep_mesh, group, index, replica_mesh = _expert_group(distribution, plan)
    dp_size = distribution.data_parallel_size
    # Over the batch axis each process's loss is the mean over its slice; the gradient arriving at an
    # expert is summed over the EP processes that sent rows: 1/EP here, then the average over the
    # replicas (FSDP2's or DataAxisGradReducer's) makes 1/(batch axis size) of the sum over every process.
    # Over a model axis every row arrives once per process of the axis: 1/EP, then averaged over the batch.
    scale = plan.size
    for experts in plan.modules:
        module = model.get_submodule(experts.path)
        if getattr(module, "_trainmesh_ep_meta", False):
            # laid out on the meta device before TP filled the model (lay_out_meta_experts): new Parameter
            # objects, so that TP's batch-axis hooks stay on the old ones, as they do on a real model's
            for name in experts.param_names:
                old = getattr(module, name)
                module._parameters[name] = nn.Parameter(old.detach(), requires_grad=old.requires_grad)
                module._parameters[name]._trainmesh_expert = True
            del module._trainmesh_ep_meta
        elif isinstance(getattr(module, experts.param_names[0]), DTensor):
            raise ValueError(f"Experts module {experts.path!r} is already laid out; distribute_model applies once.")
        else:
            _shard_experts(module, experts, plan, ep_mesh, index)  # a meta model's too: materialize fills its shard
        module._trainmesh_ep = _DispatchState(group, plan.size, index, experts.num_experts, 1.0 / scale)
        module.forward = types.MethodType(_dispatch_forward, module)
    from .data_axis_grads import DataAxisGradReducer

    if plan.axis != batch_axis and reduce_grads and dp_size > 1:
        torch_mesh = to_torch_mesh(distribution.device_mesh)
        batch_group = torch_mesh.get_group(batch_axis)
        model._trainmesh_expert_grad_reducers = [
            DataAxisGradReducer(model.get_submodule(m.path), batch_group, dp_size) for m in plan.modules
        ]
    if replica_mesh is not None:
        if reduce_grads:  # stage 0: averaged over the processes holding the same experts
            model._trainmesh_expert_grad_reducers = [
                DataAxisGradReducer(model.get_submodule(m.path), replica_mesh.get_group(), plan.replicas)
                for m in plan.modules
            ]
        model._trainmesh_expert_replica_mesh = replica_mesh  # ZeRO: zero.apply_fsdp shards the experts over it
    model._trainmesh_expert_plan = plan
    return model


runtime.process_group.on_shutdown(_forget_split_meshes)


def dispatch_states(model: nn.Module) -> list[tuple[str, _DispatchState]]:
    """``(path, state)`` of every experts module of ``model`` that dispatches by all-to-all, in module order."""
    return _states(model)


def _states(model: nn.Module) -> list[tuple[str, _DispatchState]]:
    return [(path, m._trainmesh_ep) for path, m in model.named_modules() if hasattr(m, "_trainmesh_ep")]


def dispatch_stats(model: nn.Module) -> dict[str, dict]:
    """Per experts module: count and token exchanges (forward and backward), bytes sent to other
    processes, and this process's tokens per expert, since the last ``reset_dispatch_stats``."""
    return {path: dict(state.stats) for path, state in _states(model)}


def reset_dispatch_stats(model: nn.Module) -> None:
    for _, state in _states(model):
        state.reset()
