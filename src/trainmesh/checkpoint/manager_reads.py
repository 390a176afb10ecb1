"""Reading checkpoints back: which ones exist, which is the newest valid one, and loading one into
the objects of a run laid out as it is now.

It exists apart from ``manager.py`` so that the write path (save, agree, commit, abandon) and the
read path read on their own. ``CheckpointReads`` is a mixin of ``CheckpointManager``: it uses the
manager's attributes (``directory``, ``keep_best``, ``verify_checksums``, ``_pending``, ``_group``)
and its collective helpers (``_barrier``, ``_rank0_decides``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .. import runtime
from .._torch import dcp as _dcp
from .._torch import trainable_state
from . import integrity, retention, rng
from .single_file import load_plain
from .state_split import _split
from .survey import Survey, survey_directory


class CheckpointReads:
    """Discovery and load for :class:`~trainmesh.checkpoint.CheckpointManager` (see the module docstring)."""

    # --- discovery ----------------------------------------------------------------------
    def checkpoints(self) -> list[str]:
        """Committed checkpoint directories, oldest first (markers only; no checksum pass)."""
        return [e.path for e in retention.complete_entries(self.directory)]

    def latest(self) -> str | None:
        """The newest checkpoint that passes validation; a broken one is skipped with a warning
        (so is a directory without a complete marker). Collective: see :meth:`survey`."""
        return self.survey().chosen

    def survey(self) -> Survey:
        """The newest valid checkpoint and every rejected one with why (warned about on rank 0).

        Rank 0 checks and tells the others, so every rank resumes from the same one, or raises
        the same error, before any training collective.
        """

        def look() -> Survey:
            found = survey_directory(self.directory, checksums=self.verify_checksums)
            if self._pending is not None:  # this save is in flight, not abandoned
                found = dataclasses.replace(
                    found,
                    unfinished=tuple(
                        p for p in found.unfinished if os.path.abspath(p) != os.path.abspath(self._pending.tmp_dir)
                    ),
                )
            found.warn(stacklevel=5)
            return found

        return self._rank0_decides(look)

    def set_aside(self, paths) -> list[str]:
        """Rename each of ``paths`` (rejected checkpoints) to ``<path>.rejected`` (collective; rank 0
        renames): a fresh start then neither reads nor prunes them, and nothing is deleted."""

        def rename() -> list[str]:
            moved = []
            for path in paths:
                if os.path.isdir(path):
                    os.replace(path, path + ".rejected")
                    moved.append(path + ".rejected")
            return moved

        return self._rank0_decides(rename)

    def best(self) -> str | None:
        entry = retention.best_entry(retention.complete_entries(self.directory), self.keep_best)
        return entry.path if entry else None

    # --- load ---------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None, state: dict[str, Any]) -> dict[str, Any] | None:
        """Load ``path`` (or the latest complete checkpoint for ``None``/``"latest"``) into ``state``.

        Model and optimizer are read as they are laid out now (any world size, ZeRO stage or
        mesh). Rank r restores saved rank ``r % saved_world_size``'s RNG and ``data`` state
        (see ``rng``). Returns the saved plain values (e.g. ``{"trainer": {...}}``) plus
        ``"step"`` and ``"metrics"``, or None when there is no checkpoint yet.
        """
        if path is None or path == "latest":
            path = self.latest()
            if path is None:
                return None
        path = os.fspath(path)
        marker = integrity.read_marker(path)
        if marker is None:
            raise ValueError(f"{path!r} is not a complete checkpoint (no {integrity.MARKER}).")
        model, optimizer, per_rank, shared, _ = _split(state)
        if model is not None:
            if optimizer is not None and not marker.get("has_optimizer", True):
                raise ValueError(f"{path} holds no optimizer state, but state has an optimizer.")
            trainable_state.check_same_frozen(model, marker, path, self._group)
            _dcp.load_sharded(
                model,
                optimizer,
                os.path.join(path, "dcp"),
                self._group,
                trainable_only=trainable_state.trainable_only_keys(marker),
            )
        saved_world = int(marker["world_size"])
        source = rng.source_rank(runtime.rank(), saved_world)
        # Our own files, checksummed at commit, and read with weights_only=True all the same.
        extras = self._rank_extras(path, source)
        rng.restore_for_rank(extras["rng"], runtime.rank(), saved_world)
        every_rank: list[dict[str, Any]] | None = None  # all saved ranks' extras, read once if needed
        for key, obj in per_rank.items():
            if saved_world != runtime.world_size() and callable(getattr(obj, "load_resharded_state", None)):
                if every_rank is None:
                    every_rank = [extras if r == source else self._rank_extras(path, r) for r in range(saved_world)]
                obj.load_resharded_state([saved.get(key) for saved in every_rank])
            elif key in extras:
                obj.load_state_dict(extras[key])
        common = load_plain(os.path.join(path, "shared.pt"))
        for key, obj in shared.items():
            if key in common["stateful"]:
                obj.load_state_dict(common["stateful"][key])
        self._barrier()
        return {**common["plain"], "step": marker["step"], "metrics": marker.get("metrics", {})}

    @staticmethod
    def _rank_extras(path: str, rank: int) -> dict[str, Any]:
        return load_plain(os.path.join(path, f"rank_{rank:05d}.pt"))
