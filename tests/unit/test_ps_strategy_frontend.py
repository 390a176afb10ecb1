"""ParameterServerStrategy on one process: modes, optimizer mirroring, argument errors, lazy
imports, and a Trainer run (servers started by the strategy itself) matching a plain loop,
LR scheduler and momentum included."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh.distribution import Distribution, distribution
from trainmesh.ps.param_entries import parse_mode
from trainmesh.ps.strategy import PSDistribution, current_strategy
from trainmesh.ps.worker_optimizer import PSOptimizer, server_optimizer_spec

# The Trainer on a PS strategy starts a one-process group; the planner's tests need none after it.
pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_process_group_left_behind")]


def test_parse_mode_and_per_parameter_patterns():
    assert parse_mode("sync", None) == ("sync", 0)
    assert parse_mode("async", 5) == ("async", None)
    assert parse_mode("ssp", 3) == ("ssp", 3)
    assert parse_mode("ssp:2", None) == ("ssp", 2)
    with pytest.raises(ValueError, match="staleness=None"):
        parse_mode("ssp", None)
    with pytest.raises(ValueError, match="'bsp'"):
        parse_mode("bsp", None)
    with pytest.raises(ValueError, match="'ssp:-1'"):
        parse_mode("ssp:-1", None)
    strategy = tm.ParameterServerStrategy(servers=["tcp://127.0.0.1:1"], mode={"emb.*": "async", "head.*": "ssp:1"})
    assert strategy.mode_of("emb.user") == ("async", None)
    assert strategy.mode_of("head.weight") == ("ssp", 1)
    with pytest.raises(ValueError, match="'body.weight'.*catch-all"):
        strategy.mode_of("body.weight")
    with pytest.raises(ValueError, match="No mode pattern matches"):
        strategy.bind_model(nn.ModuleDict({"body": nn.Linear(2, 2)}))  # refused before connecting


def test_server_optimizer_mirrors_the_torch_optimizer():
    params = [nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.02)
    assert server_optimizer_spec(sgd, sgd.param_groups[0], num_workers=2) == {
        "name": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "dampening": 0.0,
        "weight_decay": 0.01,
        "nesterov": True,
    }
    adam = torch.optim.Adam(params, lr=1e-3, betas=(0.8, 0.99), eps=1e-6)
    assert server_optimizer_spec(adam, adam.param_groups[0], 1) == {
        "name": "adam",
        "lr": 1e-3,
        "betas": [0.8, 0.99],
        "eps": 1e-6,
        "weight_decay": 0.0,
    }
    adagrad = torch.optim.Adagrad(params, lr=0.5, initial_accumulator_value=0.1)
    assert server_optimizer_spec(adagrad, adagrad.param_groups[0], 1)["initial_accumulator_value"] == 0.1
    rmsprop = torch.optim.RMSprop(params)
    with pytest.raises(ValueError, match="torch.optim.rmsprop.RMSprop"):
        server_optimizer_spec(rmsprop, rmsprop.param_groups[0], 1)
    amsgrad = torch.optim.Adam(params, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        server_optimizer_spec(amsgrad, amsgrad.param_groups[0], 1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_servers=0"):
        tm.ParameterServerStrategy(num_servers=0)
    with pytest.raises(ValueError, match="not a string"):
        tm.ParameterServerStrategy(servers="tcp://127.0.0.1:5555")
    with pytest.raises(ValueError, match="durability='disk'"):
        tm.ParameterServerStrategy(durability="disk")
    with pytest.raises(ValueError, match="staleness"):
        tm.ParameterServerStrategy(mode="ssp")


def test_importing_trainmesh_does_not_import_zmq_or_the_server():
    code = (
        "import sys, trainmesh, trainmesh.ps; assert trainmesh.ParameterServerStrategy; "
        "print('zmq' in sys.modules, 'trainmesh.ps.server' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_scope_distribution_and_repr():
    strategy = tm.ParameterServerStrategy(servers=["tcp://127.0.0.1:1"], mode="sync")
    assert isinstance(strategy.distribution, (Distribution, PSDistribution))
    assert strategy.num_replicas_in_sync == strategy.distribution.data_parallel_size == 1
    with strategy.scope():
        assert current_strategy() is strategy and distribution() is strategy.distribution
    assert current_strategy() is None
    assert "mode={'*': 'sync'}" in repr(strategy)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_trainer_on_local_servers_matches_a_plain_loop_with_momentum_and_scheduler():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4, generator=gen)
    y = x.sum(1, keepdim=True)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    with tm.ParameterServerStrategy(num_servers=2, mode="sync") as strategy:
        model = _model()
        trainer = tm.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            nn.MSELoss(),
            distribution=strategy,
            progress=False,
            scheduler=scheduler,
        )
        assert isinstance(trainer.optimizer, PSOptimizer) and trainer.optimizer.inner_class == "SGD"
        trainer.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=8, shuffle=False)
        assert strategy.stats()["bytes_sent"] > 0
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    schedule = scheduler(optimizer)
    for start in range(0, 48, 8):
        loss = nn.functional.mse_loss(reference(x[start : start + 8]), y[start : start + 8])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    for ours, theirs in zip(trainer.unwrapped_model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), atol=1e-5, rtol=0)


def test_unsupported_optimizer_is_refused_before_training():
    with tm.ParameterServerStrategy(num_servers=1) as strategy:
        model = _model()
        with pytest.raises(ValueError, match="RMSprop"):
            tm.Trainer(model, torch.optim.RMSprop(model.parameters()), nn.MSELoss(), distribution=strategy)
