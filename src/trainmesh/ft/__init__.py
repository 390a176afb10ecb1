"""Fault-tolerant replica groups on torchft (issue 45, first slice): see docs/fault_tolerant_replicas.md.

torchft is optional (``pip install 'trainmesh[ft]'``); importing this package does not import it.
"""

from trainmesh.ft.replica_groups import ReplicaGroups, ReplicaGroupSync, StepInfo, torchft_available
from trainmesh.ft.tensor_codec import UnsafeStateError

__all__ = ["ReplicaGroups", "ReplicaGroupSync", "StepInfo", "UnsafeStateError", "torchft_available"]
