"""Server-side optimizers against torch.optim on the same gradients."""

import pytest
import torch

from trainmesh.ps.optimizers import make_optimizer

pytestmark = pytest.mark.timeout(60)

STEPS = 6


def _grads(shape, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _torch_run(opt_cls, kwargs, init, grads):
    param = torch.nn.Parameter(init.clone())
    opt = opt_cls([param], **kwargs)
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    return param.detach()


DENSE_CASES = [
    ({"name": "sgd", "lr": 0.1}, torch.optim.SGD, {"lr": 0.1}),
    (
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    ),
    (
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    ),
    (
        {"name": "sgd", "lr": 0.05, "momentum": 0.8, "dampening": 0.3},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.8, "dampening": 0.3},
    ),
    ({"name": "adam", "lr": 0.01}, torch.optim.Adam, {"lr": 0.01}),
    (
        {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
        torch.optim.Adam,
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    (
        {"name": "adamw", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1},
        torch.optim.AdamW,
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    ({"name": "adagrad", "lr": 0.1}, torch.optim.Adagrad, {"lr": 0.1}),
    (
        {"name": "adagrad", "lr": 0.1, "initial_accumulator_value": 0.5, "lr_decay": 0.1, "eps": 1e-8},
        torch.optim.Adagrad,
        {"lr": 0.1, "initial_accumulator_value": 0.5, "lr_decay": 0.1, "eps": 1e-8},
    ),
]


DENSE_IDS = [
    "sgd",
    "sgd-momentum-wd",
    "sgd-nesterov",
    "sgd-dampening",
    "adam",
    "adam-betas-eps-wd",
    "adamw-betas-eps-wd",
    "adagrad",
    "adagrad-init-lr_decay",
]


@pytest.mark.parametrize("spec,opt_cls,kwargs", DENSE_CASES, ids=DENSE_IDS)
def test_dense_step_matches_torch_optim(spec, opt_cls, kwargs):
    init = torch.randn(37, generator=torch.Generator().manual_seed(1))
    grads = _grads(37)
    expected = _torch_run(opt_cls, kwargs, init, grads)

    opt = make_optimizer(spec)
    value = init.clone()
    state = opt.init_state(value)
    for grad in grads:
        opt.step(value, grad, state)
    torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6)
    assert int(state["step"]) == STEPS


def test_lr_override_matches_a_torch_lr_schedule():
    init = torch.randn(10)
    grads = _grads(10)
    lrs = [0.1 * 0.5**i for i in range(STEPS)]
    param = torch.nn.Parameter(init.clone())
    ref = torch.optim.SGD([param], lr=lrs[0], momentum=0.9)
    for lr, grad in zip(lrs, grads):
        ref.param_groups[0]["lr"] = lr
        param.grad = grad.clone()
        ref.step()

    opt = make_optimizer({"name": "sgd", "lr": 123.0, "momentum": 0.9})
    value = init.clone()
    state = opt.init_state(value)
    for lr, grad in zip(lrs, grads):
        opt.step(value, grad, state, lr=lr)
    torch.testing.assert_close(value, param.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "spec,opt_cls,kwargs",
    [
        (
            {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
            torch.optim.SGD,
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
        ),
        (
            {"name": "adagrad", "lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.1},
            torch.optim.Adagrad,
            {"lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.1},
        ),
    ],
)
def test_row_update_equals_dense_update_on_those_rows(spec, opt_cls, kwargs):
    rows, dim = 12, 5
    touched = torch.tensor([7, 2, 9])
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))
    row_grads = _grads((3, dim))
    dense_grads = []
    for g in row_grads:
        full = torch.zeros(rows, dim)
        full[touched] = g
        dense_grads.append(full)
    expected = _torch_run(opt_cls, kwargs, init, dense_grads)

    opt = make_optimizer(spec)
    value = init.clone()
    state = opt.init_state(value)
    for g in row_grads:
        opt.step_rows(value, touched, g, state)
    torch.testing.assert_close(value[touched], expected[touched], atol=1e-6, rtol=1e-6)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(value[untouched], init[untouched])
    assert state["step"].tolist() == [STEPS if r in touched.tolist() else 0 for r in range(rows)]


def _sparse_adam_run(rows_per_step, grads_per_step, init, lr, betas, eps):
    emb = torch.nn.Embedding(init.shape[0], init.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=lr, betas=betas, eps=eps)
    for ids, grads in zip(rows_per_step, grads_per_step):
        opt.zero_grad()
        (emb(ids) * grads).sum().backward()  # d/d(rows) = grads (summed over duplicates)
        opt.step()
    return emb.weight.detach()


def test_adam_rows_match_sparse_adam_on_an_embedding():
    rows, dim = 20, 4
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(5))
    # The same row set every step (in varying order, with duplicates): one SparseAdam step
    # count equals every row's own count.
    base = torch.tensor([3, 11, 3, 17, 0])
    gen = torch.Generator().manual_seed(6)
    ids = [base[torch.randperm(5, generator=gen)] for _ in range(STEPS)]
    grads = _grads((5, dim), seed=7)
    expected = _sparse_adam_run(ids, grads, init, 0.01, (0.9, 0.99), 1e-8)

    opt = make_optimizer({"name": "adam", "lr": 0.01, "betas": [0.9, 0.99]})
    value = init.clone()
    state = opt.init_state(value)
    for i, g in zip(ids, grads):
        opt.step_rows(value, i, g, state)
    torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6)


def test_adam_rows_keep_a_step_count_per_row():
    """Rows touched at different steps: each row follows SparseAdam on that row alone."""
    rows, dim = 6, 3
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(8))
    ids = [torch.tensor([0, 1]), torch.tensor([1, 4]), torch.tensor([4, 4, 0]), torch.tensor([5])]
    grads = [g for g in _grads((3, dim), steps=len(ids), seed=9)]
    grads = [g[: len(i)] for g, i in zip(grads, ids)]

    # Reference: one SparseAdam parameter per row; an untouched row has no grad, so SparseAdam
    # neither updates it nor advances its step.
    row_params = [torch.nn.Parameter(init[r : r + 1].clone()) for r in range(rows)]
    ref = torch.optim.SparseAdam(row_params, lr=0.05)
    for i, g in zip(ids, grads):
        for p in row_params:
            p.grad = None
        for r in set(i.tolist()):
            summed = g[i == r].sum(0, keepdim=True)
            row_params[r].grad = torch.sparse_coo_tensor(
                torch.zeros(1, 1, dtype=torch.long), summed, (1, dim), check_invariants=True
            )
        ref.step()
    expected = torch.cat([p.detach() for p in row_params])

    opt = make_optimizer({"name": "adam", "lr": 0.05})
    value = init.clone()
    state = opt.init_state(value)
    for i, g in zip(ids, grads):
        opt.step_rows(value, i, g, state)
    torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6)
    assert state["step"].tolist() == [2, 2, 0, 0, 2, 1]
    assert torch.equal(value[2:4], init[2:4])


@pytest.mark.parametrize(
    "spec,opt_cls,kwargs",
    [
        ({"name": "sgd", "lr": 0.1}, torch.optim.SGD, {"lr": 0.1}),
        (
            {"name": "adagrad", "lr": 0.1, "initial_accumulator_value": 0.2},
            torch.optim.Adagrad,
            {"lr": 0.1, "initial_accumulator_value": 0.2},
        ),
    ],
    ids=["sgd", "adagrad"],
)
def test_rows_match_torch_on_a_sparse_embedding_with_varying_rows(spec, opt_cls, kwargs):
    """Where torch's sparse update does not depend on a step count, it must match exactly even
    when each step touches different rows (with duplicates)."""
    rows, dim = 15, 3
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(10))
    gen = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, rows, (7,), generator=gen) for _ in range(STEPS)]
    grads = _grads((7, dim), seed=12)

    emb = torch.nn.Embedding(rows, dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    ref = opt_cls(emb.parameters(), **kwargs)
    with torch.sparse.check_sparse_tensor_invariants():  # torch's sparse Adagrad warns otherwise
        for i, g in zip(ids, grads):
            ref.zero_grad()
            (emb(i) * g).sum().backward()
            ref.step()

    opt = make_optimizer(spec)
    value = init.clone()
    state = opt.init_state(value)
    for i, g in zip(ids, grads):
        opt.step_rows(value, i, g, state)
    torch.testing.assert_close(value, emb.weight.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_duplicate_rows_are_summed_before_the_update(name):
    spec = {"name": name, "lr": 0.1, **({"momentum": 0.9} if name == "sgd" else {})}
    init = torch.randn(4, 3)
    g = torch.randn(3, 3)
    opt = make_optimizer(spec)
    with_dupes, summed = init.clone(), init.clone()
    s1, s2 = opt.init_state(with_dupes), opt.init_state(summed)
    opt.step_rows(with_dupes, torch.tensor([2, 0, 2]), g, s1)
    opt.step_rows(summed, torch.tensor([0, 2]), torch.stack([g[1], g[0] + g[2]]), s2)
    torch.testing.assert_close(with_dupes, summed)
    assert s1["step"].tolist() == [1, 0, 1, 0]
    for key in s1:
        torch.testing.assert_close(s1[key], s2[key])


def test_empty_row_update_changes_nothing():
    opt = make_optimizer({"name": "adam", "lr": 0.1})
    value = torch.randn(4, 2)
    before = value.clone()
    state = opt.init_state(value)
    opt.step_rows(value, torch.empty(0, dtype=torch.long), torch.empty(0, 2), state)
    assert torch.equal(value, before) and int(state["step"].sum()) == 0


def test_state_layout():
    value = torch.zeros(5, 3)
    assert set(make_optimizer({"name": "sgd", "lr": 1}).init_state(value)) == {"step"}
    assert set(make_optimizer({"name": "sgd", "lr": 1, "momentum": 0.5}).init_state(value)) == {
        "step",
        "momentum_buffer",
    }
    adam = make_optimizer({"name": "adam", "lr": 1}).init_state(value)
    assert adam["step"].shape == (5,) and adam["exp_avg"].shape == (5, 3)
    ada = make_optimizer({"name": "adagrad", "lr": 1, "initial_accumulator_value": 0.25}).init_state(torch.zeros(7))
    assert ada["step"].shape == () and torch.equal(ada["sum"], torch.full((7,), 0.25))


def test_spec_is_normalized_and_json_able():
    import json

    opt = make_optimizer({"name": "adam", "lr": 1e-3, "betas": (0.5, 0.6)})
    assert json.loads(json.dumps(opt.spec)) == {
        "name": "adam",
        "lr": 1e-3,
        "betas": [0.5, 0.6],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert make_optimizer(opt.spec).spec == opt.spec


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"name": "rmsprop", "lr": 1}, "rmsprop"),
        ({"lr": 1}, "None"),
        ({"name": "sgd", "lr": 1, "mometum": 0.9}, "mometum"),
        ({"name": "sgd"}, "lr"),
        ({"name": "sgd", "lr": -1}, "-1"),
        ({"name": "sgd", "lr": "0.1"}, "'0.1'"),
        ({"name": "sgd", "lr": 1, "nesterov": True}, "nesterov"),
        ({"name": "adam", "lr": 1, "betas": [0.9]}, "betas"),
        ({"name": "adam", "lr": 1, "betas": [1.0, 0.9]}, "betas"),
        ({"name": "adagrad", "lr": float("nan")}, "nan"),
    ],
)
def test_bad_specs_are_rejected_naming_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(spec)


def test_bad_update_arguments_are_rejected():
    opt = make_optimizer({"name": "sgd", "lr": 0.1})
    value = torch.zeros(4, 2)
    state = opt.init_state(value)
    with pytest.raises(ValueError, match="out of range"):
        opt.step_rows(value, torch.tensor([4]), torch.zeros(1, 2), state)
    with pytest.raises(ValueError, match=r"\(1, 2\)"):
        opt.step_rows(value, torch.tensor([1]), torch.zeros(2, 2), state)
    with pytest.raises(ValueError, match="int64"):
        opt.step_rows(value, torch.tensor([1.0]), torch.zeros(1, 2), state)
    with pytest.raises(ValueError, match="lr override"):
        opt.step_rows(value, torch.tensor([1]), torch.zeros(1, 2), state, lr=-0.5)
    dense = torch.zeros(3)
    with pytest.raises(ValueError, match="does not match"):
        opt.step(dense, torch.zeros(4), opt.init_state(dense))
    with pytest.raises(TypeError, match="floating-point"):
        opt.init_state(torch.zeros(3, dtype=torch.int64))
    assert torch.equal(value, torch.zeros(4, 2))


@pytest.mark.parametrize("spec", [{"name": "sgd", "lr": 0.37}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}])
def test_rows_known_unique_update_like_the_general_path_bit_for_bit(spec):
    # The row store passes unique rows (unique_rows=True): plain SGD then updates in place by index,
    # without gathering and scattering the rows; the values and step counts must not change a bit.
    opt = make_optimizer(spec)
    generator = torch.Generator().manual_seed(3)
    value = torch.randn(1000, 8, generator=generator)
    rows = torch.randperm(1000, generator=generator)[:300]
    fast, fast_state = value.clone(), opt.init_state(value)
    slow, slow_state = value.clone(), opt.init_state(value)
    for step in range(3):
        grads = torch.randn(300, 8, generator=generator)
        opt.step_rows(fast, rows, grads, fast_state, lr=0.05 * step if step else None, unique_rows=True)
        opt.step_rows(slow, rows, grads, slow_state, lr=0.05 * step if step else None)
    assert torch.equal(fast, slow) and not torch.equal(fast, value)
    assert all(torch.equal(fast_state[k], slow_state[k]) for k in slow_state)
    assert int(fast_state["step"][rows].min()) == 3 and int(fast_state["step"].sum()) == 900
