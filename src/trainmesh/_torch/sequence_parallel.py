"""Sequence parallelism beside tensor parallelism (Megatron's): the residual stream split over the model axis.

Plain tensor parallelism leaves every process of the model axis holding the whole sequence between
the blocks (norms, residual adds, dropout), and all-reduces each block's output. With
``ModelParallel(..., sequence_parallel=True)`` the residual stream is a DTensor sharded over the
sequence (``Shard(1)``) on the model axis instead:

* the embedding's output is cut to this process's tokens (a vocab-parallel embedding reduce-scatters
  its partial sums; a whole one is sliced, no communication);
* the norms run on 1/TP of the tokens: torch's ``SequenceParallel`` style (their weights become
  replicated DTensors, whose partial gradients the model-axis reduction completes);
* each attention / MLP unit all-gathers its input once (its column-wise projections share it) and its
  row-wise output projection reduce-scatters instead of all-reducing: 2 all-gathers and 2
  reduce-scatters per block, the same bytes as the 2 all-reduces they replace;
* the head's column-wise projection takes the sequence-sharded input and all-gathers it;
* what the column-wise projections save of a gathered input for backward is kept as this process's
  sequence shard and gathered again in backward, once per unit (Megatron's): without it they would
  save the whole sequence, and only the norms' share of the activations would be split.

torch's own styles and DTensor's redistribute do the communication (``RowwiseParallel(output_layouts=
Shard(1))``, ``SequenceParallel``); this module says which layer gets which, and keeps the shards. Code between the layers (a transformers decoder layer's residual adds, the rotary
embedding, the mask) sees DTensors with their global shapes, so positions and masks are the
one-process ones.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from .partial_grads import complete_partial_grad

SEQ = Shard(1)


def adjust_style(style, plan, units: set[str], *, embedding: bool):
    """The layouts a planned layer gets under sequence parallelism (``style`` is changed in place)."""
    parent = plan.path.rsplit(".", 1)[0] if "." in plan.path else ""
    if plan.style == "rowwise" and (parent in units or embedding):
        style.output_layouts, style.use_local_output = (SEQ,), False  # reduce-scatter into the residual stream
    return style  # the head (or a lone projection) gets its tokens gathered by gather_block_input


def _plain(tensor):
    """The tensor holding the numbers: a DTensor's local shard, an in-flight collective's result."""
    tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return tensor.elem if type(tensor).__name__ == "AsyncCollectiveTensor" else tensor


class _Kept:
    """What a saved view of the gathered input becomes: its shard (as the outer hooks packed it) and its view."""

    def __init__(self, shard, meta):
        self.shard, self.meta = shard, meta


class _KeepShard:
    """Saved-tensor hooks for one unit's forward: a tensor saved for backward that is a view of the gathered
    input is kept as the sequence shard it came from, and gathered again when backward needs it (Megatron's
    sequence parallelism). The projections then hold 1/TP of their input between forward and backward, for
    one more all-gather per unit in backward.

    Only the innermost saved-tensor hooks see a tensor, so every tensor, the kept shard included, is handed
    on to the hooks that were active outside (activation checkpointing's, a user's offloading or counting
    hooks): they still see everything saved, and checkpointing still drops and recomputes it."""

    def __init__(self, shard: DTensor, gathered: DTensor):
        self.shard, self.gathered = shard, _plain(gathered)
        # the storage's identity, not its data_ptr: fake tensors (the planner's dry run) all have data_ptr 0
        self.storage = self.gathered.untyped_storage()._cdata
        # a view is rebuilt from a fresh gather by its size, stride and offset: only from a dense tensor
        self.dense = self.gathered.is_contiguous() and self.gathered.storage_offset() == 0
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.views, self.whole = 0, None  # q, k and v each save a view: one gather serves them all

    def pack(self, tensor):
        outer_pack = self.outer[0] if self.outer else (lambda t: t)
        local = _plain(tensor)
        if not self.dense or local.untyped_storage()._cdata != self.storage:
            return outer_pack(tensor)
        meta = (local.size(), local.stride(), local.storage_offset())
        if isinstance(tensor, DTensor):
            meta += (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        self.views += 1
        return _Kept(outer_pack(self.shard), meta)

    def unpack(self, packed):
        outer_unpack = self.outer[1] if self.outer else (lambda t: t)
        if not isinstance(packed, _Kept):
            return outer_unpack(packed)
        shard, meta = outer_unpack(packed.shard), packed.meta
        if self.whole is None:
            with torch.no_grad():
                self.whole = _plain(shard.redistribute(shard.device_mesh, [Replicate()])).contiguous()
        local = self.whole.as_strided(*meta[:3])
        self.views -= 1
        if self.views <= 0:  # the last view is handed out: the gathered input is freed with it
            self.whole = None
        if len(meta) == 3:
            return local
        mesh, placements, shape, stride = meta[3:]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def gather_block_input(parent: nn.Module, device_mesh, *, plain_is_shard: bool = False) -> None:
    """A unit's sequence-sharded input all-gathered once, as one replicated DTensor its column-wise
    projections share (``tp_styles.share_block_input`` under sequence parallelism): its gradient, the
    sum of their partial ones, is reduce-scattered back to the sequence shards in one collective. What
    the projections save of it for backward is kept as the shard (``_KeepShard``)."""
    active: list = []

    def gather(tensor):
        if plain_is_shard and isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, device_mesh, [SEQ], run_check=False)
        if not isinstance(tensor, DTensor) or tuple(tensor.placements) != (SEQ,):
            return tensor
        gathered = tensor.redistribute(device_mesh, [Replicate()])
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # a context that forbids them
            return gathered
        keep = _KeepShard(tensor, gathered)
        hooks = torch.autograd.graph.saved_tensors_hooks(keep.pack, keep.unpack)
        hooks.__enter__()  # left in the forward hook below, which runs even if the forward raises
        active.append(hooks)
        return gathered

    def pre_hook(module, args, kwargs):
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
        return args, kwargs

    def post_hook(module, args, kwargs, output):
        if active:
            active.pop().__exit__(None, None, None)

    # first among the pre-hooks: a lone projection's own style then meets the gathered input
    parent.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
    parent.register_forward_hook(post_hook, with_kwargs=True, always_call=True)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def apply_sequence_parallel(model: nn.Module, plans: dict, units: set[str], device_mesh) -> nn.Module:
    """After the tensor-parallel styles: the norms of the residual stream, and a whole embedding's output."""
    inside = tuple(f"{u}." for u in units) + tuple(f"{p}." for p in plans)
    for path, plan in plans.items():  # the head (or a lone projection): gathered once, saved as its shard
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        module = model.get_submodule(path)
        if plan.style == "colwise" and parent not in units and not isinstance(module, nn.Embedding):
            gather_block_input(module, device_mesh, plain_is_shard=True)
    for path, module in model.named_modules():
        if _is_norm(module) and not path.startswith(inside) and path not in plans:
            SequenceParallel(sequence_dim=1)._apply(module, device_mesh)
            for param in module.parameters(recurse=False):
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(complete_partial_grad)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is not None and not any(model.get_submodule(p) is embedding for p in plans):
        # a whole (unsharded) embedding: every process computed every token; keep this one's
        def cut(module, args, output):
            return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, [SEQ]
            )

        embedding.register_forward_hook(cut)
    return model
