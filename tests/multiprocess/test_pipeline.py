"""Pipeline parallelism (torch.distributed.pipelining schedules) under ``tm.Trainer``, against one process.

Every configuration trains the same model on the same global batches as a plain single-process
loop (SGD with momentum, fp32, 3 steps) and compares every parameter, each process contributing
the ones its stages hold (names are global). Tolerance: 1e-5 absolute (measured: ~1e-8). One
launch per world size runs many configurations, to pay process start-up once. Each run also checks
``trainer.state_dict()["model"]``: every stage's whole tensors on the main process under the unpiped
names (empty elsewhere), loadable with a strict ``load_state_dict`` into a one-process model and
within 1e-6 of the one-process run's state dict; the optimizer's momentum, every parameter's once
under the one-process names, within 1e-6 too; and ``trainer.load_state_dict`` of that state, after
the weights and momentum were moved, restoring both exactly.

Models: the project's GPT (``CharGPT``, a tied embedding and head, so the tied-gradient exchange
between the first and last stage is exercised) and transformers GPT-2 / Llama built from configs.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed

from pipeline_cases import build_model, data, max_diff, merge, reference, reference_eval, run_configs

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv"]
TOL = 1e-5


def _check(configs, results_per_rank, references):
    worst = 0.0
    for index, config in enumerate(configs):
        got = merge([rank_results[index] for rank_results in results_per_rank])
        key = (config["family"], config.get("n_layer", 4), config.get("max_grad_norm"))
        expected = references[key]["params"]
        assert got.keys() == expected.keys(), f"{config}: the stages together must hold every parameter"
        diff = max_diff(expected, got)
        worst = max(worst, diff)
        tol = config.get("tol") or TOL
        assert diff <= tol, f"{config}: parameters differ from one process by {diff:.3g}"
        if config.get("state"):
            _check_state(config, [rank_results[index] for rank_results in results_per_rank], got, references[key])
        mean_loss = sum(references[key]["losses"]) / len(references[key]["losses"])
        # on CPU every step after the first (which makes the buffers and records the order of the
        # receives) posts its receives when it starts (pipeline_receives.py), on every stage
        single = config["schedule"] in ("gpipe", "1f1b")
        for rank_results in results_per_rank:  # the loss exists on the last stage; every rank reports it
            run = rank_results[index]
            assert abs(run["loss"] - mean_loss) <= max(tol, 1e-5), config
            assert run["steps_posted_ahead"] == [run["steps"] - 1] * (1 if single else 2), (
                config,
                run["steps_posted_ahead"],
            )
            if config.get("zero_stage", 0) >= 2:  # once per FSDP unit and step, not once per microbatch
                run = rank_results[index]
                assert run["fsdp_groups"] > 0 and run["reduce_scatters"] == run["steps"] * run["fsdp_groups"], (
                    f"{config}: {run['reduce_scatters']} reduce-scatters in {run['steps']} steps of {run['fsdp_groups']} units"
                )
    return worst


def _check_state(config, runs, got, reference):
    """``trainer.state_dict()["model"]``: on the main process every stage's whole tensors under the
    unpiped names, exactly what the stages hold, loadable (strict) into a one-process model and equal
    to the one-process run's state dict; on every other process empty."""
    state = runs[0]["state"]
    assert all(run["state"] == {} for run in runs[1:]), f"{config}: only the main process holds the state"
    assert state.keys() == reference["state"].keys(), f"{config}: {sorted(set(reference['state']) ^ set(state))}"
    for name, value in got.items():  # the gather moves the stages' values unchanged
        assert torch.equal(state[name], value), f"{config}: {name} in state_dict differs from its stage's"
    build_model(config["family"], config.get("n_layer", 4)).load_state_dict(state)  # strict
    tol = config.get("tol") or 1e-6
    for name, value in reference["state"].items():
        assert torch.allclose(state[name], value, rtol=0, atol=tol), f"{config}: {name} differs from one process"
    # the optimizer's: every parameter's momentum once, under the one-process names (a tied head's
    # under the embedding's), as the one-process run's
    optimizer = runs[0]["optimizer_state"]
    assert optimizer["state"].keys() == reference["momentum"].keys(), (
        config,
        sorted(set(optimizer["state"]) ^ set(reference["momentum"])),
    )
    assert [p for g in optimizer["param_groups"] for p in g["params"]] == list(reference["momentum"]), config
    for name, value in reference["momentum"].items():
        momentum = optimizer["state"][name]["momentum_buffer"]
        assert torch.allclose(momentum, value, rtol=0, atol=tol), f"{config}: {name}'s momentum differs"
    # loaded back after the weights and momentum moved: the stages hold the saved values again
    assert all(run["reloaded_state"] == {} for run in runs[1:]), config
    assert merge([{"params": run["reloaded_params"]} for run in runs]).keys() == got.keys()
    for name, value in merge([{"params": run["reloaded_params"]} for run in runs]).items():
        assert torch.equal(value, got[name]), f"{config}: {name} not restored by load_state_dict"
    for name, value in state.items():
        assert torch.equal(runs[0]["reloaded_state"][name], value), f"{config}: {name} not restored"
    for name, entry in optimizer["state"].items():
        again = runs[0]["reloaded_optimizer_state"]["state"][name]["momentum_buffer"]
        assert torch.equal(again, entry["momentum_buffer"]), f"{config}: {name}'s momentum not restored"


def _references(configs):
    refs = {}
    for config in configs:
        key = (config["family"], config.get("n_layer", 4), config.get("max_grad_norm"))
        if key not in refs:
            refs[key] = reference(config["family"], key[1], max_grad_norm=key[2])
    moved = max(
        (refs[key]["params"][name] - value).abs().max().item()
        for key in refs
        for name, value in build_model(key[0], key[1]).named_parameters()
    )
    assert moved > 1e-3, "the reference must move the weights, or a run that did nothing would pass"
    return refs


def test_every_schedule_on_two_stages_matches_one_process():
    configs = [dict(family="gpt", mesh_shape=(2, 1), axes=["pipe", "data"], schedule=s) for s in SCHEDULES]
    # bf16 autocast inside the stages: close to the fp32 run, not equal (bf16 keeps 8 bits of mantissa)
    configs += [
        dict(family="gpt", mesh_shape=(2, 1), axes=["pipe", "data"], schedule="1f1b", precision="bf16-mixed", tol=2e-2)
    ]
    configs += [
        dict(family="gpt2", mesh_shape=(2, 1), axes=["pipe", "data"], schedule="1f1b"),
        dict(family="llama", mesh_shape=(2, 1), axes=["pipe", "data"], schedule="interleaved_1f1b"),
    ]
    configs = [dict(config, state=True) for config in configs]  # and trainer.state_dict()
    results = run_distributed(run_configs, world_size=2, args=(configs,), timeout=500)
    _check(configs, results, _references(configs))


def test_pipe_by_data_with_zero_and_checkpointing_matches_one_process():
    # every schedule on pipe 4 (and on pipe 2 x data 2, pipe 2 x model 2), for the GPT, GPT-2 and
    # Llama, is in test_pipeline_matrix.py
    pytest.importorskip("transformers")
    configs = [
        dict(
            family="gpt", mesh_shape=(2, 2), axes=["pipe", "data"], schedule="1f1b", zero_stage=z, checkpointing=policy
        )
        for z, policy in ((0, "full"), (2, None), (3, "selective"))
    ]
    configs += [
        dict(
            family="gpt2",
            mesh_shape=(2, 2),
            axes=["pipe", "data"],
            schedule="gpipe",
            zero_stage=3,
            checkpointing="full",
        )
    ]
    configs = [dict(config, state=True) for config in configs]  # and trainer.state_dict()
    results = run_distributed(run_configs, world_size=4, args=(configs,), timeout=560)
    _check(configs, results, _references(configs))


def test_3d_pipe_data_model_matches_one_process_with_clipping_metrics_evaluate_and_predict():
    pytest.importorskip("transformers")
    configs = [
        dict(
            family="gpt",
            mesh_shape=(2, 2, 2),
            axes=["pipe", "data", "model"],
            schedule="1f1b",
            zero_stage=0,
            max_grad_norm=0.05,
            evaluate=True,
        ),
        dict(
            family="gpt2",
            mesh_shape=(2, 2, 2),
            axes=["pipe", "data", "model"],
            schedule="interleaved_1f1b",
            zero_stage=2,
            checkpointing="full",
        ),
    ]
    configs = [dict(config, state=True) for config in configs]  # and trainer.state_dict()
    results = run_distributed(run_configs, world_size=8, args=(configs,), timeout=560)
    _check(configs, results, _references(configs))
    # evaluate and predict on the 3-D layout equal the single-process model with the same weights
    expected_loss, expected_logits = reference_eval("gpt", merge([r[0] for r in results]))
    expected_accuracy = (expected_logits.argmax(-1) == data(1)[1]).double().mean().item()
    for rank_results in results:  # exact global metrics: the last stage's counts, reduced over every rank
        assert abs(rank_results[0]["eval_loss"] - expected_loss) <= 1e-5
        assert abs(rank_results[0]["eval_accuracy"] - expected_accuracy) <= 1e-12
        assert torch.allclose(rank_results[0]["predict"], expected_logits, atol=1e-5)
