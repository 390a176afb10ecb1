"""A sequence axis on the mesh: each training sequence split over it (context parallelism), described.

``SequenceSplit`` is what ``DataParallel(..., sequence_dim_name="seq")`` and
``ModelParallel(..., sequence_dim_name="seq")`` hold: the axis, the attention method and the
chunking rule. It is pure description plus the batch split itself (plain tensor indexing, no
process group): the processes of one data replica hold the same samples (they share a data
index), and each keeps its chunk of every sequence.

Chunking. With ``load_balance`` (the default, for causal attention) every sequence is cut into
``2 x axis`` chunks and process ``r`` keeps chunks ``r`` and ``2 x axis - 1 - r`` (head-tail):
under a causal mask the early chunks attend to little and the late ones to a lot, so pairing them
gives every process the same work. This is the order torch's ring templates expect
(``torch.distributed.tensor.experimental._context_parallel``, "round-robin load balance").

What is split, of an ``(inputs, targets)`` batch:

* ``inputs``: a ``[batch, seq]`` tensor of token ids, or a dict holding ``input_ids`` (split)
  and optionally ``attention_mask`` (a 2-D padding mask) and ``position_ids`` (packed sequences:
  positions that restart), both kept whole: attention needs them for every key, and they are small;
* ``targets``: ``[batch, seq, ...]`` labels, already aligned with the inputs (shifted by one
  before the split, as ``(tokens[:, :-1], tokens[:, 1:])``), split like the inputs.

>>> split = SequenceSplit(axis="seq", axis_size=2)
>>> split.chunk_positions(8, index=0).tolist(), split.chunk_positions(8, index=1).tolist()
([0, 1, 6, 7], [2, 3, 4, 5])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("ring", "ulysses", "auto")
WHOLE = ("attention_mask", "position_ids")  # inputs every process keeps whole
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv")  # _torch/pipeline_zero_bubble.SPLIT_BACKWARD


@dataclass(frozen=True, kw_only=True)
class SequenceSplit:
    """Context parallelism over one mesh axis.

    axis: the mesh axis whose processes share each sequence.
    axis_size: its number of processes.
    method: ``"ring"`` (K/V travel over the axis; any number of heads), ``"ulysses"`` (an
        all-to-all turns the sequence split into a head split around attention; needs the
        attention heads to divide over the axis) or ``"auto"`` (Ulysses where the heads divide,
        else ring; resolved when the model is distributed).
    load_balance: head-tail chunks (causal attention); ``False`` keeps contiguous chunks.
    """

    axis: str
    axis_size: int
    method: str = "auto"
    load_balance: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"context_parallel must be one of {METHODS}. Received: context_parallel={self.method!r}")
        if self.axis_size < 1:
            raise ValueError(f"The sequence axis needs at least one process. Received: axis_size={self.axis_size}")

    @property
    def num_chunks(self) -> int:
        """Into how many equal chunks a sequence is cut (the length must divide by it)."""
        return 2 * self.axis_size if self.load_balance else self.axis_size

    def check_length(self, seq_len: int) -> None:
        """A ``ValueError`` naming the rule, raised by every process alike before any collective."""
        if seq_len % self.num_chunks:
            rule = (
                f"2 x the axis size ({self.num_chunks})" if self.load_balance else f"the axis size ({self.num_chunks})"
            )
            raise ValueError(
                f"A sequence split over the {self.axis!r} axis of {self.axis_size} processes must have a "
                f"length divisible by {rule}, for head-tail load balancing. Pad the sequences (labels "
                f"-100), or pick a length that divides. Received: sequence length {seq_len}"
            )

    def chunk_positions(self, seq_len: int, index: int) -> torch.Tensor:
        """Global positions (0..seq_len-1) of the tokens that process ``index`` of the axis keeps, in the
        order it keeps them."""
        self.check_length(seq_len)
        size = seq_len // self.num_chunks
        chunks = (index, self.num_chunks - 1 - index) if self.load_balance else (index,)
        return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])

    def gathered_order(self, seq_len: int) -> torch.Tensor:
        """Global positions in the order an all-gather (or all-to-all) over the axis lays the chunks out:
        process 0's tokens, then process 1's, ... (``argsort`` of it restores the sequence order)."""
        return torch.cat([self.chunk_positions(seq_len, i) for i in range(self.axis_size)])

    def index_of(self, mesh, rank: int | None = None) -> int:
        """This process's (or ``rank``'s) place along the axis."""
        if rank is None:
            from trainmesh.runtime import rank as current_rank

            rank = current_rank()
        coordinate = mesh.coordinate_of(rank)
        return 0 if coordinate is None else coordinate[mesh.axis_index(self.axis)]

    # --- the batch split ------------------------------------------------------------------
    def split_batch(self, batch: Any, index: int) -> Any:
        """This process's chunk of every sequence of an ``(inputs, targets)`` batch (see the module doc)."""
        if self.axis_size == 1:
            return batch
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, targets = batch
            seq_len = _sequence_length(inputs)
            keep = self.chunk_positions(seq_len, index)
            return type(batch)((self._split_inputs(inputs, keep, seq_len), _take(targets, keep, seq_len, "targets")))
        return self._split_inputs(batch, self.chunk_positions(_sequence_length(batch), index), None)

    def _split_inputs(self, inputs: Any, keep: torch.Tensor, seq_len: int | None) -> Any:
        if torch.is_tensor(inputs):
            return _take(inputs, keep, seq_len, "inputs")
        if isinstance(inputs, dict):
            if "labels" in inputs:
                raise ValueError(
                    "Pass labels as the targets of an (inputs, targets) batch, shifted by one, not inside "
                    "the inputs: the model would shift each process's chunk on its own. Received: labels"
                )
            out = {}
            for key, value in inputs.items():
                # the padding mask and packed sequences' positions stay whole: attention needs every key's,
                # and they are B x S numbers (the model is handed this process's positions from them)
                out[key] = value if key in WHOLE else _take(value, keep, seq_len, key)
            return out
        raise TypeError(
            f"Inputs split over a sequence axis are a token tensor or a dict of them. Received: {type(inputs).__name__}"
        )


def _sequence_length(inputs: Any) -> int:
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        inputs = inputs[0]
    if isinstance(inputs, dict):
        inputs = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if not torch.is_tensor(inputs) or inputs.dim() < 2:
        raise ValueError(
            "A batch split over a sequence axis needs [batch, seq, ...] inputs (or a dict with "
            f"input_ids). Received: {type(inputs).__name__} of shape {tuple(getattr(inputs, 'shape', ()))}"
        )
    return int(inputs.shape[1])


def _take(value: Any, keep: torch.Tensor, seq_len: int | None, name: str) -> Any:
    if not torch.is_tensor(value) or value.dim() < 2:
        return value
    if seq_len is not None and value.shape[1] != seq_len:
        raise ValueError(
            f"Every split tensor must have the inputs' sequence length {seq_len} in dim 1. "
            f"Received: {name} of shape {tuple(value.shape)}"
        )
    return value.index_select(1, keep.to(value.device))


def build_sequence_split(
    mesh, sequence_dim_name: str | None, context_parallel: str, *, batch_dim_name: str | None, pipeline=None
) -> SequenceSplit | None:
    """The distributions' constructor check: ``None`` without a sequence axis, else its ``SequenceSplit``."""
    if sequence_dim_name is None:
        if context_parallel != "auto":
            raise ValueError(
                f"context_parallel={context_parallel!r} needs a sequence axis: pass "
                f"sequence_dim_name=. Received: sequence_dim_name=None"
            )
        return None
    if sequence_dim_name not in mesh.axis_names:
        raise ValueError(
            f"sequence_dim_name {sequence_dim_name!r} is not an axis of the mesh {mesh.axis_names}. "
            f"Received: sequence_dim_name={sequence_dim_name!r}"
        )
    if sequence_dim_name == batch_dim_name:
        raise ValueError(f"The sequence axis must differ from the batch axis. Received: both {sequence_dim_name!r}")
    if pipeline is not None and mesh.axis_size(pipeline.axis) > 1 and pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
        # the zero-bubble schedules run a stage's input gradients and weight gradients as two
        # backwards; attention's collectives over the sequence axis run inside the first, and that
        # split is not checked against one process here
        raise ValueError(
            "A sequence axis beside a pipeline takes the gpipe, 1f1b, interleaved_1f1b and looped_bfs "
            "schedules; the zero-bubble schedules (split backward) are not supported with it. Received: "
            f"sequence_dim_name={sequence_dim_name!r}, schedule={pipeline.schedule!r}"
        )
    return SequenceSplit(axis=sequence_dim_name, axis_size=mesh.axis_size(sequence_dim_name), method=context_parallel)
