"""The Trainer: Keras-``fit``-style training on any trainmesh distribution."""

from .callbacks import Callback, CallbackList, EarlyStopping, LambdaCallback, ModelCheckpoint
from .config import Plan, TrainerConfig
from .history import History
from .loss_scaler import DynamicLossScaler
from .metrics import Accuracy, Mean, Metric, resolve_metric
from .schedules import scale_lr, warmup_cosine, warmup_linear
from .sharded_checkpoint import ShardedCheckpoint
from .trainer import Trainer

__all__ = [
    "Accuracy",
    "Callback",
    "CallbackList",
    "DynamicLossScaler",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "Mean",
    "Metric",
    "ModelCheckpoint",
    "Plan",
    "ShardedCheckpoint",
    "Trainer",
    "TrainerConfig",
    "resolve_metric",
    "scale_lr",
    "warmup_cosine",
    "warmup_linear",
]
