"""trainmesh.ft's recovery transport over a real torchft gloo process group (two threads, loopback): the
whole state arrives bit for bit, and a peer speaking torchft's own pickling transport is refused before
anything it sent is unpickled."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'trainmesh[ft]')")
from torch.distributed import TCPStore  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from trainmesh.ft.replica_groups import SafeStateTransport  # noqa: E402
from trainmesh.ft.tensor_codec import UnsafeStateError  # noqa: E402

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]  # torchft's own frombuffer
TIMEOUT = timedelta(seconds=20)


def _pair(prefix: str):
    """Two configured torchft gloo groups (ranks 0 and 1) sharing one loopback store."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]
    threads = [
        threading.Thread(target=pg.configure, args=(f"127.0.0.1:{store.port}/{prefix}", f"r{rank}", rank, 2))
        for rank, pg in enumerate(pgs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return store, pgs


def _exchange(sender, receiver, state, step=7, send_timeout=TIMEOUT):
    result: dict = {}

    def send():
        try:
            sender.send_checkpoint([1], step, state, send_timeout)
        except Exception as error:  # the receiver hangs up on a refused stream
            result["send_error"] = error

    thread = threading.Thread(target=send)
    thread.start()
    try:
        result["state"] = receiver.recv_checkpoint(0, "", step, TIMEOUT)
    except UnsafeStateError as error:
        result["refused"] = error
    thread.join(30)
    return result


def test_state_arrives_bit_for_bit_over_a_torchft_gloo_group():
    store, pgs = _pair("ok")
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    state = {
        "user": {"default": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}},
        "torchft": {"step": 7, "batches_committed": 14},
    }
    got = _exchange(SafeStateTransport(pgs[0], TIMEOUT), SafeStateTransport(pgs[1], TIMEOUT), state)["state"]
    assert got["torchft"] == {"step": 7, "batches_committed": 14}
    sent, back = state["user"]["default"], got["user"]["default"]
    assert all(torch.equal(back["model"][k], v) for k, v in sent["model"].items())
    assert back["optimizer"]["param_groups"] == sent["optimizer"]["param_groups"]
    assert all(
        torch.equal(back["optimizer"]["state"][i]["exp_avg"], s["exp_avg"])
        for i, s in sent["optimizer"]["state"].items()
    )
    del store


def test_a_peer_sending_torchfts_pickled_metadata_is_refused():
    store, pgs = _pair("pickle")
    evil = PGTransport(pgs[0], timeout=TIMEOUT, device=torch.device("cpu"))  # pickle.dumps of its metadata
    # its tensors after the refused header are never received: the sender gives up after 2 s
    result = _exchange(
        evil, SafeStateTransport(pgs[1], TIMEOUT), {"w": torch.ones(3)}, send_timeout=timedelta(seconds=2)
    )
    assert "refused" in result and "state" not in result, result
    del store
