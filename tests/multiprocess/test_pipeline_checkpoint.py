"""A checkpoint written under pipe 2 x data 2 x model 2 resumes under data=4 and under one process.

The 3-D run (8 processes) crashes, on every process at once, after step 3 of the first epoch; its
last checkpoint is step 2 (parameters sharded over model and data axes, split over stages, SGD
momentum buffers too). Resumed on 4 data-parallel processes and on 1 process, each finishes both
epochs and must equal an uninterrupted single-process run within 1e-5: it could not if a sample
were seen twice or skipped, or if the momentum were lost (measured: ~1e-8).
"""

from __future__ import annotations

import pytest

from trainmesh.testing import run_distributed

from pipeline_cases import merge, train_with_checkpoints

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_3d_checkpoint_resumes_under_data_parallel_and_one_process(tmp_path):
    straight = run_distributed(
        train_with_checkpoints, world_size=1, args=("dp", str(tmp_path / "straight")), kwargs=dict(resume=False)
    )[0]
    crashed = run_distributed(
        train_with_checkpoints,
        world_size=8,
        args=("3d", str(tmp_path / "ckpt")),
        kwargs=dict(resume=False, crash_at_step=3),
        timeout=400,
    )
    assert {r["global_step"] for r in crashed} == {2}  # it died in step 3, after saving step 2
    for world in (4, 1):
        directory = tmp_path / f"ckpt{world}"
        import shutil

        shutil.copytree(tmp_path / "ckpt", directory)
        resumed = run_distributed(
            train_with_checkpoints, world_size=world, args=("dp", str(directory)), kwargs=dict(resume=True), timeout=300
        )
        assert resumed[0]["first_step"] == 3, "the resumed run must start after the checkpoint's step"
        assert resumed[0]["global_step"] == straight["global_step"] == 8
        got = merge(resumed)
        worst = max((got[name] - value).abs().max().item() for name, value in straight["params"].items())
        assert worst <= 1e-5, f"resumed on {world} process(es): parameters differ by {worst:.3g}"
