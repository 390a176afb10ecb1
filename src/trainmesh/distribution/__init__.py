"""The Keras-3-style front end: meshes, layouts and distributions, pure metadata until applied."""

from .data_parallel import DataParallel
from .distribution import Distribution, distribution, set_distribution
from .layout import LayoutMap, TensorLayout
from .mesh import DeviceMesh
from .model_parallel import ModelParallel
from .pipeline import Pipeline

__all__ = [
    "DataParallel",
    "DeviceMesh",
    "Distribution",
    "LayoutMap",
    "ModelParallel",
    "Pipeline",
    "TensorLayout",
    "distribution",
    "set_distribution",
]
