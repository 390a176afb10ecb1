"""TrainerConfig validation, Plan derivation and the loss scaler's state machine (one process, no group)."""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.trainer.config import Plan, TrainerConfig
from trainmesh.trainer.loss_scaler import DynamicLossScaler
from trainmesh.trainer.precision import build_precision

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp8"}, "precision"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"grad_accum_steps": 1.5}, "grad_accum_steps"),
        ({"max_grad_norm": 0}, "max_grad_norm"),
        ({"lr_scaling": "cubic", "base_batch_size": 32}, "lr_scaling"),
        ({"lr_scaling": "linear"}, "base_batch_size"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"progress": "sometimes"}, "progress"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
    ],
)
def test_bad_config_is_rejected_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kwargs)


def test_unknown_option_and_config_plus_options_are_rejected():
    with pytest.raises(TypeError, match="grad_acum"):
        TrainerConfig.from_kwargs(None, {"grad_acum": 2})
    with pytest.raises(ValueError, match="either"):
        TrainerConfig.from_kwargs(TrainerConfig(), {"precision": "fp32"})
    assert TrainerConfig.from_kwargs(None, {"grad_accum_steps": 3}).grad_accum_steps == 3


def test_plan_derives_micro_batch_steps_and_scaled_lr():
    config = TrainerConfig(grad_accum_steps=2, lr_scaling="linear", base_batch_size=32)
    plan = Plan.derive(config, global_batch_size=128, data_parallel_size=4, num_samples=1000, epochs=3, base_lr=0.1)
    assert plan.micro_batch_size == 16  # 128 = 16 x 2 x 4
    assert plan.steps_per_epoch == math.ceil(1000 / 128)
    assert plan.lr == pytest.approx(0.4)
    text = plan.describe()
    assert "micro-batch 16 x accumulation 2 x data-parallel 4" in text and "scaled from 0.1" in text
    sqrt = Plan.derive(
        TrainerConfig(lr_scaling="sqrt", base_batch_size=32),
        global_batch_size=128,
        data_parallel_size=1,
        num_samples=None,
        epochs=1,
        base_lr=0.1,
    )
    assert sqrt.lr == pytest.approx(0.2) and sqrt.steps_per_epoch is None


def test_plan_rejects_contradictions_before_training():
    config = TrainerConfig(grad_accum_steps=3)
    with pytest.raises(ValueError, match="batch_size=64"):
        Plan.derive(config, global_batch_size=64, data_parallel_size=2, num_samples=100, epochs=1, base_lr=0.1)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        Plan.derive(
            TrainerConfig(drop_remainder=True),
            global_batch_size=64,
            data_parallel_size=1,
            num_samples=10,
            epochs=1,
            base_lr=0.1,
        )
    with pytest.raises(ValueError, match="epochs"):
        Plan.derive(TrainerConfig(), global_batch_size=8, data_parallel_size=1, num_samples=10, epochs=0, base_lr=0.1)


def test_loss_scaler_grows_after_clean_steps_and_halves_on_overflow():
    scaler = DynamicLossScaler(init_scale=2.0**15, growth_interval=3)
    param = torch.nn.Parameter(torch.ones(4))
    for _ in range(3):
        param.grad = torch.full((4,), 2.0**15)
        assert scaler.unscale_([param]) is False
        torch.testing.assert_close(param.grad, torch.ones(4))  # unscaled in place
        scaler.update(False)
    assert scaler.scale_value == 2.0**16  # grew after 3 clean steps
    param.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    assert scaler.unscale_([param]) is True
    scaler.update(True)
    assert scaler.scale_value == 2.0**15 and scaler.skipped_steps == 1 and scaler.clean_steps == 0
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_loss_scaler_finds_a_nan_in_any_gradient_of_any_dtype():
    scaler = DynamicLossScaler(init_scale=4.0)
    params = [
        torch.nn.Parameter(torch.ones(3)),
        torch.nn.Parameter(torch.ones(2, dtype=torch.float16)),
        torch.nn.Parameter(torch.ones(5)),
        torch.nn.Parameter(torch.ones(1)),
    ]
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0, dtype=torch.float16), torch.full((5,), 2.0), None]
    for param, grad in zip(params, grads):
        param.grad = grad
    assert scaler.unscale_(params) is False
    assert [p.grad.tolist() for p in params[:3]] == [[2.0] * 3, [1.0] * 2, [0.5] * 5]
    assert params[1].grad.dtype == torch.float16 and params[3].grad is None
    params[1].grad[1] = float("nan")  # in the fp16 group only
    assert scaler.unscale_(params) is True


def test_default_scaler_matches_the_issue():
    scaler = build_precision("fp16-mixed").scaler
    assert (scaler.scale_value, scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval) == (
        2.0**15,
        2.0,
        0.5,
        2000,
    )
    assert build_precision("bf16-mixed").scaler is None and build_precision("fp32").scaler is None


def test_precisions_compute_in_the_promised_dtype():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for name, dtype in [("fp32", torch.float32), ("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)]:
        with build_precision(name).forward_context():
            assert layer(x).dtype == dtype, name
    true_bf16 = build_precision("bf16-true")
    module = true_bf16.convert_module(torch.nn.Linear(4, 4))
    assert module.weight.dtype == torch.bfloat16
    assert true_bf16.convert_input((x, torch.tensor([1])))[0].dtype == torch.bfloat16
    assert true_bf16.convert_input((x, torch.tensor([1])))[1].dtype == torch.int64  # labels untouched
