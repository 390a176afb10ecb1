"""Mid-epoch save on N real processes, resume on M: every sample of the epoch consumed exactly once.

Each rank runs tm.data.DataLoader over its GlobalBatchSampler (with workers and read-ahead,
so the state must not count what was read but not consumed), appends every sample it consumes
to a per-rank log, and rank 0 saves the loader state mid-epoch. The second launch, on another
world size, loads that state and finishes the epoch (and one more), logging again.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

N, GLOBAL_BATCH, STOP_AFTER = 160, 16, 4  # 10 steps per epoch; the first launch stops after 4


class Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i)


def _run(log_dir: str, phase: str, stop_after: int | None, epochs: int):
    import torch.distributed as dist

    import trainmesh as tm
    from trainmesh.data import DataLoader, GlobalBatchSampler

    rank, world = tm.rank(), tm.world_size()
    sampler = GlobalBatchSampler(N, global_batch_size=GLOBAL_BATCH, seed=123, micro_batches=2)  # ranks from the job
    state_path = os.path.join(log_dir, "state.json")
    with DataLoader(Indexed(), sampler, num_workers=1, prefetch=3) as loader:
        if os.path.exists(state_path):
            with open(state_path) as fh:
                loader.load_state_dict(json.load(fh))
        start_epoch = sampler.epoch
        with open(os.path.join(log_dir, f"{phase}-rank{rank}.log"), "a") as log:
            for epoch in range(start_epoch, start_epoch + epochs):
                loader.set_epoch(epoch)
                for step, micro in enumerate(loader):
                    for part in micro:
                        log.write("".join(f"{epoch} {int(i)}\n" for i in part))
                    if stop_after is not None and step + 1 == stop_after:
                        break
                if stop_after is not None:
                    break
        dist.barrier()  # every rank consumed the same steps before the state is final
        if rank == 0 and stop_after is not None:
            with open(state_path, "w") as fh:
                json.dump(loader.state_dict(), fh)
        return loader.state_dict(), world


def _seen(log_dir):
    seen: dict[int, list[int]] = {}
    for name in os.listdir(log_dir):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name)) as fh:
                for line in fh:
                    epoch, index = map(int, line.split())
                    seen.setdefault(epoch, []).append(index)
    return seen


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)])
def test_resume_on_another_world_size_is_exactly_once(tmp_path, before, after):
    first = run_distributed(_run, world_size=before, args=(str(tmp_path), "a", STOP_AFTER, 1))
    assert all(state["cursor"] == STOP_AFTER * GLOBAL_BATCH and state["epoch"] == 0 for state, _ in first)
    second = run_distributed(_run, world_size=after, args=(str(tmp_path), "b", None, 2))
    assert all(state["epoch"] == 2 and state["cursor"] == 0 for state, _ in second)
    seen = _seen(str(tmp_path))
    assert sorted(seen) == [0, 1]
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(N)), (
            f"epoch {epoch}: {len(indices)} consumed, {len(set(indices))} distinct"
        )
