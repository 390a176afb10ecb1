"""Per-rank random number generator state: torch (CPU and CUDA), numpy, Python ``random``.

Each rank saves its own generators (dropout masks and augmentations differ per rank).
When a checkpoint is loaded on a different number of processes there is no "same" rank
to take state from; rank ``r`` takes saved rank ``r % old_world_size``'s state and, for
``r >= old_world_size``, folds ``r`` into every generator (a deterministic reseed), so two
ranks never draw the same stream and a rerun on the same world size is reproducible.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's generators as tensors and plain values, which ``torch.load(weights_only=True)``
    reads back (numpy's and Python's own state objects would need unpickling code)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    saved = state["python"]
    random.setstate((saved["version"], tuple(int(v) for v in saved["internal"].tolist()), saved["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def source_rank(rank: int, saved_world_size: int) -> int:
    """Which saved rank's generators rank ``rank`` continues from."""
    return rank % max(int(saved_world_size), 1)


def restore_for_rank(state: dict[str, Any], rank: int, saved_world_size: int) -> None:
    """Restore, then reseed deterministically if ``rank`` did not exist in the saved job."""
    restore(state)
    if rank < saved_world_size:
        return
    # A new rank: derive fresh seeds from the restored stream plus the rank, identically on reruns.
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) ^ (rank * 0x9E3779B1 & 0x7FFFFFFF)
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))
    random.seed(seed)
