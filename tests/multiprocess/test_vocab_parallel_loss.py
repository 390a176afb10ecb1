"""Cross-entropy on the head's vocabulary shards (``trainmesh.losses.lm_cross_entropy`` under tensor
parallelism) against one process, on a tiny transformers Llama at model 2, with and without sequence
parallelism. One launch of 2 processes.

Tolerance: 1e-6 absolute on the loss, on every gradient of one forward/backward, and on the parameters
after 3 AdamW steps of ``tm.Trainer`` in fp32 (the tests' ``make_optimizer``: lr 1e-3, where summation
order alone moves parameters by ~1e-7; see ``cp_cases``).
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from cp_cases import GLOBAL_BATCH, VOCAB, build_model, data, lm_loss, make_optimizer, max_diff, reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
pytest.importorskip("transformers")

TOLERANCE = 1e-6


def _targets_with_ignored(y):
    y = y.clone()
    y[0, :5] = -100  # ignored tokens count in neither the sum nor the mean
    y[1, -3:] = -100
    return y


def _saved_bytes(model, x, y, loss_fn, sharded: bool) -> int:
    """Bytes autograd saves for backward in one forward and loss (each storage once, parameters not)."""
    from trainmesh._torch.vocab_parallel import keep_vocab_shards
    from trainmesh.testing.memory import SavedTensorBytes

    with SavedTensorBytes(model) as saved, keep_vocab_shards(model, loss_fn if sharded else None):
        loss = loss_fn(model(x), y)
    del loss
    return saved.bytes


def _job() -> dict:
    import trainmesh as tm
    from trainmesh._torch.vocab_parallel import keep_vocab_shards
    from trainmesh.losses import lm_cross_entropy

    out = {}
    mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
    x, y = data(seq=64, rows=2)
    y = _targets_with_ignored(y)
    for sp in (False, True):
        model = build_model()
        distribution = tm.ModelParallel(
            layout_map=tm.LayoutMap.auto(model, mesh, verbose=False), batch_dim_name="data", sequence_parallel=sp
        )
        seen: list[str] = []

        def recording_loss(outputs, targets):  # what the Trainer's step hands the loss
            seen.append(type(outputs.logits).__name__)
            return lm_cross_entropy(outputs, targets)

        recording_loss.vocab_parallel = True
        trainer = tm.Trainer(model, make_optimizer, recording_loss, distribution=distribution, progress=False)
        case = {}
        # one forward/backward by hand: the loss, every gradient made whole, the logits' local width
        with keep_vocab_shards(trainer.model, lm_cross_entropy):
            outputs = trainer.model(x)
            case["logits"] = (type(outputs.logits).__name__, tuple(outputs.logits.to_local().shape))
            loss = lm_cross_entropy(outputs, y)
        loss.backward()
        case["loss"] = loss.item()
        case["grads"] = {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in trainer.model.named_parameters()
        }
        trainer.model.zero_grad(set_to_none=True)
        # outside the Trainer's step (predict, a user's forward) the logits are whole, plain tensors
        case["plain logits"] = (type(trainer.model(x).logits).__name__, tuple(trainer.model(x).logits.shape))
        case["saved"] = {
            "sharded": _saved_bytes(trainer.model, x, y, lm_cross_entropy, True),
            "whole": _saved_bytes(trainer.model, x, y, lm_loss, False),
        }
        # 3 steps of fit, then evaluate (whole logits, the same function) on the trained weights
        history = trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        case["fit loss"] = history.history["loss"][0]
        case["fit logits"] = seen
        case["state"] = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
        out[sp] = case
    out["evaluate"] = _evaluate_on_chunks(tm, lm_cross_entropy)
    return out


def _evaluate_on_chunks(tm, lm_cross_entropy) -> dict:
    """evaluate over seq 2 with the token-mean loss: the loss on each process's chunks (no gather)."""
    from cp_cases import Padded, padded_data

    mesh = tm.DeviceMesh((2,), ["seq"], devices=tm.list_devices())
    out = {}
    for method in ("ring", "ulysses"):
        for padding in (None, "right"):
            lengths: list[int] = []

            def recording_loss(outputs, targets):  # the logits' length the loss saw
                lengths.append(outputs.logits.shape[1])
                return lm_cross_entropy(outputs, targets)

            recording_loss.token_mean = True
            model = build_model() if padding is None else Padded(build_model())
            distribution = tm.DataParallel(mesh, sequence_dim_name="seq", context_parallel=method)
            trainer = tm.Trainer(model, make_optimizer, recording_loss, distribution=distribution, progress=False)
            batches = data() if padding is None else _padded_batches(padded_data(left=False))
            kwargs = {"batch_size": GLOBAL_BATCH} if padding is None else {}
            loss = trainer.evaluate(batches, **kwargs)["loss"]
            out[method, padding] = (loss, lengths)
    return out


def _padded_batches(padded):
    inputs, targets = padded
    return [
        ({k: v[i : i + GLOBAL_BATCH] for k, v in inputs.items()}, targets[i : i + GLOBAL_BATCH])
        for i in range(0, len(targets), GLOBAL_BATCH)
    ]


@pytest.fixture(scope="module")
def two():
    return run_distributed(_job, world_size=2, timeout=250)


def _one_process_grads(x, y):
    model = build_model()
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_loss_and_gradients_match_one_process(two, sp):
    x, y = data(seq=64, rows=2)
    loss, grads = _one_process_grads(x, _targets_with_ignored(y))
    for rank in (0, 1):
        case = two[rank][sp]
        assert abs(case["loss"] - loss) <= TOLERANCE, (case["loss"], loss)
        diff = max_diff(case["grads"], grads)
        assert diff <= TOLERANCE, f"rank {rank}: gradients differ by {diff:.3g}"
        # the head's output was this process's half of the vocabulary, never the whole logits
        assert case["logits"] == ("DTensor", (2, 64, VOCAB // 2)), case["logits"]
        assert case["plain logits"] == ("Tensor", (2, 64, VOCAB)), case["plain logits"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_trainer_fit_matches_one_process(two, sp):
    expected, losses = reference(build_model(), *data())
    case = two[0][sp]
    assert abs(case["fit loss"] - sum(losses) / len(losses)) <= TOLERANCE
    diff = max_diff(case["state"], expected)
    assert diff <= TOLERANCE, f"parameters differ by {diff:.3g} after 3 steps"
    assert two[1][sp]["fit loss"] == case["fit loss"]
    # each step's loss ran on the vocabulary shards (the first call is the throughput meter's FLOP count,
    # on a one-process meta copy of the model: whole logits)
    assert case["fit logits"][-3:] == ["DTensor"] * 3, case["fit logits"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_the_loss_saves_half_the_logits(two, sp):
    # whole logits: the loss saves its (tokens, vocab) fp32 log-softmax; sharded: a (tokens, vocab / 2) softmax
    saved = two[0][sp]["saved"]
    half_logits = 2 * 64 * VOCAB * 4 // 2
    assert saved["whole"] - saved["sharded"] >= 0.9 * half_logits, saved
    assert saved["whole"] - saved["sharded"] <= 1.1 * half_logits + 2 * 64 * 8, saved


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("padding", [None, "right"], ids=["plain", "right-padded"])
def test_evaluate_over_a_sequence_axis_takes_the_loss_on_chunks(two, method, padding):
    from cp_cases import padded_data

    model = build_model()
    if padding is None:
        x, y = data()
        batches = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]
    else:
        batches = _padded_batches(padded_data(left=False))
    with torch.no_grad():  # one process: each batch's mean over its tokens, batches weighted by rows (all equal)
        losses = [lm_loss(model(**b) if isinstance(b, dict) else model(b), t).item() for b, t in batches]
    for rank in (0, 1):
        loss, lengths = two[rank]["evaluate"][method, padding]
        assert abs(loss - sum(losses) / len(losses)) <= TOLERANCE, (loss, losses)
        # the loss saw this process's half of each sequence: no whole logits were gathered
        assert lengths == [data()[0].shape[1] // 2] * len(batches), lengths
