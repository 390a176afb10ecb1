"""Token shards on real processes: a job stopped mid-epoch on 2 processes resumes on 4, stops
again mid-epoch, resumes on 2, and a per-window log shows every window read exactly once per
epoch, each global batch split into contiguous parts in rank order.

The reader needs no collectives; what is under test is that the split and the state come from
the real runtime (``data_parallel_size``/``data_index`` default to the process group) and that
a state saved by one world size drives another. Three launches pay process start-up three times.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from trainmesh.data.shard_writer import write_token_shards
from trainmesh.data.shards import TokenShardDataset
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

BLOCK, GLOBAL_BATCH, SEED = 8, 8, 11


def _run_phase(shard_dir: str, state_path: str | None, steps: int, save_path: str) -> list[dict]:
    """Read ``steps`` global batches (crossing epochs if needed); log each; rank 0 saves the state."""
    import trainmesh as tm

    ds = TokenShardDataset(shard_dir, block_size=BLOCK, seed=SEED)  # split from the process group
    if state_path is not None:
        with open(state_path) as fh:
            ds.load_state_dict(json.load(fh))
    log = []
    batches = ds.iter_batches(GLOBAL_BATCH)
    while len(log) < steps:
        epoch, cursor = ds.epoch, ds.cursor
        batch = next(batches, None)
        if batch is None:  # epoch finished: the next call starts the next one
            batches = ds.iter_batches()
            continue
        x, y = batch
        assert x.shape == y.shape == (GLOBAL_BATCH // tm.world_size(), BLOCK)
        assert (x[:, 1:] == y[:, :-1]).all()
        # Token value == position in the corpus, so a window's first token names it.
        log.append({"epoch": epoch, "cursor": cursor, "rank": tm.rank(), "windows": x[:, 0].tolist()})
    if tm.rank() == 0:
        with open(save_path, "w") as fh:
            json.dump(ds.state_dict(), fh)
    return log


def test_resume_2_to_4_to_2_exactly_once(tmp_path):
    shard_dir = str(tmp_path / "shards")
    # 4 shards of 97 tokens (12 windows each) and one of 65 (8 windows): 56 windows, 7 global
    # batches, no remainder, so exactly-once holds on 2 and 4 processes alike.
    write_token_shards([np.arange(4 * 97 + 8 * 8 + 1)], shard_dir, vocab_size=1 << 12, shard_tokens=97)
    reference = TokenShardDataset(shard_dir, block_size=BLOCK, seed=SEED, data_parallel_size=1, data_index=0)
    assert len(reference) == 56
    first_token = np.array([reference.window(i)[0] for i in range(len(reference))])
    per_epoch = len(reference) // GLOBAL_BATCH

    states = [str(tmp_path / f"state{i}.json") for i in range(3)]
    logs = run_distributed(_run_phase, world_size=2, args=(shard_dir, None, 3, states[0]))
    logs += run_distributed(_run_phase, world_size=4, args=(shard_dir, states[0], per_epoch - 3 + 2, states[1]))
    with open(states[1]) as fh:
        mid = json.load(fh)
    assert (mid["epoch"], mid["cursor"]) == (1, 2 * GLOBAL_BATCH)
    logs += run_distributed(_run_phase, world_size=2, args=(shard_dir, states[1], per_epoch - 2, states[2]))
    with open(states[2]) as fh:
        end = json.load(fh)
    assert (end["epoch"], end["cursor"]) == (1, per_epoch * GLOBAL_BATCH)  # rolls over on the next read

    entries = [entry for rank_log in logs for entry in rank_log]
    for epoch in (0, 1):
        seen = sorted(w for e in entries if e["epoch"] == epoch for w in e["windows"])
        assert seen == sorted(first_token.tolist()), f"epoch {epoch}: not every window exactly once"
        order = first_token[reference.global_order(epoch)]
        for cursor in range(0, per_epoch * GLOBAL_BATCH, GLOBAL_BATCH):
            parts = sorted((e["rank"], e["windows"]) for e in entries if (e["epoch"], e["cursor"]) == (epoch, cursor))
            batch = [w for _, windows in parts for w in windows]
            assert batch == order[cursor : cursor + GLOBAL_BATCH].tolist(), (epoch, cursor)
    assert not os.path.exists(str(tmp_path / "shards" / "index.json.tmp"))
