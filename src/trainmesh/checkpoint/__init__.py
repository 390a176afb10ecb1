"""Sharded, crash-safe, resharding checkpoints on ``torch.distributed.checkpoint``.

>>> from trainmesh.checkpoint import CheckpointManager, export_consolidated, load_initial_weights
"""

from .export import export_consolidated, load_initial_weights
from .manager import CheckpointManager
from .survey import NoValidCheckpointError

__all__ = ["CheckpointManager", "NoValidCheckpointError", "export_consolidated", "load_initial_weights"]
