"""The only package that imports DTensor, DDP and torch's DeviceMesh: front end -> torch machinery."""

from .data_parallel import apply_data_parallel
from .mesh import to_placements, to_torch_mesh
from .tensor_parallel import apply_model_parallel, batch_to_local

__all__ = ["apply_data_parallel", "apply_model_parallel", "batch_to_local", "to_placements", "to_torch_mesh"]
