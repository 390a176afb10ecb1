"""benchmarks/finetune.py --quick end to end (4 gloo processes, about a minute): it writes the figures issue 37
fixes, under those exact names; both sides did the same work; the layouts train the adapters as one process
does; and the gradient bytes counted at the communication layer are the adapters' only (frozen weights are not
reduced). Step times and memory are not judged here: a smoke-size model on a shared machine says nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]
pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "finetune.py")
FIGURES = (
    "lora_grad_bytes_vs_full",
    "lora_peak_vs_full_ft",
    "lora_step_vs_full_ft",
    "lora_step_vs_peft_ddp",
    "lora_parity_max_abs_diff",
)


def test_quick_finetune_run(tmp_path):
    out = tmp_path / "finetune.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--sides", "tm-full,tm-lora,peft-ddp", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert set(FIGURES) <= set(figures), figures
    assert report["same_work"] and report["valid"], report["first_losses"]
    assert figures["lora_parity_max_abs_diff"] <= 1e-5, report["parity"]
    # ZeRO-3 reduce-scatters the trainable parameters only: the ratio is the trainable fraction, fp32 both sides
    trainable = report["counts"]["trainable"] / report["counts"]["params"]
    assert figures["lora_grad_bytes_vs_full"] == pytest.approx(trainable, rel=0.1), (figures, trainable)
    assert report["memory"]["tm-lora"]["grad_bytes"] > 0
    assert all(value > 0 for name, value in figures.items() if name != "lora_parity_max_abs_diff")
