"""PSEmbedding against real parameter-server processes (a 2-server LocalCluster), one worker:
parity with a local ``nn.Embedding`` under SGD, traffic proportional to the touched rows,
micro-batch accumulation, eval mode, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import LocalCluster
from trainmesh.ps.embedding import PSEmbedding

pytestmark = [pytest.mark.timeout(90)]

ROWS, DIM = 50_000, 8


@pytest.fixture(scope="module")
def client():
    with LocalCluster(2, num_workers=1) as cluster:
        ps_client = PSClient(servers=cluster.addresses, worker_id=0, num_workers=1, secret=cluster.secret)
        try:
            yield ps_client
        finally:
            ps_client.close()


_names = iter(range(10_000))


def table(client, **kwargs) -> PSEmbedding:
    """A fresh table (servers keep every name for the module's lifetime)."""
    kwargs.setdefault("optimizer", {"name": "sgd", "lr": 0.1})
    return PSEmbedding(ROWS, DIM, name=f"emb{next(_names)}", client=client, **kwargs)


def test_training_matches_a_local_embedding_under_sgd(client):
    torch.manual_seed(0)
    emb = table(client, init_std=0.0)  # zeros on the servers: the local copy can start equal
    local = nn.Embedding(ROWS, DIM)
    nn.init.zeros_(local.weight)
    head = nn.Linear(DIM, 1)
    local_head = nn.Linear(DIM, 1)
    local_head.load_state_dict(head.state_dict())
    local_opt = torch.optim.SGD([local.weight], lr=0.1)
    ids = torch.randint(0, ROWS, (5, 32, 3))  # duplicates within and across batches
    targets = torch.randn(5, 32, 1)
    for step in range(5):
        loss = nn.functional.mse_loss(head(emb(ids[step]).sum(1)), targets[step])
        loss.backward()
        assert emb.push_gradients(lr=0.1).result() is None
        local_loss = nn.functional.mse_loss(local_head(local(ids[step]).sum(1)), targets[step])
        local_opt.zero_grad()
        local_loss.backward()
        local_opt.step()
        assert loss.item() == pytest.approx(local_loss.item(), abs=1e-6)
        head.zero_grad()
        local_head.zero_grad()
    touched = torch.unique(ids)
    served = client.pull_rows(emb.name, touched).result()
    torch.testing.assert_close(served, local.weight.detach()[touched], atol=1e-6, rtol=0)
    assert local.weight.detach()[touched].abs().sum() > 0  # it did learn something


def test_forward_pulls_only_the_unique_rows_and_pushes_their_count(client):
    emb = table(client)
    ids = torch.tensor([[5, 9, 5], [9, 9, 123]])
    out = emb(ids)
    assert out.shape == (2, 3, DIM)
    torch.testing.assert_close(out[0, 0], out[0, 2])  # same row, same vector
    rows = client.pull_rows(emb.name, torch.tensor([5, 9, 123])).result()
    torch.testing.assert_close(out[1], rows[[1, 1, 2]])
    out.sum().backward()
    emb.push_gradients(lr=0.1).result()
    assert emb.pushed_rows == 3
    after = client.pull_rows(emb.name, torch.tensor([5, 9, 123])).result()
    # d(sum)/d(row) = number of occurrences: 2, 3 and 1
    torch.testing.assert_close(rows - after, 0.1 * torch.tensor([2.0, 3.0, 1.0])[:, None].expand(3, DIM))


def test_push_bytes_are_proportional_to_the_touched_rows(client):
    emb = table(client)
    sent = []
    for count in (64, 4096):
        emb(torch.randperm(ROWS)[:count]).sum().backward()
        before = client.bytes_sent
        emb.push_gradients(lr=0.01).result()
        sent.append(client.bytes_sent - before)
    payload = [64 * DIM * 4, 4096 * DIM * 4]
    assert sent[0] >= payload[0] and sent[1] >= payload[1]
    ratio = sent[1] / sent[0]
    assert 25 < ratio <= 64, f"4096 rows cost {ratio:.1f}x the bytes of 64 rows; sent={sent}"
    assert sent[1] < 1.6 * 4096 * (DIM * 4 + 8)  # gradients + int64 ids + small headers
    assert sent[1] < ROWS * DIM * 4 / 8  # far below the table itself


def test_micro_batches_are_coalesced_into_one_push(client):
    emb = table(client)
    emb.register()
    before = client.pull_rows(emb.name, torch.tensor([1, 2, 3])).result()
    emb(torch.tensor([1, 2])).sum().backward()
    emb(torch.tensor([2, 3])).sum().backward()
    assert emb.row_gradients() is not None  # consumes them ...
    assert emb.row_gradients() is None  # ... once
    emb(torch.tensor([1, 2])).sum().backward()
    emb(torch.tensor([2, 3])).mul(2).sum().backward()
    emb.push_gradients(scale=0.5, lr=1.0).result()
    after = client.pull_rows(emb.name, torch.tensor([1, 2, 3])).result()
    expected = 0.5 * torch.tensor([1.0, 3.0, 2.0])[:, None].expand(3, DIM)
    torch.testing.assert_close(before - after, expected)


def test_zero_grad_before_backward_still_pushes_and_eval_records_nothing(client):
    emb = table(client)
    loss = emb(torch.tensor([7])).sum()
    emb.zero_grad_rows()  # the forward; zero_grad(); backward(); step() pattern
    loss.backward()
    assert emb.push_gradients(lr=0.1) is not None
    emb.eval()
    emb(torch.tensor([7, 8]))
    with torch.no_grad():
        emb.train()
        emb(torch.tensor([7, 8]))
    assert emb.push_gradients(lr=0.1) is None


def test_bad_arguments_and_ids_are_named(client):
    with pytest.raises(ValueError, match="num_embeddings"):
        PSEmbedding(0, 4, name="x")
    with pytest.raises(ValueError, match="embedding_dim"):
        PSEmbedding(4, True, name="x")
    with pytest.raises(ValueError, match="name"):
        PSEmbedding(4, 4, name="")
    with pytest.raises(ValueError, match="init_std"):
        PSEmbedding(4, 4, name="x", init_std=-1.0)
    with pytest.raises(ValueError, match="mode"):
        PSEmbedding(4, 4, name="x", mode="bsp")
    emb = table(client)
    with pytest.raises(TypeError, match="float32"):
        emb(torch.zeros(3))
    with pytest.raises(ValueError, match=r"ids in \[-1, 2\]"):
        emb(torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=str(ROWS)):
        emb(torch.tensor([ROWS]))
    with pytest.raises(RuntimeError, match="no parameter-server client"):
        PSEmbedding(4, 4, name="orphan")(torch.tensor([1]))
