"""``tm.save_pretrained`` from every layout, and ``trainmesh export``, read back by transformers.

One launch of 2 gloo processes saves transformers GPT-2 (tied head) and Llama from DataParallel,
ZeRO-3, ModelParallel with ``LayoutMap.auto`` on a (1, 2) mesh and a 2-stage pipeline, with shards
small enough for several files (both processes write); injects a writer failure and a failure
mid-commit; and trains GPT-2 under ZeRO-3 with a ``ShardedCheckpoint``. The test process then
loads every folder with ``AutoModelForCausalLM.from_pretrained``: parameters must equal the
model's exactly (a copy of bytes, no arithmetic), every weight file must be byte for byte the one
transformers' own ``save_pretrained`` writes, and a failed save must never load.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainmesh.testing import run_distributed

from pipeline_cases import GLOBAL_BATCH, build_model, data, lm_loss, make_optimizer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]
transformers = pytest.importorskip("transformers")

FAMILIES = ("gpt2", "llama")
LAYOUTS = ("dp", "zero3", "tp", "pipe")
SMALL = 3000  # bytes: several files for these tiny models


def _distribute(model, layout: str):
    import trainmesh as tm

    if layout == "dp":
        return tm.DataParallel().distribute_model(model)
    if layout == "zero3":
        return tm.DataParallel(zero_stage=3).distribute_model(model)
    if layout == "tp":
        mesh = tm.DeviceMesh((1, 2), ["data", "model"], devices=tm.list_devices())
        layout_map = tm.LayoutMap.auto(model, mesh, verbose=False)
        return tm.ModelParallel(layout_map=layout_map, batch_dim_name="data").distribute_model(model)
    mesh = tm.DeviceMesh((2, 1), ["pipe", "data"], devices=tm.list_devices())
    return tm.DataParallel(device_mesh=mesh, pipeline=tm.Pipeline(axis="pipe", microbatches=2)).distribute_model(model)


def _error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _save_everything(root: str) -> dict:
    import trainmesh as tm
    from trainmesh.checkpoint import hf_layout, hf_save_transfer

    out: dict = {}
    for family in FAMILIES:
        for layout in LAYOUTS:
            model = _distribute(build_model(family, n_layer=2), layout)
            path = os.path.join(root, f"{family}-{layout}")
            tm.save_pretrained(model, path, max_shard_size="5GB" if layout == "dp" else SMALL)
            out[family, layout] = sorted(os.listdir(path))

    # A writer fails on its second tensor (rank 1 writes every other file): into a new folder, and over
    # the complete GPT-2 folder saved above, which must stay as it was.
    model = _distribute(build_model("gpt2", n_layer=2), "zero3")
    original, calls = hf_save_transfer._write_tensor, [0]

    def failing_writer(writer, entry, tensor):
        calls[0] += 1
        if tm.rank() == 1 and calls[0] == 2:
            raise OSError("No space left on device (injected)")
        return original(writer, entry, tensor)

    hf_save_transfer._write_tensor = failing_writer
    try:
        for name in ("crash-new", "gpt2-dp"):
            calls[0] = 0
            out["crash", name] = _error_of(
                lambda: tm.save_pretrained(model, os.path.join(root, name), max_shard_size=SMALL)
            )
    finally:
        hf_save_transfer._write_tensor = original

    # Dying mid-commit, just before the new index goes in: the old checkpoint is gone, the new one is not in.
    path = os.path.join(root, "crash-commit")
    tm.save_pretrained(model, path, max_shard_size=SMALL)
    publish = hf_layout.publish

    def failing_publish(staging, directory, name):
        if name == hf_layout.INDEX_NAME:
            raise OSError("killed (injected)")
        publish(staging, directory, name)

    hf_layout.publish = failing_publish
    try:
        out["crash", "crash-commit"] = _error_of(lambda: tm.save_pretrained(model, path, max_shard_size=SMALL))
    finally:
        hf_layout.publish = publish

    # A Trainer checkpoint for `trainmesh export`, and the trained weights to compare it with.
    trainer = tm.Trainer(
        build_model("gpt2", n_layer=2),
        make_optimizer,
        lm_loss,
        distribution=tm.DataParallel(),
        zero_stage=3,
        progress=False,
        callbacks=[tm.ShardedCheckpoint(os.path.join(root, "ckpt"), async_save=False)],
    )
    trainer.fit(data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False)
    tm.save_pretrained(trainer.model, os.path.join(root, "trained"))
    state = trainer.state_dict()["model"]
    out["trained"] = {k: v.detach().clone() for k, v in state.items()} if tm.rank() == 0 else None
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    results = run_distributed(_save_everything, world_size=2, args=(str(root),), timeout=360)
    return root, results


def _loaded(path) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: {sorted(got.keys() ^ expected.keys())}"
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{what}: {name} differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_loads_back_exactly(saved, family):
    root, results = saved
    expected = build_model(family, n_layer=2).state_dict()
    for layout in LAYOUTS:
        files = results[0][family, layout]
        if layout == "dp":
            assert "model.safetensors" in files and "model.safetensors.index.json" not in files
        else:
            assert "model.safetensors.index.json" in files and sum(f.startswith("model-") for f in files) >= 3
        assert {"config.json", "generation_config.json"} <= set(files)
        assert not any(f.startswith(".") for f in files), f"{layout}: staging left behind: {files}"
        _assert_same(_loaded(root / f"{family}-{layout}"), expected, f"{family} {layout}")
        # byte for byte what transformers writes (ZeRO-3's and the pipeline's files are written in place)
        reference = root.parent / f"reference-{family}-{layout}"
        if not reference.exists():
            build_model(family, n_layer=2).save_pretrained(reference, max_shard_size="5GB" if layout == "dp" else SMALL)
        for name in (f for f in files if f.endswith(".safetensors")):
            assert (root / f"{family}-{layout}" / name).read_bytes() == (reference / name).read_bytes(), (
                f"{family} {layout}: {name} is not the file transformers writes"
            )
    if family == "gpt2":  # the tied head is written once, under the name transformers keeps
        import json

        weight_map = json.loads((root / "gpt2-tp" / "model.safetensors.index.json").read_text())["weight_map"]
        assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map


def test_failed_save_never_loads_and_keeps_the_previous_one(saved):
    root, results = saved
    for name in ("crash-new", "gpt2-dp", "crash-commit"):
        assert all(r["crash", name] for r in results), f"{name}: every process must raise"
    assert "nothing was published" in results[0]["crash", "crash-new"]
    for name in ("crash-new", "crash-commit"):  # no config (a new folder), or configs but no weights
        with pytest.raises((OSError, ValueError)):
            transformers.AutoModelForCausalLM.from_pretrained(str(root / name))
    # The folder a failed save was writing over still holds the earlier, complete checkpoint.
    _assert_same(_loaded(root / "gpt2-dp"), build_model("gpt2", n_layer=2).state_dict(), "after a failed save")


def test_export_cli_round_trip(saved, tmp_path):
    from trainmesh.launcher import cli

    root, results = saved
    trained = results[0]["trained"]
    out = tmp_path / "exported"
    assert (
        cli.main(["export", str(root / "ckpt"), str(out), "--config", str(root / "gpt2-dp"), "--max-shard-size", "4KB"])
        == 0
    )
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    exported = _loaded(out)
    _assert_same(exported, trained, "export")
    _assert_same(_loaded(root / "trained"), trained, "save_pretrained after training")
    assert not torch.equal(
        trained["transformer.h.0.mlp.c_fc.weight"],
        build_model("gpt2", n_layer=2).state_dict()["transformer.h.0.mlp.c_fc.weight"],
    )
    with pytest.raises(SystemExit):  # a folder that is no checkpoint: a usage error naming it
        cli.main(["export", str(tmp_path), str(tmp_path / "x")])


def _save_unstorable(root: str) -> tuple[str, str, bool]:
    """A complex tensor, which safetensors cannot store: the first process plans the save alone and
    must hand its error to the others (who would otherwise wait for a plan), before any folder exists."""
    import trainmesh as tm

    model = torch.nn.Linear(2, 2)
    model.register_buffer("phase", torch.ones(3, dtype=torch.complex64))
    path = os.path.join(root, "unstorable")
    try:
        tm.save_pretrained(model, path)
    except Exception as exc:  # noqa: BLE001  its type and text are the test's
        return type(exc).__name__, str(exc), os.path.exists(path)
    return "", "", os.path.exists(path)


@pytest.mark.timeout(120)
def test_a_plan_error_reaches_every_process(tmp_path):
    results = run_distributed(_save_unstorable, world_size=2, args=(str(tmp_path),), timeout=100)
    for kind, message, exists in results:
        assert kind == "ValueError" and "cannot store 'phase'" in message, (kind, message)
        assert not exists
