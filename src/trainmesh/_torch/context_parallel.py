"""``apply_context_parallel``: a transformers model's attention over a sequence split across a mesh axis.

The batch arrives already split (``distribution/sequence_split.py``: head-tail chunks of every
sequence, labels aligned before the split, a padding mask kept whole). This module makes the model
compute exactly what one process computes on the whole sequence:

* **positions**: a forward pre-hook on the transformers model passes ``position_ids`` of this
  process's chunks (global positions, so rotary embeddings are the one-process ones);
* **attention**: the model's attention implementation is set to ``"trainmesh_context_parallel"``,
  registered in transformers' ``AttentionInterface`` (an entry in transformers' table of attention
  functions, used by the models that select it; nothing of torch is patched). It runs ring
  attention (``ring_attention.py``) or Ulysses (``ulysses.py``) on training forwards, and plain
  ``sdpa`` on whole sequences otherwise (evaluation, prediction, generation);
* **masks**: transformers builds none (a 4-D placeholder tells it the mask is prepared); the
  causal mask is the kernels' own, the padding mask comes from the pre-hook;
* **gradients** are averaged over the batch and sequence axes together (``gradient_mesh``), and
  **the loss** is weighted so that it is the global token mean (:func:`token_weighted_loss`).

Refused by name before the first step: sliding-window attention, attention sinks, attention
dropout, a custom 4-D mask, and under ring attention packed sequences that need a document mask and
padding that is not at the end. Ulysses takes both: the pre-hook hands it a ``[B, 1, S, S]`` mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.distribution.sequence_split import SequenceSplit

ATTENTION_NAME = "trainmesh_context_parallel"
_PREPARED_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # "the mask is prepared": transformers builds none


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


@dataclass
class _Call:
    """One training forward's extras, handed to every attention layer through the model's kwargs."""

    context: SequenceContext
    seq_len: int
    padding: torch.Tensor | None  # [B, S] bool, sequence order, or None
    documents: torch.Tensor | None = None  # [B, S] packed sequences' document index, or None
    _mask: torch.Tensor | None = None

    def mask(self, device) -> torch.Tensor | None:
        """Causal AND (key not padding OR the diagonal) AND (same document): a padding query attends to
        itself, so no row is empty (an empty row is NaN, and NaN times a zero gradient is NaN). Built once
        per forward."""
        if self.padding is None and self.documents is None:
            return None
        if self._mask is None:
            mask = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=device).tril()[None, None]
            if self.padding is not None:
                eye = torch.eye(self.seq_len, dtype=torch.bool, device=device)
                mask = mask & (self.padding.to(device)[:, None, None, :] | eye)
            if self.documents is not None:
                docs = self.documents.to(device)
                mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
            self._mask = mask
        return self._mask


# --- the attention function ------------------------------------------------------------------
def context_parallel_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    trainmesh_sequence: _Call | None = None,
    **kwargs,
):
    """A transformers attention function (``AttentionInterface``): ``[B, H, s, D]`` in, ``[B, s, H, D]`` out."""
    if trainmesh_sequence is None:  # whole sequences: evaluation, prediction, generation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    call = trainmesh_sequence
    context = call.context
    if context.method == "ulysses":
        from .ulysses import ulysses_attention

        _, order, restore = context.layout(call.seq_len, query.device)
        out = ulysses_attention(
            query,
            key,
            value,
            group=context.group,
            n=context.split.axis_size,
            order=order,
            restore=restore,
            scale=scaling,
            mask=call.mask(query.device),
        )
    else:
        from .ring_attention import ring_attention

        out = ring_attention(query, key, value, group=context.group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    if ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # whole-sequence forwards (evaluation, generation) get sdpa's masks, as sdpa would
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# --- checks ----------------------------------------------------------------------------------
def transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost transformers model inside ``model`` (a user's wrapper around one is fine)."""
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "set_attn_implementation"):
            return module
    return None


def resolve_method(method: str, heads: int, kv_heads: int, size: int) -> str:
    """``auto``: Ulysses where the query heads divide over the axis (4 all-to-alls of 1/n of Q, K, V, O
    per layer, one kernel call over the whole sequence), else ring (K/V of the whole sequence gathered
    per layer, any head count)."""
    if method == "auto":
        return "ulysses" if heads % size == 0 else "ring"
    if method == "ulysses" and heads % size:
        raise ValueError(
            f"Ulysses splits the attention heads over the sequence axis: {heads} heads do not divide "
            f"over {size} processes. Use context_parallel='ring', or an axis size that divides the "
            f"heads. Received: num_attention_heads={heads}, axis size {size}"
        )
    return method


def check_config(config) -> tuple[int, int]:
    """``(heads, kv_heads)``; unsupported attention features refused by name."""
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(config, name, None) and getattr(config, "use_sliding_window", True):
            raise ValueError(
                f"Context parallelism supports full causal attention only; this model uses a "
                f"sliding window. Received: {name}={getattr(config, name)}"
            )
    if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
        raise ValueError(
            f"Context parallelism supports full causal attention only. Received: "
            f"layer_types={sorted(set(config.layer_types))}"
        )
    if any("sink" in name for name in vars(config)):
        raise ValueError(
            "Context parallelism does not support attention sinks. Received: a config with "
            f"{[n for n in vars(config) if 'sink' in n]}"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"Context parallelism does not support attention dropout. Received: "
            f"attention_dropout={config.attention_dropout}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"Context parallelism needs num_attention_heads in the model's config. Received: {config!r}")
    return heads, getattr(config, "num_key_value_heads", None) or heads


# --- the pre-hook ----------------------------------------------------------------------------
def _pre_hook(context: SequenceContext, module, args, kwargs):
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not module.training:  # whole sequences (evaluation, prediction, generation)
        if tokens is not None and tokens.dim() < 2:
            # the usual cause: a bare tensor handed to predict/evaluate is an iterable of batches, each row
            # one batch; transformers then fails deep in the rotary embedding (q * cos, heads vs head_dim)
            raise ValueError(
                "The model takes [batch, seq] input_ids; it got one row. predict and evaluate iterate a bare "
                "tensor as batches (each row one batch): pass (inputs,) or a Dataset. Received: input_ids of "
                f"shape {tuple(tokens.shape)}"
            )
        return None
    if tokens is None or tokens.dim() < 2:
        raise ValueError(
            "A model over a sequence axis takes [batch, seq] input_ids (or inputs_embeds). Received: "
            f"{type(tokens).__name__}"
        )
    local = tokens.shape[1]
    seq_len = local * context.split.axis_size
    given = kwargs.get("position_ids")
    padding = kwargs.pop("attention_mask", None)
    documents = _documents(module, kwargs, given, padding, seq_len, tokens.shape[0], context.method)
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
        elif context.method == "ring" and bool((padding[:, 1:] & ~padding[:, :-1]).any()):
            raise ValueError(
                "Ring attention takes padding at the end of sequences only (it is then exactly "
                "the causal mask for every real token); use context_parallel='ulysses' for "
                "left padding. Received: an attention_mask with padding before real tokens"
            )
    positions, _, _ = context.layout(seq_len, tokens.device)
    if given is None:
        kwargs["position_ids"] = positions.unsqueeze(0).expand(tokens.shape[0], -1)
    else:  # packed sequences: the user's positions (restarting), this process's columns of them
        kwargs["position_ids"] = given.expand(tokens.shape[0], -1).index_select(1, positions.to(given.device))
    kwargs["attention_mask"] = _PREPARED_MASK.to(tokens.device)
    kwargs["trainmesh_sequence"] = _Call(context, seq_len, padding, documents)
    return args, kwargs


def _documents(module, kwargs, given, padding, seq_len: int, batch: int, method: str) -> torch.Tensor | None:
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

    documents = find_packed_sequence_indices(given.expand(batch, -1))
    if documents is not None and method == "ring":
        raise ValueError(
            "Packed sequences (position_ids that restart, without an attention mask or cache) need a "
            "document mask, which ring attention does not take; use context_parallel='ulysses'. "
            "Received: position_ids restarting inside a row"
        )
    return documents


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
    model._trainmesh_sequence = context
    return model


def sequence_context(model: nn.Module) -> SequenceContext | None:
    module = getattr(model, "module", model)  # DDP's
    return getattr(module, "_trainmesh_sequence", None)


def token_weighted_loss(model: nn.Module, loss: torch.Tensor, targets) -> torch.Tensor:
    """Over a sequence axis, ``loss`` (this process's mean over its tokens) times
    ``its tokens x processes / all tokens``: gradients averaged over the processes are then those of the
    global token mean, and so is the reported loss, padding or not. Tokens are targets other than -100
    (cross-entropy's ``ignore_index``). One 8-byte all-reduce per micro-batch."""
    context = sequence_context(model)
    if context is None or not torch.is_tensor(targets):
        return loss
    local = (targets != -100).sum() if not targets.is_floating_point() else torch.tensor(targets.shape[:2].numel())
    count = local.to(torch.float64).reshape(1)  # on the targets' device: NCCL groups take CUDA tensors
    total = count.clone()
    dist.all_reduce(total, group=context.grad_group)
    if total.item() == 0:
        return loss * 0.0
    weight = count.item() * context.grad_size / total.item()
    return loss if math.isclose(weight, 1.0, rel_tol=0, abs_tol=0) else loss * weight
