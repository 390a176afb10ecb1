"""Shard: value, optimizer state and version of one key range."""

import json

import pytest
import torch

from trainmesh.ps.optimizers import make_optimizer
from trainmesh.ps.shard import Shard, init_rows

pytestmark = pytest.mark.timeout(60)

ADAM = {"name": "adam", "lr": 0.01}
SGD_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def test_dense_shard_applies_like_its_optimizer():
    init = torch.randn(16)
    shard = Shard.dense("w#0", init, ADAM)
    init_copy = init.clone()
    ref = init.clone()
    opt = make_optimizer(ADAM)
    state = opt.init_state(ref)
    for i in range(3):
        g = torch.randn(16)
        shard.apply(g, lr=0.01 / (i + 1))
        opt.step(ref, g, state, lr=0.01 / (i + 1))
    assert shard.version == 3
    assert torch.equal(shard.read(), ref)
    assert torch.equal(init, init_copy), "the caller's tensor must not be aliased"


def test_read_returns_a_copy():
    shard = Shard.dense("w#0", torch.zeros(4), {"name": "sgd", "lr": 1.0})
    before = shard.read()
    shard.apply(torch.ones(4))
    assert torch.equal(before, torch.zeros(4))
    assert torch.equal(shard.read(), -torch.ones(4))


def test_sparse_init_is_deterministic_and_differs_per_part():
    a = Shard.sparse("emb#3", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 7})
    b = Shard.sparse("emb#3", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 7})
    assert torch.equal(a.read(), b.read())
    assert torch.equal(a.read(), init_rows(100, 8, {"kind": "normal", "std": 0.02, "seed": 7}, "emb", 3))
    other_part = Shard.sparse("emb#4", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 7})
    other_seed = Shard.sparse("emb#3", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 8})
    other_name = Shard.sparse("item#3", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 7})
    for other in (other_part, other_seed, other_name):
        assert not torch.equal(a.read(), other.read())
    # name/index given explicitly take precedence over the id
    explicit = Shard.sparse("x", 100, 8, ADAM, {"kind": "normal", "std": 0.02, "seed": 7}, name="emb", index=3)
    assert torch.equal(explicit.read(), a.read())
    std = a.read().std().item()
    assert 0.015 < std < 0.025 and abs(a.read().mean().item()) < 0.005


def test_sparse_defaults_and_zeros():
    default = Shard.sparse("t#0", 50, 4, ADAM)
    assert default.init == {"kind": "normal", "std": 0.01, "seed": 0}
    assert default.read().abs().max() > 0
    zeros = Shard.sparse("t#0", 50, 4, ADAM, {"kind": "zeros"})
    assert torch.equal(zeros.read(), torch.zeros(50, 4)) and zeros.shape == (50, 4)


def test_sparse_apply_rows_and_read_rows():
    shard = Shard.sparse("t#0", 10, 3, SGD_M, {"kind": "zeros"})
    rows = torch.tensor([1, 4, 1])
    shard.apply_rows(rows, torch.ones(3, 3))
    assert shard.version == 1
    value = shard.read()
    assert torch.equal(value[1], torch.full((3,), -0.2))  # duplicates summed: 2 * lr
    assert torch.equal(value[4], torch.full((3,), -0.1))
    untouched = [r for r in range(10) if r not in (1, 4)]
    assert torch.equal(value[untouched], torch.zeros(len(untouched), 3))
    assert torch.equal(shard.read_rows(torch.tensor([4, 1, 4])), value[[4, 1, 4]])
    assert shard.state["step"].tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 0, 0]


def test_nbytes_counts_value_and_state():
    shard = Shard.sparse("t#0", 1000, 16, ADAM, {"kind": "zeros"})
    # value + exp_avg + exp_avg_sq in fp32, one int64 step per row
    assert shard.nbytes == 3 * 1000 * 16 * 4 + 1000 * 8
    assert Shard.dense("w#0", torch.zeros(10), {"name": "sgd", "lr": 1}).nbytes == 10 * 4 + 8


def test_wrong_kind_and_bad_rows_are_rejected():
    dense = Shard.dense("w#0", torch.zeros(4), ADAM)
    sparse = Shard.sparse("t#0", 5, 2, ADAM)
    with pytest.raises(ValueError, match="'w#0' is dense; use apply"):
        dense.apply_rows(torch.tensor([0]), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="'t#0' is sparse; use apply_rows"):
        sparse.apply(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="local row 5 out of range for 5 rows"):
        sparse.read_rows(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="out of range"):
        sparse.apply_rows(torch.tensor([-1]), torch.zeros(1, 2))
    assert sparse.version == 0 and dense.version == 0
    with pytest.raises(ValueError, match="1-D floating-point.*\\(2, 2\\)"):
        Shard.dense("w#0", torch.zeros(2, 2), ADAM)
    with pytest.raises(ValueError, match="rows must be an int >= 1, got 0"):
        Shard.sparse("t#0", 0, 2, ADAM)
    with pytest.raises(ValueError, match="not 'name#index'"):
        Shard.sparse("table", 4, 2, ADAM)
    with pytest.raises(ValueError, match="unknown kind 'uniform'"):
        Shard.sparse("t#0", 4, 2, ADAM, {"kind": "uniform"})
    with pytest.raises(ValueError, match=r"unknown keys \['mean'\]"):
        Shard.sparse("t#0", 4, 2, ADAM, {"kind": "normal", "mean": 1.0})
    with pytest.raises(ValueError, match="unknown optimizer name 'lamb'"):
        Shard.dense("w#0", torch.zeros(2), {"name": "lamb", "lr": 1})


def _round_trip(shard):
    tensors, meta = shard.state_dict()
    meta = json.loads(json.dumps(meta))  # must survive the wire
    tensors = {k: v.clone() for k, v in tensors.items()}
    return Shard.from_state(tensors, meta)


@pytest.mark.parametrize("spec", [ADAM, SGD_M, {"name": "adagrad", "lr": 0.1}, {"name": "sgd", "lr": 0.1}])
def test_state_round_trip_continues_identically(spec):
    """A shard moved (or restored) mid-training continues exactly like one that never moved."""
    stay = Shard.sparse("emb#1", 20, 4, spec, {"kind": "normal", "std": 0.1, "seed": 3})
    gen = torch.Generator().manual_seed(0)
    updates = [(torch.randint(0, 20, (6,), generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(6)]
    for rows, grads in updates[:3]:
        stay.apply_rows(rows, grads)
    moved = _round_trip(stay)
    assert moved.version == 3 and moved.kind == "sparse" and moved.init == stay.init
    assert moved.optimizer_spec == stay.optimizer_spec
    for rows, grads in updates[3:]:
        stay.apply_rows(rows, grads, lr=0.05)
        moved.apply_rows(rows, grads, lr=0.05)
    assert torch.equal(moved.read(), stay.read())
    for key in stay.state:
        assert torch.equal(moved.state[key], stay.state[key])
    assert moved.version == stay.version == 6


def test_dense_state_round_trip():
    shard = Shard.dense("w#2", torch.randn(9), ADAM)
    shard.apply(torch.randn(9))
    moved = _round_trip(shard)
    g = torch.randn(9)
    shard.apply(g)
    moved.apply(g)
    assert torch.equal(moved.read(), shard.read()) and moved.version == 2 and moved.init is None


def test_from_state_rejects_inconsistent_state():
    shard = Shard.sparse("t#0", 5, 2, ADAM)
    tensors, meta = shard.state_dict()
    with pytest.raises(ValueError, match=r"expected tensors .*state.exp_avg_sq"):
        Shard.from_state({k: v for k, v in tensors.items() if k != "state.exp_avg_sq"}, meta)
    with pytest.raises(ValueError, match="state 'exp_avg'"):
        Shard.from_state({**tensors, "state.exp_avg": torch.zeros(5, 3)}, meta)
    with pytest.raises(ValueError, match="meta says float32"):
        Shard.from_state({**tensors, "value": torch.zeros(5, 2, dtype=torch.float64)}, meta)
    with pytest.raises(ValueError, match="version must be an int >= 0, got -1"):
        Shard.from_state(tensors, {**meta, "version": -1})
    with pytest.raises(ValueError, match="kind must be"):
        Shard.from_state(tensors, {**meta, "kind": "ragged"})
    with pytest.raises(ValueError, match="meta must have keys"):
        Shard.from_state(tensors, {k: v for k, v in meta.items() if k != "optimizer"})
    with pytest.raises(ValueError, match=r"expected tensors"):
        # optimizer changed to one with other state
        Shard.from_state(tensors, {**meta, "optimizer": {"name": "sgd", "lr": 0.1}})
