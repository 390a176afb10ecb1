"""torch's tensor-parallel styles, fed the layout map's own placements, for Linear, Conv1D and Embedding.

``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear`` and ``nn.Embedding`` and pick
the placements themselves. The two subclasses here keep torch's input and output handling
(its ``_prepare_input_fn`` / ``_prepare_output_fn``: the once-in, once-out communication of a
Megatron block) and change only how parameters are partitioned: with the placements the layout
map asked for, so transformers' ``Conv1D`` (weight stored in x out) works too, and a weight tied
to another module's (GPT-2's ``wte`` / ``lm_head``) becomes one DTensor shared by both.

``DTensorBoundary`` is the fallback for any other sharded module: parameters become DTensors
with the layout's placements, plain tensor inputs enter as replicated DTensors, and DTensor
outputs leave as whole local tensors, so the code around the module never meets a DTensor.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


def _partition_with(placements: dict[str, list], shared: dict[int, nn.Parameter]) -> Callable:
    """A ``partition_fn`` giving each parameter of the module its own placements.

    Every process already holds identical full weights (broadcast from the first process), so
    each just keeps its own shard (``src_data_rank=None``: no scatter). ``shared`` maps the id
    of an original parameter to its DTensor, so tied weights stay one parameter.
    """

    def partition(name: str, module: nn.Module, mesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if name and param_name not in placements:  # a submodule of the styled module: left alone
                continue
            if id(param) in shared:
                module.register_parameter(param_name, shared[id(param)])
                continue
            wanted = placements.get(param_name, [Replicate()] * mesh.ndim)
            dparam = nn.Parameter(
                distribute_tensor(param.detach(), mesh, wanted, src_data_rank=None), requires_grad=param.requires_grad
            )
            shared[id(param)] = dparam
            module.register_parameter(param_name, dparam)

    return partition


class LayoutColwise(ColwiseParallel):
    """``ColwiseParallel`` with the layout map's placements; output gathered when ``gather_output``."""

    def __init__(
        self,
        placements: dict[str, list],
        shared: dict[int, nn.Parameter],
        *,
        gather_output: bool,
        keep_shards: Callable[[], bool] | None = None,
    ):
        super().__init__(output_layouts=Replicate() if gather_output else Shard(-1), use_local_output=True)
        self._partition = _partition_with(placements, shared)
        self._keep_shards = keep_shards  # a head whose loss runs on the shards: output left Shard(-1) then

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        gathered = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        keep = self._keep_shards

        def output_fn(mod, outputs, mesh):
            return outputs if keep is not None and keep() else gathered(mod, outputs, mesh)

        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            output_fn,
        )


class LayoutRowwise(RowwiseParallel):
    """``RowwiseParallel`` with the layout map's placements; the output is all-reduced.

    ``sharded_input``: the input is a paired column-wise layer's local shard (Megatron); else it
    is whole and each process takes its slice (no communication). Embeddings take whole ids.
    """

    def __init__(
        self, placements: dict[str, list], shared: dict[int, nn.Parameter], *, sharded_input: bool, embedding: bool
    ):
        super().__init__(
            input_layouts=Shard(-1) if sharded_input and not embedding else Replicate(),
            output_layouts=Replicate(),
            use_local_output=True,
        )
        self._partition = _partition_with(placements, shared)
        self._embedding = embedding

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # torch's rule: a row-wise matmul needs its input sharded on the last dim, an embedding
        # lookup needs whole ids (each process answers for its rows of the table).
        self.desired_input_layouts = (Replicate(),) if self._embedding else (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class DTensorBoundary(ParallelStyle):
    """Any module with layouts torch's styles do not express: DTensor propagation inside it only."""

    def __init__(self, placements: dict[str, list], shared: dict[int, nn.Parameter]):
        super().__init__()
        self._partition = _partition_with(placements, shared)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition)
        replicate = [Replicate()] * device_mesh.ndim

        def to_dtensor(tensor: torch.Tensor):
            if isinstance(tensor, DTensor) or not tensor.is_floating_point() and tensor.dim() == 0:
                return tensor
            return DTensor.from_local(tensor, device_mesh, replicate, run_check=False)

        def to_local(tensor: torch.Tensor):
            if isinstance(tensor, DTensor):
                return tensor.redistribute(device_mesh, replicate).to_local()
            return tensor

        def pre_hook(mod, args, kwargs):
            return _map_tensors(args, to_dtensor), _map_tensors(kwargs, to_dtensor)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(lambda mod, args, output: _map_tensors(output, to_local))
        return module


def share_block_input(parent: nn.Module, device_mesh) -> None:
    """Hand a unit's input (an attention's or MLP's hidden states) to its column-wise projections
    as one replicated DTensor, as torchtitan's ``PrepareModuleInput`` does: each projection's
    input gradient then arrives as a ``Partial`` on that one DTensor, autograd sums them, and a
    single all-reduce at this boundary replaces one per projection (Megatron's count: one
    all-reduce per unit in backward). Converting is free: every process of the model axis holds
    the whole input already. The input is the first positional tensor, else ``hidden_states=``.
    """
    replicate = [Replicate()] * device_mesh.ndim

    def to_dtensor(tensor):
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor) and tensor.is_floating_point():
            return DTensor.from_local(tensor, device_mesh, replicate, run_check=False)
        return tensor

    def pre_hook(module, args, kwargs):
        if args:
            return (to_dtensor(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": to_dtensor(kwargs["hidden_states"])}
        return args, kwargs

    parent.register_forward_pre_hook(pre_hook, with_kwargs=True)
