"""Training that survives a lost replica group without a restart, on torchft's Lighthouse and Managers:
gradients averaged over the groups alive at each step, a rejoining group healed from a live peer, one
group writing the shared checkpoints. See docs/fault_tolerant_replicas.md.

torchft is optional (``pip install 'trainmesh[ft]'``); importing this package does not import it.
"""

from trainmesh.ft.replica_groups import ReplicaGroups, ReplicaGroupSync, StepInfo, torchft_available
from trainmesh.ft.tensor_codec import UnsafeStateError

__all__ = ["ReplicaGroups", "ReplicaGroupSync", "StepInfo", "UnsafeStateError", "torchft_available"]
