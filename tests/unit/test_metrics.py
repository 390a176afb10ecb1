"""Metrics as vectors of sums: values, shapes accepted, float64 state, name resolution."""

from __future__ import annotations

import math

import pytest
import torch

from trainmesh.trainer.metrics import Accuracy, Mean, Metric, resolve_metric

pytestmark = pytest.mark.timeout(60)


def test_accuracy_class_ids():
    acc = Accuracy()
    outputs = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    acc.update(outputs, torch.tensor([1, 0, 0, 2]))
    assert acc.compute() == 0.5
    assert acc.state().tolist() == [2.0, 4.0]


def test_accuracy_accepts_class_ids_with_trailing_one_and_whole_floats():
    outputs = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    a, b = Accuracy(), Accuracy()
    a.update(outputs, torch.tensor([[1], [1], [1]]))
    b.update(outputs, torch.tensor([1.0, 1.0, 1.0]))
    assert a.state().tolist() == b.state().tolist() == [2.0, 3.0]


def test_accuracy_one_hot_and_probability_targets():
    outputs = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    one_hot = Accuracy()
    one_hot.update(outputs, torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]))
    probs = Accuracy()
    probs.update(outputs, torch.tensor([[0.4, 0.6], [0.7, 0.3], [0.9, 0.1]]))
    assert one_hot.compute() == pytest.approx(2 / 3)
    assert probs.compute() == pytest.approx(2 / 3)
    assert probs.state().tolist() == [2.0, 3.0]


@pytest.mark.parametrize("targets", [torch.tensor([0, 1, 1, 0]), torch.tensor([[0], [1], [1], [0]])])
def test_binary_accuracy_last_dim_one(targets):
    acc = Accuracy()
    acc.update(torch.tensor([[0.2], [0.7], [0.4], [0.9]]), targets)
    assert acc.state().tolist() == [2.0, 4.0]


def test_binary_accuracy_1d_outputs_and_logit_threshold():
    logits = torch.tensor([-2.0, 0.5, -0.1, 3.0])
    targets = torch.tensor([0.0, 1.0, 1.0, 1.0])
    probs_threshold, logit_threshold = Accuracy(), Accuracy(threshold=0.0)
    probs_threshold.update(logits, targets)
    logit_threshold.update(logits, targets)
    assert probs_threshold.state().tolist() == [2.0, 4.0]  # 0.5 is not > 0.5: predicts 0
    assert logit_threshold.state().tolist() == [3.0, 4.0]


def test_sequence_outputs_count_every_position():
    acc = Accuracy()
    outputs = torch.zeros(2, 3, 4)
    outputs[..., 2] = 1.0  # always predicts class 2
    acc.update(outputs, torch.tensor([[2, 2, 0], [1, 2, 2]]))
    assert acc.state().tolist() == [4.0, 6.0]


def test_accumulation_over_batches_equals_one_batch():
    torch.manual_seed(0)
    outputs, targets = torch.randn(50, 5), torch.randint(0, 5, (50,))
    whole, pieces = Accuracy(), Accuracy()
    whole.update(outputs, targets)
    for chunk_out, chunk_t in zip(outputs.split(7), targets.split(7)):
        pieces.update(chunk_out, chunk_t)
    assert torch.equal(whole.state(), pieces.state())
    assert whole.compute() == pieces.compute()


@pytest.mark.parametrize(
    "outputs, targets, fragment",
    [
        (torch.randn(4, 3), torch.tensor([0, 1, 2]), "targets.shape=(3,)"),
        (torch.randn(4, 3), torch.randn(4, 2), "targets.shape=(4, 2)"),
        (torch.randn(4, 1), torch.tensor([0, 1]), "targets.shape=(2,)"),
        (torch.randn(4, 3), torch.tensor([0.0, 1.5, 2.0, 1.0]), "1.5"),
        (torch.tensor(0.3), torch.tensor(1), "outputs.shape=()"),
    ],
)
def test_accuracy_rejects_bad_shapes_and_values(outputs, targets, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        Accuracy().update(outputs, targets)
    assert fragment in str(info.value)


def test_state_is_a_float64_copy_and_reset_clears_it():
    acc = Accuracy()
    acc.update(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
    state = acc.state()
    assert state.dtype == torch.float64 and state.dim() == 1 and state.device.type == "cpu"
    state.mul_(100)  # an in-place all_reduce on the returned tensor must not touch the metric
    assert acc.state().tolist() == [1.0, 1.0]
    acc.reset()
    assert acc.state().tolist() == [0.0, 0.0]


def test_compute_from_given_state_and_empty_state_is_nan():
    acc = Accuracy()
    assert math.isnan(acc.compute())
    assert acc.compute(torch.tensor([3.0, 4.0], dtype=torch.float32)) == 0.75
    assert math.isnan(Mean().compute(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"Received: state.shape=\(3,\)"):
        acc.compute(torch.zeros(3))


def test_mean_plain_and_weighted():
    m = Mean("loss")
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    assert m.compute() == 2.0
    weighted = Mean("loss")
    weighted.update(torch.tensor(2.0), sample_weight=3)  # batch of 3, mean loss 2
    weighted.update(torch.tensor(4.0), sample_weight=1)
    assert weighted.state().tolist() == [10.0, 4.0]
    assert weighted.compute() == 2.5
    per_sample = Mean()
    per_sample.update(torch.tensor([1.0, 5.0]), sample_weight=torch.tensor([3.0, 1.0]))
    assert per_sample.compute() == 2.0


def test_mean_rejects_weights_that_do_not_broadcast():
    with pytest.raises(ValueError, match=r"Received: sample_weight.shape=\(3,\)"):
        Mean().update(torch.ones(2), sample_weight=torch.ones(3))


def test_counts_beyond_float32_precision_stay_exact():
    # 2**24 + 1 is the first integer float32 cannot hold: a float32 count would lose the 1.
    m = Mean()
    m.update(torch.tensor(1.0), sample_weight=2**24)
    m.update(torch.tensor(1.0), sample_weight=1)
    assert m.state()[1].item() == 2**24 + 1
    acc = Accuracy()
    acc._state += torch.tensor([2.0**24, 2.0**24])
    acc.update(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
    assert acc.state().tolist() == [2**24 + 1, 2**24 + 1]


def test_low_precision_outputs_are_accepted():
    acc = Accuracy()
    acc.update(torch.tensor([[0.1, 0.9], [0.6, 0.4]], dtype=torch.bfloat16), torch.tensor([1, 1]))
    assert acc.state().tolist() == [1.0, 2.0]


def test_resolve_metric():
    assert isinstance(resolve_metric("accuracy"), Accuracy)
    assert resolve_metric("accuracy").name == "accuracy"
    assert resolve_metric("acc").name == "acc"  # Keras: the key in the logs is what was asked for
    assert resolve_metric("acc") is not resolve_metric("acc")
    mine = Mean("my_mean")
    assert resolve_metric(mine) is mine
    assert isinstance(resolve_metric(Accuracy), Accuracy)
    for bad in ("f1", 3, None):
        with pytest.raises(ValueError, match=f"Received: metric={bad!r}"):
            resolve_metric(bad)


def test_custom_metric_subclass():
    class Maximum(Metric):
        def __init__(self):
            super().__init__("max", state_size=1)

        def update(self, outputs, targets=None):
            self._state[0] = max(self._state[0].item(), outputs.max().item())

        def _compute(self, state):
            return float(state[0])

    m = Maximum()
    m.update(torch.tensor([1.0, 7.0]))
    m.update(torch.tensor([3.0]))
    assert m.compute() == 7.0
    with pytest.raises(ValueError, match="Received: name=''"):
        Mean("")


def test_empty_local_batches_add_nothing():
    # A rank whose slice of the last batch is empty still updates (and later all-reduces).
    acc, mean = Accuracy(), Mean()
    acc.update(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    acc.update(torch.zeros(0, 1), torch.zeros(0))
    mean.update(torch.zeros(0))
    assert acc.state().tolist() == [0.0, 0.0] and mean.state().tolist() == [0.0, 0.0]
    acc.update(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([1]))
    assert acc.compute() == 1.0


def test_mean_weight_is_keyword_only():
    # A generic update(outputs, targets) must not silently weight outputs by targets.
    with pytest.raises(TypeError):
        Mean().update(torch.ones(2), torch.tensor([0.0, 5.0]))
