"""torch's engine for the front end: what ``distribute_model``, ``prepare_optimizer`` and
``global_mean`` of a distribution run (registered by the package root, see
``trainmesh.distribution.backend``)."""

from __future__ import annotations

from trainmesh.distribution.backend import register_engine


def _prepare_optimizer(optimizer, distribution, zero_stage=None):
    from .zero_optimizer import shard_optimizer_state

    return shard_optimizer_state(optimizer, distribution, zero_stage=zero_stage)


def _global_mean(value):
    from .reduce import global_mean

    return global_mean(value)


def _apply_model(model, distribution, **options):
    from .parallelize import parallelize

    return parallelize(model, distribution, **options)


def register() -> None:
    register_engine(apply_model=_apply_model, prepare_optimizer=_prepare_optimizer, global_mean=_global_mean)
