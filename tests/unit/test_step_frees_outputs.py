"""The Trainer's step does not hold the model's outputs (a language model's logits: tokens x vocabulary)
through backward unless a metric reads them afterwards (``trainer/step.py``)."""

import weakref

import pytest
import torch

from trainmesh.trainer.loss_tracking import LossAccumulator
from trainmesh.trainer.precision import build_precision
from trainmesh.trainer.step import forward_backward

pytestmark = pytest.mark.timeout(60)


def _alive_during_backward(on_outputs) -> list[bool]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    refs, alive = [], []
    model.register_forward_hook(lambda module, args, out: refs.append(weakref.ref(out)))
    model.weight.register_hook(lambda grad: alive.append(refs[-1]() is not None))

    def loss_fn(out, y):  # saves y for backward, not the output (its gradient is y)
        return (out * y).sum()

    micro = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]
    forward_backward(model, micro, loss_fn, build_precision("fp32", "cpu"), LossAccumulator(), on_outputs)
    return alive


def test_outputs_are_freed_before_backward_without_metrics():
    assert _alive_during_backward(None) == [False, False]


def test_outputs_stay_for_the_metrics_that_read_them_after_backward():
    seen = []
    assert _alive_during_backward(lambda out, y: seen.append(out.shape)) == [True, True]
    assert seen == [torch.Size([3, 2])] * 2
