"""Sync means synchronous (ps/sync_rounds.py): N workers under ``mode="sync"`` with momentum,
Adam and AdamW on the servers take exactly the steps of one process on the global batch, for
dense parameters and for embedding rows, at 2 and 4 workers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainmesh as tm
from trainmesh.ps import PSEmbedding
from trainmesh.ps.optimizers import make_optimizer
from trainmesh.ps.worker_optimizer import server_optimizer_spec
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist]

ROWS, DIM, GLOBAL_BATCH, STEPS, TOLERANCE = 600, 4, 16, 6, 1e-5
OPTIMIZERS = {
    "momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.02, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1),
}


class Model(nn.Module):
    def __init__(self, table: nn.Module):
        super().__init__()
        self.emb = table
        torch.manual_seed(5)
        self.head = nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every global batch touches 24 rows spread over the table's ranges (so over both servers),
    each at least twice, split over the workers differently at every step."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randperm(ROWS, generator=gen)[:24]
    batches = []
    for _ in range(STEPS):
        ids = rows.repeat(2)[torch.randperm(48, generator=gen)].reshape(GLOBAL_BATCH, 3)
        batches.append((ids, torch.randn(GLOBAL_BATCH, 1, generator=gen)))
    return batches


def _reference(kind: str, batches) -> tuple[nn.Module, torch.Tensor]:
    """One process, full global batches: torch's own optimizer for the dense parameters, and for
    the table (a local one starting like the servers', ``init_std=0``: zeros) the servers' row
    update (lazy, like ``torch.optim.SparseAdam``: only touched rows and their state move)."""
    table = nn.Embedding(ROWS, DIM)
    nn.init.zeros_(table.weight)
    model = Model(table)
    optimizer = OPTIMIZERS[kind](model.head.parameters())
    rows = make_optimizer(server_optimizer_spec(optimizer, optimizer.param_groups[0]))
    state = rows.init_state(table.weight.detach())
    for ids, target in batches:
        optimizer.zero_grad()
        table.zero_grad()
        nn.functional.mse_loss(model(ids), target).backward()
        optimizer.step()
        touched = torch.unique(ids)
        with torch.no_grad():
            rows.step_rows(table.weight, touched, table.weight.grad[touched], state)
    return model, table.weight.detach()


def sync_worker(kinds: list[str]) -> dict:
    torch.set_num_threads(1)
    batches = _batches()
    out = {}
    for kind in kinds:
        strategy = tm.ParameterServerStrategy(num_servers=2, mode="sync", client_options={"rows_per_shard": 64})
        with strategy.scope():
            model = Model(PSEmbedding(ROWS, DIM, name="emb.item", init_std=0.0))
        model, optimizer = strategy.prepare(model, OPTIMIZERS[kind](model.parameters()))
        for ids, target in strategy.experimental_distribute_dataset(batches):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(ids), target).backward()
            optimizer.step()
        reference, ref_table = _reference(kind, batches)
        touched = torch.unique(torch.stack([ids for ids, _ in batches]))
        served = strategy.client.pull_rows("emb.item", touched).result(60)
        stats = strategy.stats()
        out[kind] = {
            "dense": max(
                float((p.detach() - q.detach()).abs().max())
                for p, q in zip(model.head.parameters(), reference.head.parameters())
            ),
            "rows": float((served - ref_table[touched]).abs().max()),
            "moved": float(ref_table[touched].abs().max()),
            "rounds": sum(s["rounds_applied"] for s in stats["servers"]),
        }
        strategy.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 4])
def test_sync_momentum_adam_and_adamw_equal_one_process_on_the_global_batch(workers):
    kinds = list(OPTIMIZERS) if workers == 2 else ["adam", "adamw"]  # (4 workers: the stateful pair, for time)
    results = run_distributed(sync_worker, workers, args=(kinds,), timeout=280)
    for result in results:
        for kind in kinds:
            got = result[kind]
            assert got["moved"] > 1e-3, (kind, got)  # the rows really trained
            assert got["dense"] <= TOLERANCE and got["rows"] <= TOLERANCE, (kind, workers, got)
            assert STEPS <= got["rounds"] <= 2 * STEPS, (kind, got)  # one update per round (per server pushed to)
