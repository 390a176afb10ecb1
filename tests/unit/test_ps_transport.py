"""PS transports: ZeroMQ and in-process behave alike (routing, restart), fault injection, bind checks."""

from __future__ import annotations

import importlib
import re
import sys
import time

import pytest

from trainmesh.ps.inprocess_transport import FaultInjectingTransport, InProcessHub
from trainmesh.ps.loopback_bandwidth import loopback_bandwidth
from trainmesh.ps.transport import (
    ClientTransport,
    ServerTransport,
    ZmqClientTransport,
    ZmqServerTransport,
    check_bind_address,
    normalize_address,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("serial")]


class _ZmqFactory:
    def server(self, address: str | None = None) -> ServerTransport:
        pytest.importorskip("zmq")
        return ZmqServerTransport() if address is None else ZmqServerTransport(address)

    def client(self, address: str, identity: bytes) -> ClientTransport:
        return ZmqClientTransport(address, identity)


class _InProcessFactory:
    def __init__(self) -> None:
        self.hub = InProcessHub()

    def server(self, address: str | None = None) -> ServerTransport:
        return self.hub.server(address or "server-0")

    def client(self, address: str, identity: bytes) -> ClientTransport:
        return self.hub.client(address, identity)


@pytest.fixture(params=["zmq", "inprocess"])
def factory(request):
    return _ZmqFactory() if request.param == "zmq" else _InProcessFactory()


def _recv_or_fail(transport, timeout_s: float = 10.0):
    got = transport.recv(timeout_s)
    assert got is not None, f"nothing received within {timeout_s}s"
    return got


def test_replies_are_routed_to_the_sending_client(factory):
    server = factory.server()
    clients = [factory.client(server.address, f"worker-{i}".encode()) for i in range(3)]
    try:
        for i, client in enumerate(clients):
            client.send(f"request {i}".encode())
        senders = {}
        for _ in clients:
            peer, data = _recv_or_fail(server)
            senders[peer] = data
            server.send(peer, b"reply to " + peer)
        assert senders == {f"worker-{i}".encode(): f"request {i}".encode() for i in range(3)}
        for i, client in enumerate(clients):
            assert _recv_or_fail(client) == f"reply to worker-{i}".encode()
            assert client.recv(0.05) is None  # nobody else's reply leaked here
        assert server.messages_sent == 3 and server.messages_received == 3
        assert clients[1].bytes_sent == len(b"request 1")
        assert clients[1].bytes_received == len(b"reply to worker-1")
    finally:
        for client in clients:
            client.close()
        server.close()


def test_client_reaches_a_server_restarted_on_the_same_address(factory):
    server = factory.server()
    address = server.address
    client = factory.client(address, b"worker-0")
    try:
        client.send(b"before")
        peer, _ = _recv_or_fail(server)
        server.send(peer, b"ok")
        assert _recv_or_fail(client) == b"ok"
        server.close()

        server = factory.server(address)
        assert server.address == address
        # No reconnect call: the transport handles it. A frame sent before the client noticed the
        # old connection close can be lost (sends are best effort): resend, as ClientIO does.
        for _ in range(20):
            client.send(b"after restart")
            if (got := server.recv(0.5)) is not None:
                break
        assert got == (b"worker-0", b"after restart")
        peer = got[0]
        while server.recv(0.2) is not None:  # later resends may arrive too
            pass
        server.send(peer, b"ok again")
        assert _recv_or_fail(client) == b"ok again"
    finally:
        client.close()
        server.close()


def test_reply_to_an_unknown_peer_is_dropped_not_raised(factory):
    server = factory.server()
    client = factory.client(server.address, b"worker-0")
    try:
        server.send(b"nobody", b"lost")
        client.send(b"ping")
        peer, _ = _recv_or_fail(server)
        server.send(peer, b"pong")
        assert _recv_or_fail(client) == b"pong"
    finally:
        client.close()
        server.close()


def test_recv_times_out_with_none(factory):
    server = factory.server()
    client = factory.client(server.address, b"worker-0")
    try:
        start = time.monotonic()
        assert server.recv(0.1) is None
        assert client.recv(0.1) is None
        assert client.recv(0) is None
        assert 0.15 <= time.monotonic() - start < 5.0
    finally:
        client.close()
        server.close()


def test_large_16mb_frame_round_trip(factory):
    server = factory.server()
    client = factory.client(server.address, b"worker-0")
    frame = bytes(range(256)) * (16 * 1024 * 1024 // 256)
    try:
        client.send(frame)
        peer, data = _recv_or_fail(server)
        assert data == frame
        server.send(peer, data)
        assert _recv_or_fail(client) == frame
        assert client.bytes_sent == client.bytes_received == len(frame)
    finally:
        client.close()
        server.close()


def test_sending_on_a_closed_transport_raises(factory):
    server = factory.server()
    client = factory.client(server.address, b"worker-0")
    client.close()
    server.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.send(b"x")


def test_zmq_server_binds_port_zero_to_a_real_port():
    pytest.importorskip("zmq")
    server = ZmqServerTransport("127.0.0.1:0")
    try:
        host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with pytest.raises(OSError, match="cannot bind"):
            ZmqServerTransport(server.address, bind_timeout_s=0.1)  # port taken
    finally:
        server.close()


def test_zmq_client_rejects_reserved_identity():
    pytest.importorskip("zmq")
    with pytest.raises(ValueError, match="identity"):
        ZmqClientTransport("tcp://127.0.0.1:1", b"\x00abc")
    with pytest.raises(ValueError, match="identity"):
        ZmqClientTransport("tcp://127.0.0.1:1", "worker-0")


def test_inprocess_hub_refuses_two_servers_with_one_name():
    hub = InProcessHub()
    server = hub.server("s")
    with pytest.raises(ValueError, match="'s' is already bound"):
        hub.server("s")
    server.close()
    hub.server("s").close()


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:5555",
        "127.0.0.1:0",
        "tcp://127.3.2.1:1",
        "tcp://localhost:0",
        "tcp://[::1]:0",
        "ipc://some-socket",
        "inproc://ps",
    ],
)
def test_loopback_and_local_addresses_need_no_secret(address):
    assert check_bind_address(address, None) == normalize_address(address)


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "10.1.2.3:80", "tcp://[::]:1", "tcp://trainer-host-7:5555"]
)
def test_exposed_addresses_need_a_secret(address):
    with pytest.raises(ValueError, match="refusing to bind .*" + re.escape(address.split("//")[-1])):
        check_bind_address(address, None)
    assert check_bind_address(address, b"s3cret") == normalize_address(address)


def test_zmq_server_refuses_exposed_bind_without_secret():
    with pytest.raises(ValueError, match="0.0.0.0"):
        ZmqServerTransport("tcp://0.0.0.0:0")


def test_a_message_sent_as_parts_arrives_whole_and_decodes_like_one_frame(factory):
    import torch

    from trainmesh.ps.frame_decode import decode
    from trainmesh.ps.protocol import Message, encode, encode_parts

    grad = torch.arange(65536, dtype=torch.float32)  # 256 KiB: sent from the tensor's memory
    msg = Message("push", "w", 1, tensors={"g": grad, "ids": torch.tensor([3, 1])}, meta={"k": 1})
    parts = encode_parts(msg, b"s3cret")
    server = factory.server()
    client = factory.client(server.address, b"worker-0")
    try:
        client.send(parts)
        peer, data = _recv_or_fail(server)
        # ZeroMQ hands over the frames (a list; no copy of the large one), in-process one joined frame.
        assert (isinstance(data, list) and len(data) == len(parts)) or bytes(data) == bytes(encode(msg, b"s3cret"))
        out = decode(data, b"s3cret", copy=False)
        assert torch.equal(out.tensors["g"], grad) and out.tensors["ids"].tolist() == [3, 1]
        assert server.bytes_received == client.bytes_sent == len(encode(msg, b"s3cret"))
        server.send(peer, encode_parts(msg))  # replies may be parts too
        assert torch.equal(decode(_recv_or_fail(client)).tensors["g"], grad)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("address", ["", "tcp://nohost", "tcp://h:port", "udp://1.2.3.4:5"])
def test_malformed_addresses_are_rejected(address):
    with pytest.raises(ValueError):
        check_bind_address(address, None)


def _fault_run(seed: int, messages: int = 600):
    hub = InProcessHub()
    server = hub.server("s")
    client = FaultInjectingTransport(
        hub.client("s", b"w"), drop_send=0.2, drop_recv=0.25, duplicate_send=0.1, seed=seed
    )
    for i in range(messages):
        client.send(i.to_bytes(4, "little"))
    delivered = []
    while (got := server.recv(0)) is not None:
        delivered.append(int.from_bytes(got[1], "little"))
        server.send(got[0], got[1])
    replies = []
    while (data := client.recv(0)) is not None:
        replies.append(int.from_bytes(data, "little"))
    return client, delivered, replies


def test_fault_injector_counts_what_it_did_and_is_reproducible():
    client, delivered, replies = _fault_run(seed=7)
    assert len(delivered) == 600 - client.dropped_sends + client.duplicated_sends
    assert client.messages_sent == len(delivered)  # inner transport: what really went out
    assert len(replies) == len(delivered) - client.dropped_recvs
    # Binomial(600, p) stays well within these bounds for any seed.
    assert 80 <= client.dropped_sends <= 160
    assert 20 <= client.duplicated_sends <= 80
    assert 0.15 * len(delivered) <= client.dropped_recvs <= 0.35 * len(delivered)
    assert set(delivered) < set(range(600))
    again, delivered_again, replies_again = _fault_run(seed=7)
    assert (delivered_again, replies_again) == (delivered, replies)
    assert (again.dropped_sends, again.duplicated_sends, again.dropped_recvs) == (
        client.dropped_sends,
        client.duplicated_sends,
        client.dropped_recvs,
    )
    _, delivered_other, _ = _fault_run(seed=8)
    assert delivered_other != delivered


def test_fault_injector_delays_sends_and_keeps_waiting_after_a_dropped_reply():
    hub = InProcessHub()
    server = hub.server("s")
    client = FaultInjectingTransport(hub.client("s", b"w"), delay_s=(0.02, 0.03), seed=0)
    start = time.monotonic()
    for _ in range(5):
        client.send(b"x")
    assert time.monotonic() - start >= 0.1
    lossy = FaultInjectingTransport(hub.client("s", b"v"), drop_recv=1.0, seed=0)
    server.send(b"v", b"lost")
    start = time.monotonic()
    assert lossy.recv(0.2) is None and lossy.dropped_recvs == 1
    assert time.monotonic() - start >= 0.15  # the drop did not cut the wait short


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"drop_send": 1.5}, "drop_send"),
        ({"drop_recv": -0.1}, "drop_recv"),
        ({"duplicate_send": 2}, "duplicate_send"),
        ({"delay_s": (0.2, 0.1)}, "delay_s"),
    ],
)
def test_fault_injector_validates_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultInjectingTransport(InProcessHub().client("s", b"w"), **kwargs)
    with pytest.raises(TypeError, match="ClientTransport"):
        FaultInjectingTransport(object())


def test_module_imports_without_pyzmq_and_zmq_classes_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # makes `import zmq` raise ImportError
    monkeypatch.delitem(sys.modules, "trainmesh.ps.transport")
    monkeypatch.delitem(sys.modules, "trainmesh.ps.inprocess_transport")
    transport = importlib.import_module("trainmesh.ps.transport")
    hub = importlib.import_module("trainmesh.ps.inprocess_transport").InProcessHub()
    hub.server("s").close()
    with pytest.raises(ImportError, match=r"pip install 'trainmesh\[ps\]'"):
        transport.ZmqServerTransport()
    with pytest.raises(ImportError, match=r"trainmesh\[ps\]"):
        transport.ZmqClientTransport("tcp://127.0.0.1:1", b"w")


def test_loopback_bandwidth_measures_zmq_throughput():
    pytest.importorskip("zmq")
    for nbytes in (1 << 20, 16 << 20):
        result = loopback_bandwidth(nbytes, repeats=5)
        assert result["nbytes"] == nbytes and result["repeats"] == 5 and result["bytes_per_s"] > 0
        assert result["seconds_per_message"] == pytest.approx(result["seconds"] / 5)
        print(
            f"zmq loopback {nbytes >> 20} MiB send+ack: {result['bytes_per_s'] / 1e9:.2f} GB/s, "
            f"{result['seconds_per_message'] * 1e3:.2f} ms/message"
        )
    pipelined = loopback_bandwidth(1 << 20, repeats=7, warmup=1, window=3)  # as the PS benchmark's peer
    assert pipelined["acked"] == 7 and pipelined["window"] == 3
