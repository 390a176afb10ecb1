"""A sequence axis beside a pipeline axis: pipe 2 x seq 2 on 4 processes, an unmodified transformers Llama
(built from a config, fp32) trained by ``tm.Trainer``, against a plain one-process loop on the same global
batches.

Each stage is a pruned copy of the model (``pipeline_split``) that keeps the model's own forward, so the
context-parallel pre-hook splits attention over the stage's seq group on every stage: the batch is split
along the sequence before the first stage (head-tail chunks, global ``position_ids``, labels shifted before
the split), the stages pass the chunk's activations, and the last stage's loss is weighted to the global
token mean. One launch: ring and Ulysses under GPipe and 1F1B (one block a stage), ring under interleaved
1F1B (two stages a process), and ``evaluate`` after fit (whole sequences through the stages).

Tolerance: 1e-6 absolute on the mean loss, on the last step's gradients and on the parameters after 3 AdamW
steps at lr 1e-3 (``cp_cases.make_optimizer``; measured in the report of the commit that added this file).
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from cp_cases import GLOBAL_BATCH, SEQ, build_model, data, lm_loss, make_optimizer, max_diff, reference

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-6
CASES = [  # (name, schedule, method, layers)
    ("gpipe ring", "gpipe", "ring", 2),
    ("gpipe ulysses", "gpipe", "ulysses", 2),
    ("1f1b ring", "1f1b", "ring", 2),
    ("1f1b ulysses", "1f1b", "ulysses", 2),
    ("interleaved_1f1b ring", "interleaved_1f1b", "ring", 4),
    # the last quarter of every row's labels ignored (-100): the two chunks of a sequence hold 8 and 16 of its
    # tokens, so only the global token mean (not the mean of the processes' means) gives one process's loss
    ("1f1b ulysses masked labels", "1f1b", "ulysses", 2),
]


def _data(name: str):
    x, y = data()
    if "masked" in name:
        y = y.clone()
        y[:, -y.shape[1] // 4 :] = -100
    return x, y


def _distribution(tm, schedule: str, method: str):
    mesh = tm.DeviceMesh((2, 1, 2), ["pipe", "data", "seq"], devices=tm.list_devices())
    return tm.ModelParallel(
        layout_map=tm.LayoutMap(mesh),
        batch_dim_name="data",
        sequence_dim_name="seq",
        context_parallel=method,
        pipeline=tm.Pipeline(axis="pipe", schedule=schedule, microbatches=2),
    )


class _Recording(torch.optim.AdamW):
    """``make_optimizer``'s AdamW, keeping the gradients each step applies (the Trainer clears them after)."""

    def step(self, closure=None):
        self.last_grads = {id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def _recording_optimizer(params):
    reference_one = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    return _Recording(params, **{k: reference_one.defaults[k] for k in ("lr", "weight_decay", "eps")})


def _run() -> dict:
    import trainmesh as tm

    out = {}
    for name, schedule, method, layers in CASES:
        model = build_model(layers=layers)
        trainer = tm.Trainer(
            model, _recording_optimizer, lm_loss, distribution=_distribution(tm, schedule, method), progress=False
        )
        lengths = set()  # the sequence length each decoder layer sees: half of it, if it is split
        hooks = [
            layer.register_forward_pre_hook(lambda m, a, k: lengths.add(_hidden(a, k).shape[1]), with_kwargs=True)
            for layer in _decoder_layers(trainer.model)
        ]
        history = trainer.fit(_data(name), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
        for hook in hooks:
            hook.remove()
        last = trainer.optimizer.last_grads
        grads = {n: last[id(p)] for n, p in trainer.model.named_parameters() if id(p) in last}
        state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}  # this process's stage(s)
        out[name] = state, history.history["loss"][0], grads, lengths
        if name == "1f1b ring":
            x, y = data(rows=GLOBAL_BATCH)
            out["evaluate"] = trainer.evaluate((x, y), batch_size=GLOBAL_BATCH)["loss"]
    return out


def _decoder_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _hidden(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


@pytest.fixture(scope="module")
def four():
    return run_distributed(_run, world_size=4, timeout=280)


def _reference(name: str, layers: int):
    model = build_model(layers=layers)
    state, losses = reference(model, *_data(name))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}  # the last step's
    return state, losses, grads


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pipe2_x_seq2_matches_one_process(four, case):
    name, _, _, layers = case
    expected, losses, expected_grads = _reference(name, layers)
    loss = four[0][name][1]
    assert abs(loss - sum(losses) / len(losses)) <= TOLERANCE, (loss, losses)
    assert max_diff(expected, build_model(layers=layers).state_dict()) > 1e-3  # the steps moved the weights
    held, held_state = set(), set()
    for rank in range(4):
        state, rank_loss, grads, lengths = four[rank][name]
        assert lengths == {SEQ // 2}, lengths  # every layer saw this process's half of the sequence
        assert rank_loss == loss  # every process reports the global loss
        diff = max_diff(state, {k: expected[k] for k in state})  # this process's stage(s)
        assert diff <= TOLERANCE, f"{name}: rank {rank} parameters differ by {diff:.3g}"
        held_state |= state.keys()
        assert grads, f"{name}: rank {rank} holds no gradients"
        for key, grad in grads.items():
            gdiff = (grad - expected_grads[key]).abs().max().item()
            assert gdiff <= TOLERANCE, f"{name}: rank {rank} gradient of {key} differs by {gdiff:.3g}"
        held |= grads.keys()
    assert held == expected_grads.keys()  # the stages together hold every gradient and parameter
    assert held_state == expected.keys()


def test_evaluate_after_fit_is_one_process(four):
    """``evaluate`` runs whole sequences through the stages (no split): one process's loss for the same weights."""
    model = build_model()
    model.load_state_dict({k: v for rank in range(4) for k, v in four[rank]["1f1b ring"][0].items()})
    x, y = data(rows=GLOBAL_BATCH)
    with torch.no_grad():
        expected = lm_loss(model(x), y).item()
    assert all(abs(four[rank]["evaluate"] - expected) <= TOLERANCE for rank in range(4))
