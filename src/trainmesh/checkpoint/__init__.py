"""Sharded, crash-safe, resharding checkpoints on ``torch.distributed.checkpoint``.

>>> from trainmesh.checkpoint import CheckpointManager, export_consolidated, load_initial_weights
"""

from .export import export_consolidated, load_initial_weights
from .manager import CheckpointManager

__all__ = ["CheckpointManager", "export_consolidated", "load_initial_weights"]
