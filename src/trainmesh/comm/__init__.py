"""How gradients and signals travel between processes: the one collective facade of the loop.

* ``diagnosis``: progress beacons and hang diagnosis;
* ``accounting``: bytes each rank sends per optimizer step (compressed and uncompressed);
* ``ddp_hooks``: a DDP communication hook that averages through a ``trainmesh.compression``
  compressor (stage 0 and ZeRO-1);
* ``reduce_scatter``: the same for FSDP2's reduce-scatter (ZeRO stages 2-3);
* ``hierarchical``: all-reduce inside each node, across nodes, inside again;
* ``two_phase``: compressed reduce-scatter + compressed all-gather (int8 on the wire both ways);
* ``powersgd_exchange``: PowerSGD's P and Q all-reduces, over every process or between hosts only;
* ``bucket_worker``: the hooks' background thread (overlap with backward) and bucket merging;
* ``topology``: which processes share a host, from the processes themselves;
* ``probe``: ``communication="auto"``: measure the links once, choose, say why.

The Trainer installs them from ``TrainerConfig.compression`` / ``hierarchical_allreduce``
(``trainmesh.trainer.communication``).
"""

from .accounting import ByteCounter, StepBytes
from .ddp_hooks import CompressionHookState, compressed_allreduce_hook
from .diagnosis import CollectiveTimeoutError, ProgressBeacon
from .hierarchical import HierarchicalState, hierarchical_all_reduce_, hierarchical_hook, node_groups
from .probe import CommPlan
from .reduce_scatter import CompressedReduceScatter
from .topology import Topology, discover, host_groups
from .two_phase import hierarchical_compressed_all_reduce, two_phase_all_reduce, two_phase_wire_bytes

__all__ = [
    "ByteCounter",
    "CollectiveTimeoutError",
    "CommPlan",
    "CompressedReduceScatter",
    "CompressionHookState",
    "HierarchicalState",
    "ProgressBeacon",
    "StepBytes",
    "Topology",
    "compressed_allreduce_hook",
    "discover",
    "hierarchical_all_reduce_",
    "hierarchical_compressed_all_reduce",
    "hierarchical_hook",
    "host_groups",
    "node_groups",
    "two_phase_all_reduce",
    "two_phase_wire_bytes",
]
