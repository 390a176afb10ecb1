"""The attention function context parallelism registers in transformers' ``AttentionInterface``.

``apply_context_parallel`` (``context_parallel.py``) sets a model's attention implementation to
``"trainmesh_context_parallel"``, an entry in transformers' table of attention functions (nothing of
torch is patched). A forward whose pre-hook handed it a :class:`_Call` (this process's chunks of the
sequence: training, and ``evaluate`` / ``predict`` through ``context_parallel_eval.py``) runs ring
attention (``ring_attention.py``) or Ulysses (``ulysses.py``); any other forward (generation, a
direct call in eval mode) runs plain ``sdpa`` on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .context_parallel import SequenceContext

ATTENTION_NAME = "trainmesh_context_parallel"
_PREPARED_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # "the mask is prepared": transformers builds none


@dataclass
class _Call:
    """One split forward's extras, handed to every attention layer through the model's kwargs."""

    context: SequenceContext
    seq_len: int
    padding: torch.Tensor | None  # [B, S] bool, sequence order, or None
    documents: torch.Tensor | None = None  # [B, S] packed sequences' document index, or None
    gather: bool = False  # evaluate / predict: outputs gathered back into the whole sequence
    _mask: torch.Tensor | None = None
    _needs: bool | None = None

    def needs_mask(self) -> bool:
        """Whether attention needs more than the causal mask: padding before a real token, or documents
        (right padding needs none: a real token never sees a later pad). Decided once per forward."""
        if self._needs is None:
            left = self.padding is not None and bool((self.padding[:, 1:] & ~self.padding[:, :-1]).any())
            self._needs = left or self.documents is not None
        return self._needs

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
    if trainmesh_sequence is None:  # whole sequences: generation, direct calls in eval mode
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
    elif call.needs_mask():  # padding before real tokens, packed documents: the ring's kernels take no mask
        from .ring_masked import masked_ring_attention

        positions, order, _ = context.layout(call.seq_len, query.device)
        mask = call.mask(query.device)
        out = masked_ring_attention(
            query, key, value, group=context.group, positions=positions, order=order, mask=mask, scale=scaling
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
