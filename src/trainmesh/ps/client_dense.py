"""The dense half of ``PSClient``: ``pull`` and ``push`` of dense parameters.

A mixin, as client_rows.py is for the sparse rows, so the dense path reads as one concept apart
from the client's setup, clocks and shutdown. A parameter is split into the partitioner's parts,
each sent to the server that owns it, batched per server by ``_batches``. It uses the client's
``params`` (the specs passed to ``init``), ``partitioner``, ``compressor``, ``_owner``,
``_shard_cache``, ``_batches``, ``io``, ``clock_value``, ``worker_id``, ``_track_push`` and
``_note_pull``, all set up by ``PSClient.__init__``.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import torch

from .protocol import Message, MessageType


class DenseCalls:
    """``pull`` / ``push`` of dense parameters for ``PSClient`` (see the module docstring)."""

    def pull(self, names: Sequence[str], *, with_clock: bool = False) -> Future:
        """Future of ``{name: tensor}`` (the server values, in each parameter's shape).

        ``with_clock=True``: future of ``(values, fresh_clock)``, where the values include every
        update made at clocks < ``fresh_clock`` by every live worker (the smallest live clock the
        answering servers had; infinity where none was live, as the servers' gate reads it). The
        SSP cache (``dense_cache.py``) reuses them while its clock - staleness <= ``fresh_clock``."""
        names = [names] if isinstance(names, str) else list(names)
        plan = {name: self._dense_parts(name) for name in names}
        by_server: dict[int, list[str]] = {}
        for parts in plan.values():
            for part in parts:
                by_server.setdefault(self._owner(part.shard_id), []).append(part.shard_id)
        clock = self.clock_value
        messages = [
            (i, Message(MessageType.PULL, self.worker_id, 0, meta={"clock": clock, "shards": sids, "rows": {}}))
            for i, sids in by_server.items()
        ]

        def assemble(replies: list[Message]) -> Any:
            self._note_pull(clock)
            got = {sid: t for reply in replies for sid, t in reply.tensors.items()}
            values = {
                name: torch.cat([got[p.shard_id] for p in parts]).reshape(self.params[name]["shape"])
                for name, parts in plan.items()
            }
            if not with_clock:
                return values
            fresh = [reply.meta.get("min_clock") for reply in replies]
            return values, min((f if isinstance(f, int) else math.inf for f in fresh), default=math.inf)

        return self.io.submit(messages, assemble)

    def push(self, grads: Mapping[str, torch.Tensor], *, lr: float | None = None) -> Future:
        """Send dense gradients; the future is done when every server acknowledged (applied, or for a
        sync parameter added to this clock's round, which is applied once every worker clocked past
        it; durable either way).

        Large float32 gradients are sent without a copy, from their own memory (as
        ``torch.distributed.isend`` does): do not modify them in place before the future is done."""
        items: list[tuple[int, dict[str, torch.Tensor], dict[str, Any]]] = []  # (server, tensors, compression)
        for name, grad in grads.items():
            spec = self.params.get(name)
            if not isinstance(grad, torch.Tensor):
                raise TypeError(f"gradient for {name!r} must be a torch.Tensor, got {type(grad).__name__}")
            if spec is None or spec["kind"] != "dense" or tuple(grad.shape) != tuple(spec["shape"]):
                raise ValueError(
                    f"push of {name!r} with shape {tuple(grad.shape)}: expected a dense parameter "
                    f"passed to init, got {spec and (spec['kind'], spec['shape'])}"
                )
            flat = _flat_float32(grad)
            for part in self._dense_shards(name, flat.numel()):
                # A shard that is the whole gradient is sent from the gradient itself (the usual
                # case for tensors up to part_numel): no slice, no copy.
                piece = flat if part.stop - part.start == flat.numel() else flat[part.start : part.stop]
                if self.compressor is None:
                    items.append(
                        (
                            self._owner(part.shard_id),
                            {part.shard_id: piece if piece.is_contiguous() else piece.contiguous()},
                            {},
                        )
                    )
                    continue
                packed = self.compressor.compress(piece, key=part.shard_id)
                tensors = {f"{part.shard_id}|{k}": v.contiguous() for k, v in packed.tensors.items()}
                info = {
                    part.shard_id: {"spec": self.compressor.name, "meta": packed.meta, "keys": list(packed.tensors)}
                }
                items.append((self._owner(part.shard_id), tensors, info))
        messages = []
        for server, batch in self._batches(items):
            shards = [sid for _, _, info in batch for sid in info] or [sid for _, t, _ in batch for sid in t]
            # "round": the iteration this push belongs to; a sync parameter's pushes are summed per round
            meta: dict[str, Any] = {"shards": shards, "rows": {}, "round": self.clock_value}
            if self.compressor is not None:
                meta["compression"] = {k: v for _, _, info in batch for k, v in info.items()}
            if lr is not None:
                meta["lr"] = float(lr)
            messages.append(
                (
                    server,
                    Message(
                        MessageType.PUSH,
                        self.worker_id,
                        0,
                        tensors={k: v for _, t, _ in batch for k, v in t.items()},
                        meta=meta,
                    ),
                )
            )
        return self._track_push(self.io.submit(messages))

    def _dense_shards(self, name: str, numel: int):
        """The partitioner's parts of a dense parameter, computed once per (name, numel): a push
        of the same parameter every step need not rebuild them."""
        parts = self._shard_cache.get((name, numel))
        if parts is None:
            parts = self._shard_cache[(name, numel)] = self.partitioner.dense_shards(name, numel)
        return parts

    def _dense_parts(self, name: str):
        spec = self.params.get(name)
        if spec is None or spec["kind"] != "dense":
            raise ValueError(f"pull({name!r}): not a dense parameter passed to init; known: {sorted(self.params)}")
        return self._dense_shards(name, math.prod(spec["shape"]))


def _flat_float32(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a 1-D float32 CPU tensor, without a torch call for a step that is not needed
    (each one hands the GIL to the client's I/O thread, which runs at the same time)."""
    flat = grad.detach()
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        flat = flat.to("cpu", torch.float32)
    return flat if flat.dim() == 1 else flat.reshape(-1)
