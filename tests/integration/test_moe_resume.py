"""Expert parallelism (issue 43): a real SIGKILL mid-epoch under EP 2, then a bit-identical resume.

One `trainmesh run -n 2 --max-restarts 1` launch of moe_resume_job.py: rank 1 of an EP 2 tiny
Qwen3-MoE run kills itself after step 3 (of 8, shuffled, saves every 2 steps); torchrun's agent
restarts the job, which resumes from step 2's sharded checkpoint (each process its own experts and
their AdamW state) and ends with every model and optimizer tensor ``torch.equal`` to an uninterrupted
EP 2 run of the same processes. (Resharding between EP sizes, 2 -> 1 and 2 -> 4, is checked against one
process in tests/multiprocess/test_expert_parallel.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "moe_resume_job.py")
KILL_AT = 3


def resume_points(root: str) -> dict[str, set[int]]:
    points: dict[str, set[int]] = {}
    for name in os.listdir(root):
        if name.startswith("samples.rank"):
            with open(os.path.join(root, name)) as fh:
                for parts in (line.split() for line in fh):
                    if parts and parts[0] == "RESUME":
                        points.setdefault(parts[1], set()).add(int(parts[2]))
    return points


@pytest.mark.timeout(300)
def test_ep2_run_killed_mid_epoch_resumes_bit_identically(tmp_path):
    cmd = [sys.executable, "-m", "trainmesh", "run", "-n", "2", "--max-restarts", "1", "--monitor-interval", "0.2"]
    cmd += [JOB, "--out", str(tmp_path), "--kill-at", str(KILL_AT)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(TRAINMESH_TIMEOUT_S="30", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(tmp_path / "result.json") as fh:
        result = json.load(fh)
    # attempt 0 started at 0 and was killed after step 3; attempt 1 resumed from step 2's checkpoint
    assert resume_points(str(tmp_path)) == {"0": {0}, "1": {2}}
    assert result["attempt"] == 1
    experts = [k for k in result["keys"] if ".mlp.experts." in k]  # the experts' weights and AdamW moments compared
    assert any(k.startswith("model/") for k in experts) and any(k.startswith("optimizer/") for k in experts)
    assert result["mismatched"] == [], result["mismatched"][:10]
