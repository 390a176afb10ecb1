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
* the head's column-wise projection takes the sequence-sharded input and all-gathers it.

torch's own styles do the communication (``ColwiseParallel(input_layouts=Shard(1))``,
``RowwiseParallel(output_layouts=Shard(1))``, ``SequenceParallel``); this module only says which layer
gets which. Code between the layers (a transformers decoder layer's residual adds, the rotary
embedding, the mask) sees DTensors with their global shapes, so positions and masks are the
one-process ones.
"""

from __future__ import annotations

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
    elif plan.style == "colwise" and parent not in units and not embedding:
        style.input_layouts = (SEQ,)  # the head (or a lone projection): all-gather the tokens first
    return style


def gather_block_input(parent: nn.Module, device_mesh) -> None:
    """A unit's sequence-sharded input all-gathered once, as one replicated DTensor its column-wise
    projections share (``tp_styles.share_block_input`` under sequence parallelism): its gradient, the
    sum of their partial ones, is reduce-scattered back to the sequence shards in one collective."""

    def gather(tensor):
        if isinstance(tensor, DTensor):
            return tensor.redistribute(device_mesh, [Replicate()])
        return tensor

    def pre_hook(module, args, kwargs):
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
        return args, kwargs

    parent.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def apply_sequence_parallel(model: nn.Module, plans: dict, units: set[str], device_mesh) -> nn.Module:
    """After the tensor-parallel styles: the norms of the residual stream, and a whole embedding's output."""
    inside = tuple(f"{u}." for u in units) + tuple(f"{p}." for p in plans)
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
