"""``apply_context_parallel``: a transformers model's attention over a sequence split across a mesh axis.

In training the batch arrives already split (``distribution/sequence_split.py``: head-tail chunks of
every sequence, labels aligned before the split, a padding mask kept whole); in ``evaluate`` and
``predict`` whole sequences arrive and are split here (``context_parallel_eval.py``). This module
makes the model compute exactly what one process computes on the whole sequence:

* **positions**: a forward pre-hook on the transformers model passes ``position_ids`` of this
  process's chunks (global positions, so rotary embeddings are the one-process ones);
* **attention**: the model's attention implementation is set to ``"trainmesh_context_parallel"``
  (``context_parallel_attention.py``): ring attention or Ulysses on split forwards, ``sdpa`` on whole
  sequences otherwise (generation);
* **masks**: transformers builds none (a 4-D placeholder tells it the mask is prepared); the
  causal mask is the kernels' own, the padding mask comes from the pre-hook;
* **gradients** are averaged over the batch and sequence axes together (``gradient_mesh``), and
  **the loss** is weighted so that it is the global token mean (:func:`token_weighted_loss`).

Refused by name before the first step (``context_parallel_checks.py``): sliding-window attention,
attention sinks, attention dropout, a custom 4-D mask. Padding masks and packed sequences' documents
reach attention as a ``[B, 1, S, S]`` mask built once per forward: Ulysses applies it, and ring
attention, whose kernels take none, all-gathers the K/V for it where more than the causal mask is
needed (``ring_masked.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distribution.sequence_split import SequenceSplit

from .context_parallel_attention import _PREPARED_MASK, ATTENTION_NAME, _Call, _register_attention
from .context_parallel_checks import check_config, resolve_method, transformers_model
from .context_parallel_eval import chunk_of_whole, gather_hook

__all__ = ["ATTENTION_NAME", "apply_context_parallel", "resolve_method", "sequence_context", "token_weighted_loss"]


# --- where gradients are averaged ------------------------------------------------------------
def gradient_mesh(torch_mesh, distribution):
    """The 1-D torch mesh over the batch and sequence axes together: every process of a data replica's
    sequence holds part of its loss, so gradients are averaged over both (torchtitan's ``dp_cp``)."""
    names = list(torch_mesh.mesh_dim_names or ())
    axes = [a for a in names if a in (distribution.batch_dim_name, distribution.sequence.axis)]
    if len(axes) == 1:
        return torch_mesh[axes[0]] if torch_mesh.ndim > 1 else torch_mesh
    return torch_mesh[tuple(axes)]._flatten("_".join(axes))


def gradient_group(torch_mesh, distribution) -> tuple[object, int]:
    """``(process group, size)`` of :func:`gradient_mesh`."""
    mesh = gradient_mesh(torch_mesh, distribution)
    return mesh.get_group(), mesh.size()


# --- the per-process context -----------------------------------------------------------------
@dataclass
class SequenceContext:
    """What every training forward needs: the axis's group, this process's place, the method."""

    split: SequenceSplit
    group: object
    index: int
    method: str
    grad_group: object
    grad_size: int
    split_whole: int = 0  # > 0 inside ``split_sequences``: eval forwards of whole sequences are split
    inner_mask: bool = False  # the prepared-mask placeholder handed to the base model only (_inner_mask)
    keep_chunks: int = 0  # > 0 inside ``loss_on_chunks``: their outputs stay this process's chunk
    _cache: dict = field(default_factory=dict)

    def layout(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(this process's positions, the gathered order, its argsort)`` for a sequence of ``seq_len``."""
        key = (seq_len, str(device))
        if key not in self._cache:
            order = self.split.gathered_order(seq_len)
            self._cache[key] = (
                self.split.chunk_positions(seq_len, self.index).to(device),
                order.to(device),
                torch.argsort(order).to(device),
            )
        return self._cache[key]


# --- the pre-hook ----------------------------------------------------------------------------
def _pre_hook(context: SequenceContext, module, args, kwargs):
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not module.training:  # whole sequences: split inside ``split_sequences`` (evaluate, predict), else not
        if tokens is not None and tokens.dim() < 2:
            # the usual cause: a bare tensor handed to predict/evaluate is an iterable of batches, each row
            # one batch; transformers then fails deep in the rotary embedding (q * cos, heads vs head_dim)
            raise ValueError(
                "The model takes [batch, seq] input_ids; it got one row. predict and evaluate iterate a bare "
                "tensor as batches (each row one batch): pass (inputs,) or a Dataset. Received: input_ids of "
                f"shape {tuple(tokens.shape)}"
            )
        if not context.split_whole or tokens is None:
            return None
        chunked = chunk_of_whole(context, args, kwargs, tokens)
        if chunked is None:
            return None
        try:
            args, kwargs = _prepare(context, module, *chunked, tokens.shape[0], tokens.shape[1], gather=True)
        except ValueError:  # what the split does not take (ring and left padding, ...) runs whole, as before
            return None
        kwargs["use_cache"] = False  # a cache of this process's chunks would be no one's cache
        return args, kwargs
    if tokens is None or tokens.dim() < 2:
        raise ValueError(
            "A model over a sequence axis takes [batch, seq] input_ids (or inputs_embeds). Received: "
            f"{type(tokens).__name__}"
        )
    return _prepare(context, module, args, kwargs, tokens.shape[0], tokens.shape[1] * context.split.axis_size)


def _prepare(context: SequenceContext, module, args, kwargs, batch: int, seq_len: int, *, gather: bool = False):
    """The model's ``(args, kwargs)`` for this process's chunks of sequences of ``seq_len``: their global
    positions, the whole padding mask and packed sequences' documents for attention."""
    device = (args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))).device
    given = kwargs.get("position_ids")
    padding = kwargs.pop("attention_mask", None)
    documents = _documents(module, kwargs, given, padding, seq_len, batch)
    if padding is not None:
        if padding.dim() != 2 or padding.shape[1] != seq_len:
            raise ValueError(
                f"Over a sequence axis the attention mask is a whole [batch, {seq_len}] padding mask "
                f"(custom 4-D masks are not supported). Received: attention_mask of shape "
                f"{tuple(padding.shape)}"
            )
        padding = padding.bool()
        if bool(padding.all()):
            padding = None
    positions, _, _ = context.layout(seq_len, device)
    if given is None:
        kwargs["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
    else:  # packed sequences: the user's positions (restarting), this process's columns of them
        kwargs["position_ids"] = given.expand(batch, -1).index_select(1, positions.to(given.device))
    kwargs["attention_mask"] = None if context.inner_mask else _PREPARED_MASK.to(device)
    kwargs["trainmesh_sequence"] = _Call(context, seq_len, padding, documents, gather=gather)
    return args, kwargs


def _documents(module, kwargs, given, padding, seq_len: int, batch: int) -> torch.Tensor | None:
    """Packed sequences' document index ``[B, S]`` where one process's transformers would mask across
    documents, else None. transformers does so (``masking_utils.find_packed_sequence_indices``) only when
    no attention mask is passed and no cache is in use: ``use_cache`` (the config's by default) off, or
    turned off by gradient checkpointing; with a cache, restarting positions only change the rotary
    embeddings, which the positions handed on reproduce."""
    if given is None:
        return None
    if given.dim() != 2 or given.shape[1] != seq_len or given.shape[0] not in (1, batch):
        raise ValueError(
            f"Over a sequence axis, position_ids are the whole [batch, {seq_len}] positions (kept whole by the "
            f"split). Received: position_ids of shape {tuple(given.shape)}"
        )
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", False)
    checkpointed = any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
    if padding is not None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return None
    if use_cache and not (checkpointed and torch.is_grad_enabled()):
        return None
    from transformers.masking_utils import find_packed_sequence_indices

    return find_packed_sequence_indices(given.expand(batch, -1))


def _inner_mask(module, args, kwargs):
    """The base model's pre-hook on a split forward: the prepared-mask placeholder, which the outer model
    then never sees (see ``apply_context_parallel``)."""
    if kwargs.get("trainmesh_sequence") is None or kwargs.get("attention_mask") is not None:
        return None
    tokens = args[0] if args else kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    kwargs["attention_mask"] = _PREPARED_MASK.to(tokens.device if tokens is not None else "cpu")
    return args, kwargs


# --- applying it -----------------------------------------------------------------------------
def apply_context_parallel(model: nn.Module, distribution) -> nn.Module:
    """Route ``model``'s attention through context parallelism over ``distribution.sequence``; returns it."""
    from .mesh import to_torch_mesh

    split = distribution.sequence
    hf = transformers_model(model)
    if hf is None:
        raise ValueError(
            "A sequence axis splits attention through transformers' attention interface; the model "
            f"holds no transformers model. Received: {type(model).__name__}"
        )
    heads, kv_heads = check_config(hf.config)
    method = resolve_method(split.method, heads, kv_heads, split.axis_size)
    torch_mesh = to_torch_mesh(distribution.device_mesh)
    group = torch_mesh.get_group(split.axis) if torch_mesh.ndim > 1 else torch_mesh.get_group()
    grad_group, grad_size = gradient_group(torch_mesh, distribution)
    context = SequenceContext(split, group, split.index_of(distribution.device_mesh), method, grad_group, grad_size)
    _register_attention()
    hf.config._attn_implementation = ATTENTION_NAME
    hf.register_forward_pre_hook(lambda m, a, k: _pre_hook(context, m, a, k), with_kwargs=True)
    inner = getattr(hf, "base_model", hf)
    if hasattr(hf.config, "output_router_logits") and isinstance(inner, nn.Module) and inner is not hf:
        # A MoE's outer model reads attention_mask itself, for its auxiliary loss (transformers'
        # load_balancing_loss_func, given a [B, S] padding mask or None): the 4-D placeholder broke it, so
        # the outer model gets None and its base model the placeholder (the outer kwargs carry the split down).
        context.inner_mask = True
        inner.register_forward_pre_hook(_inner_mask, with_kwargs=True)
    hf.register_forward_hook(gather_hook, with_kwargs=True)  # split eval forwards' outputs made whole
    model._trainmesh_sequence = context
    return model


def sequence_context(model: nn.Module) -> SequenceContext | None:
    module = getattr(model, "module", model)  # DDP's
    return getattr(module, "_trainmesh_sequence", None)


def _token_count(targets: torch.Tensor) -> torch.Tensor:
    """Targets other than -100 (cross-entropy's ``ignore_index``); every position for float targets."""
    local = (targets != -100).sum() if not targets.is_floating_point() else torch.tensor(targets.shape[:2].numel())
    return local.to(torch.float64).reshape(1)  # on the targets' device: NCCL groups take CUDA tensors


def global_token_count(model: nn.Module, targets) -> float | None:
    """The tokens of ``targets`` summed over the data x seq processes (one 8-byte all-reduce), or None
    without a sequence axis. A pipeline counts a whole schedule step's once, before its microbatches."""
    context = sequence_context(model)
    if context is None or not torch.is_tensor(targets):
        return None
    total = _token_count(targets)
    dist.all_reduce(total, group=context.grad_group)
    return total.item()


def token_weighted_loss(
    model: nn.Module, loss: torch.Tensor, targets, *, total: float | None = None, parts: int = 1, aux: list = ()
) -> torch.Tensor:
    """Over a sequence axis, ``loss`` (this process's mean over its tokens) times
    ``its tokens x processes / all tokens``: gradients averaged over the processes are then those of the
    global token mean, and so is the reported loss, padding or not. Tokens are targets other than -100
    (cross-entropy's ``ignore_index``). One 8-byte all-reduce per micro-batch, unless ``total`` gives the
    tokens of all ``parts`` pieces the caller then averages (a pipeline step's microbatches, whose token
    counts differ with padding: weighting each to its own mean would give the mean of their means).

    ``aux``: global auxiliary losses inside ``loss`` (``moe_balance.recording_aux_terms``), whose gradient
    is one process's share already: their part of ``loss`` keeps the weight 1 (``moe_balance.aux_part``)."""
    context = sequence_context(model)
    if context is None or not torch.is_tensor(targets):
        return loss
    count = _token_count(targets)
    if total is None:
        total = count.clone()
        dist.all_reduce(total, group=context.grad_group)
        total = total.item()
    return weighted_to_token_mean(loss, count.item(), total, processes=context.grad_size, parts=parts, aux=aux)


def weighted_to_token_mean(
    loss: torch.Tensor, count: float, total: float, *, processes: int = 1, parts: int = 1, aux: list = ()
) -> torch.Tensor:
    """``loss`` (a mean over ``count`` tokens) times ``count x processes x parts / total``: averaged over
    the ``processes x parts`` pieces of ``total`` tokens, the weighted losses give the token mean.
    :func:`token_weighted_loss` over a sequence axis; a pipeline's microbatches without one
    (``pipeline_loss``). A weight of exactly 1 returns ``loss`` itself."""
    weight = 0.0 if total == 0 else count * processes * parts / total
    if math.isclose(weight, 1.0, rel_tol=0, abs_tol=0):
        return loss
    weighted = loss * weight
    if aux:
        from .moe_balance import aux_part

        part = aux_part(loss, aux)
        if part is not None:
            weighted = weighted + (1.0 - weight) * part
    return weighted
