"""``trainmesh demo --quick`` end to end: a real 2-process torchrun job through the CLI.

One run (module-scoped) is shared by the assertions: the outputs exist and are usable (the
checkpoint loads into a fresh model that samples the same text), and the output names them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch

from trainmesh.demo import CharGPT, CharVocab, GPTConfig, build_corpus, generate

pytestmark = pytest.mark.timeout(180)

# Job variables an outer launcher may have left behind would change what the workers detect.
_JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "OMP_NUM_THREADS",
)
_JOB_PREFIXES = ("TRAINMESH_", "SLURM_", "TORCHELASTIC_")


def unigram_loss(train_text: str, heldout_text: str) -> float:
    """Held-out cross-entropy (nats/char) of the training text's character frequencies (add-one smoothed)."""
    counts = Counter(train_text)
    total, kinds = sum(counts.values()), len(counts) + 1
    return -sum(math.log((counts.get(ch, 0) + 1) / (total + kinds)) for ch in heldout_text) / len(heldout_text)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _JOB_VARS and not k.startswith(_JOB_PREFIXES)}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    cwd = tmp_path_factory.mktemp("demo")
    env = {**clean_env(), "TRAINMESH_CACHE_DIR": str(cwd / "cache")}  # no cached peak: the demo probes it
    proc = subprocess.run(
        [sys.executable, "-m", "trainmesh", "demo", "--quick", "-n", "2", "--out", "out"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    return proc, cwd / "out"


def test_quick_demo_succeeds_and_reports(quick_run) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    # The launcher picks one precision for every worker (bf16-mixed only where bf16 matmuls are fast here)
    chosen = re.search(r"^\[demo\] precision (fp32|bf16-mixed): ", stdout, re.M)
    assert chosen, stdout[:2000]
    precision = chosen.group(1)
    assert "data-parallel 2" in stdout and f"precision {precision}" in stdout  # the Trainer's plan line
    assert "Epoch 1/2" in stdout and "Epoch 2/2" in stdout and "val_loss:" in stdout  # progress, held-out loss
    assert f"[demo] outputs in {out.resolve()}" in stdout
    sample = (out / "sample.txt").read_text(encoding="utf-8").rstrip("\n")
    assert sample.startswith("def ") and len(sample) > len("def ")
    assert sample in stdout
    assert "[demo] finished in" in stdout
    assert "Traceback" not in proc.stderr
    # MFU out of the box: the peak was probed (and cached) before the workers started, and shown.
    dtype = "bf16" if precision == "bf16-mixed" else "fp32"  # the peak of the dtype the run computes in
    assert f"[demo] {dtype} matmul peak of this node:" in stdout and " - mfu: " in stdout
    cached = json.loads((out.parent / "cache" / "peak_flops.json").read_text())
    assert len(cached) == 1 and next(iter(cached.values())) > 1e6
    steps = [json.loads(line) for line in (out / "logs" / "steps.jsonl").read_text().splitlines() if line]
    assert all(0 < s["mfu"] < 1 for s in steps)


def test_quick_demo_writes_its_outputs(quick_run) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in (
        "checkpoints/last.pt",
        "checkpoints/best.pt",
        "logs/steps.jsonl",
        "logs/epochs.jsonl",
        "loss_curve.png",
        "demo.json",
        "sample.txt",
    ):
        assert (out / name).is_file(), name
    png = (out / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"Matplotlib version" in png[:200]  # drawn by matplotlib
    epochs = [json.loads(line) for line in (out / "logs" / "epochs.jsonl").read_text().splitlines() if line]
    assert [e["epoch"] for e in epochs] == [0, 1]
    meta = json.loads((out / "demo.json").read_text())
    assert meta["plot"] == "matplotlib"
    assert meta["processes"] == 2 and meta["heldout_loss"] == [e["val_loss"] for e in epochs]
    # Trained: well below a uniform guess over the vocabulary (log 81 = 4.39 nats; the run reaches
    # ~3.0), and below the best model that knows only character frequencies (the training text's
    # unigram distribution, ~3.5 nats on the held-out text): it learned from context.
    settings = meta["settings"]
    corpus = build_corpus(settings["char_budget"], max_file_chars=settings["max_file_chars"])
    assert corpus.vocab.chars == meta["vocab_chars"]
    final = meta["heldout_loss"][-1]
    assert all(math.isfinite(v) for v in meta["heldout_loss"])
    assert final < math.log(len(meta["vocab_chars"]) + 1) - 1.0, meta["heldout_loss"]
    assert final < unigram_loss(corpus.train_text, corpus.heldout_text) - 0.25, meta["heldout_loss"]
    # No machine paths in the file: neither where the run happened nor where the stdlib lives.
    text = (out / "demo.json").read_text()
    assert str(out.parent.resolve()) not in text and sysconfig.get_paths()["stdlib"] not in text


def test_checkpoint_reloads_and_samples_the_same_text(quick_run) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "demo.json").read_text())
    model = CharGPT(GPTConfig(**meta["model_config"]))
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    settings = meta["settings"]
    text = generate(
        model,
        CharVocab(meta["vocab_chars"]),
        settings["prompt"],
        settings["sample_chars"],
        temperature=settings["temperature"],
        top_k=settings["top_k"],
        seed=settings["seed"],
    )
    # sample.txt is the sample plus one newline.
    assert text + "\n" == (out / "sample.txt").read_text(encoding="utf-8")
