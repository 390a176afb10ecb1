"""trainmesh: declare where tensors live, write the model once, run it on 1 or N processes.

>>> import trainmesh as tm
>>> mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=[f"cpu:{i}" for i in range(4)])
>>> layout_map = tm.LayoutMap(mesh)
>>> layout_map["d1.weight"] = ("model", None)
>>> tm.ModelParallel(layout_map=layout_map, batch_dim_name="data").data_parallel_size
2
"""

from .distribution import (
    DataParallel,
    DeviceMesh,
    Distribution,
    LayoutMap,
    ModelParallel,
    Pipeline,
    TensorLayout,
    distribution,
    set_distribution,
)
from .checkpoint.hf_save import save_pretrained
from .ft import ReplicaGroups  # torchft itself is imported only when a Trainer uses it
from .planner import plan
from .runtime import (
    barrier,
    initialize,
    is_main_process,
    list_devices,
    local_rank,
    rank,
    shutdown,
    world_size,
)

from .strategy import (
    InputContext,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    ReduceOp,
    compute_average_loss,
)
from .trainer import (
    Accuracy,
    Callback,
    EarlyStopping,
    History,
    LambdaCallback,
    Mean,
    Metric,
    ModelCheckpoint,
    ShardedCheckpoint,
    Trainer,
    TrainerConfig,
    scale_lr,
    warmup_cosine,
    warmup_linear,
)

__version__ = "0.1.0"

from ._torch import engine as _engine  # noqa: E402  (the front end applies through it)

_engine.register()


def __getattr__(name: str):
    # Lazy: importing trainmesh must not import the parameter server (or pyzmq).
    if name == "ParameterServerStrategy":
        from .ps.strategy import ParameterServerStrategy

        return ParameterServerStrategy
    if name == "ps":
        import importlib

        return importlib.import_module(".ps", __name__)
    raise AttributeError(f"module 'trainmesh' has no attribute {name!r}")


__all__ = [
    "InputContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ReduceOp",
    "compute_average_loss",
    "Accuracy",
    "Callback",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "Mean",
    "Metric",
    "ModelCheckpoint",
    "ReplicaGroups",
    "ShardedCheckpoint",
    "Trainer",
    "TrainerConfig",
    "scale_lr",
    "warmup_cosine",
    "warmup_linear",
    "DataParallel",
    "DeviceMesh",
    "Distribution",
    "LayoutMap",
    "ModelParallel",
    "Pipeline",
    "TensorLayout",
    "barrier",
    "plan",
    "save_pretrained",
    "distribution",
    "initialize",
    "is_main_process",
    "list_devices",
    "local_rank",
    "rank",
    "set_distribution",
    "shutdown",
    "world_size",
]
