"""How gradients and signals travel between processes: the one collective facade of the loop.

* ``diagnosis``: progress beacons and hang diagnosis;
* ``accounting``: bytes each rank sends per optimizer step (compressed and uncompressed);
* ``ddp_hooks``: a DDP communication hook that averages through a ``trainmesh.compression``
  compressor (stage 0 and ZeRO-1);
* ``reduce_scatter``: the same for FSDP2's reduce-scatter (ZeRO stages 2-3);
* ``hierarchical``: all-reduce inside each node, across nodes, inside again.

The Trainer installs them from ``TrainerConfig.compression`` / ``hierarchical_allreduce``
(``trainmesh.trainer.communication``).
"""

from .accounting import ByteCounter, StepBytes
from .ddp_hooks import CompressionHookState, compressed_allreduce_hook
from .diagnosis import CollectiveTimeoutError, ProgressBeacon
from .hierarchical import HierarchicalState, hierarchical_all_reduce_, hierarchical_hook, node_groups
from .reduce_scatter import CompressedReduceScatter

__all__ = [
    "ByteCounter", "CollectiveTimeoutError", "CompressedReduceScatter", "CompressionHookState", "HierarchicalState",
    "ProgressBeacon", "StepBytes", "compressed_allreduce_hook", "hierarchical_all_reduce_", "hierarchical_hook",
    "node_groups",
]
