"""Who may talk to a parameter server (ps/auth.py): strangers are refused, told so at once, and
logged sparingly; the secret's sources (argument, environment, 0600 file)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from trainmesh.ps import auth
from trainmesh.ps.client import PSClient
from trainmesh.ps.cluster import AdminConnection
from trainmesh.ps.errors import PSAuthError
from trainmesh.ps.inprocess_transport import InProcessHub
from trainmesh.ps.protocol import Message, MessageType, encode
from trainmesh.ps.server import ParameterServer

pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("serial")]

SECRET = b"the-job-secret"


@pytest.fixture(autouse=True)
def _no_job_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)


@pytest.fixture
def served():
    """One in-process server with SECRET, serving in a thread; yields (hub, server)."""
    hub = InProcessHub()
    server = ParameterServer(hub.server("s0"), server_id="s0", secret=SECRET)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield hub, server
    server.stop()
    thread.join(5)
    server.transport.close()


def _client(hub, worker, **kwargs) -> PSClient:
    return PSClient(
        transports=[hub.client("s0", f"w{worker}".encode())],
        worker_id=worker,
        retry_after_s=0.2,
        request_timeout_s=10.0,
        **kwargs,
    )


@pytest.mark.parametrize("secret", [b"not-the-secret", None], ids=["wrong", "missing"])
def test_a_wrong_or_missing_secret_is_named_within_seconds(served, secret):
    hub, server = served
    started = time.monotonic()
    with pytest.raises(PSAuthError, match="authentication failed.*TRAINMESH_PS_SECRET") as info:
        _client(hub, 1, secret=secret)  # registers as it is built
    assert time.monotonic() - started < 5.0  # not the 10 s request timeout
    assert info.value.code == "unauthenticated"
    with _client(hub, 0, secret=SECRET) as client:  # the job's own client is served as before
        stats = client.stats().result(10)["servers"][0]
    assert stats["unauthenticated"] >= 1 and stats["requests"] <= 2  # (its register and maybe a heartbeat)


def test_a_strangers_shutdown_export_init_and_push_are_refused_and_change_nothing(served):
    hub, server = served
    with _client(hub, 0, secret=SECRET) as owner:
        owner.init({"w": torch.zeros(4)}, optimizer={"name": "sgd", "lr": 1.0})
        before = owner.stats().result(10)["servers"][0]
        stranger = hub.client("s0", b"stranger")
        for msg in [
            Message(MessageType.SHUTDOWN, "x", 1),
            Message(MessageType.EXPORT, "x", 2, meta={"list": True}),
            Message(MessageType.INIT, "x", 3, meta={"params": []}),
            Message(MessageType.REGISTER, "x", 4, meta={"worker": "x"}),
            Message(MessageType.PUSH, "x", 5, meta={"shards": ["w#0"], "rows": {}}, tensors={"w#0": torch.ones(4)}),
        ]:
            stranger.send(encode(msg))  # unsigned, as a process without the secret would send it
            stranger.send(encode(msg, b"guessed"))
        reply = stranger.recv(5)
        assert reply is not None and auth.rejection_code(reply) == "unauthenticated"
        time.sleep(0.3)
        after = owner.stats().result(10)["servers"][0]
        assert torch.equal(owner.pull(["w"]).result(10)["w"], torch.zeros(4))  # no push applied
    assert server._running  # SHUTDOWN refused: still serving
    assert after["unauthenticated"] - before["unauthenticated"] == 10
    for counter in ("applied_pushes", "pulls", "duplicates", "errors_sent"):
        assert after[counter] == before[counter], counter
    assert after["requests"] - before["requests"] <= 2  # the owner's own stats request (and a heartbeat)
    assert after["bytes_in"] - before["bytes_in"] < 1024


def test_a_thousand_bad_frames_make_a_few_log_lines_and_few_replies(served, caplog):
    hub, server = served
    caplog.set_level(logging.WARNING, logger="trainmesh.ps.server")
    one = hub.client("s0", b"flooder")
    forged = encode(Message(MessageType.SHUTDOWN, "x", 1), b"guessed")
    for i in range(1000):
        one.send(forged if i % 2 else b"garbage")
    many = [hub.client("s0", f"peer-{i}".encode()) for i in range(50)]
    for _ in range(20):
        for peer in many:
            peer.send(forged)
    with _client(hub, 0, secret=SECRET) as client:
        deadline = time.monotonic() + 20
        while client.stats().result(10)["servers"][0]["unauthenticated"] < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().result(10)["servers"][0]["unauthenticated"] == 2000
    replies = 0
    while one.recv(0.05) is not None:
        replies += 1
    assert 1 <= replies <= 20  # at most one per peer per reply interval, not one per frame
    lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert 1 <= len(lines) <= 5, [r.getMessage() for r in lines]  # 51 peers, 2,000 frames


def test_reject_guard_logs_once_per_peer_per_interval_with_a_count():
    now = [0.0]
    records: list[str] = []

    class Log:
        def warning(self, fmt, *args):
            records.append(fmt % args)

    guard = auth.RejectGuard("s", Log(), log_interval_s=10.0, reply_interval_s=1.0, clock=lambda: now[0])
    answers = [guard.reject(b"p", ValueError("bad")) for _ in range(100)]
    assert answers[0] and not any(answers[1:]) and len(records) == 1
    now[0] = 10.5  # the next interval: one line with the count of what came meanwhile
    assert guard.reject(b"p", ValueError("bad"))
    assert len(records) == 2 and "rejected 100 " in records[1]
    guard.reject(b"p", ValueError("bad"))
    guard.flush()
    assert len(records) == 3 and "1 more" in records[2]


def test_a_server_others_can_reach_needs_a_secret(monkeypatch):
    pytest.importorskip("zmq")
    from trainmesh.ps.transport import ZmqServerTransport

    transport = ZmqServerTransport("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="needs a secret.*loopback too"):
            ParameterServer(transport)
        monkeypatch.setenv(auth.SECRET_ENV, "from-the-environment")
        assert ParameterServer(transport).secret == b"from-the-environment"
    finally:
        transport.close()


def test_loopback_server_over_zeromq_refuses_a_strangers_shutdown():
    pytest.importorskip("zmq")
    from trainmesh.ps.transport import ZmqServerTransport

    server = ParameterServer(ZmqServerTransport("tcp://127.0.0.1:0"), server_id="s0", secret=auth.new_secret())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with AdminConnection([server.transport.address], None, timeout_s=60) as stranger:
            with pytest.raises(PSAuthError, match="authentication failed"):
                stranger.ask(0, MessageType.SHUTDOWN)
        assert time.monotonic() - started < 5.0
        time.sleep(0.2)
        assert thread.is_alive() and server.counters["unauthenticated"] >= 1
        with AdminConnection([server.transport.address], server.secret, timeout_s=30) as owner:
            assert owner.ask(0, MessageType.SHUTDOWN).type is MessageType.OK
        thread.join(10)
        assert not thread.is_alive()
    finally:
        server.stop()
        thread.join(5)
        server.transport.close()


def test_secret_sources_in_order_and_the_file_must_be_private(tmp_path, monkeypatch):
    assert auth.resolve_secret() is None
    path = auth.write_secret_file("from-a-file", tmp_path / "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setenv(auth.SECRET_FILE_ENV, path)
    assert auth.resolve_secret() == b"from-a-file"
    monkeypatch.setenv(auth.SECRET_ENV, "from-the-environment")
    assert auth.resolve_secret() == b"from-the-environment"
    assert auth.resolve_secret("given") == b"given"
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="open to other users.*chmod 600"):
        auth.read_secret_file(path)
    with pytest.raises(FileExistsError):
        auth.write_secret_file("again", path)  # never overwrites
    fresh = auth.write_secret_file(auth.new_secret())
    assert os.stat(os.path.dirname(fresh)).st_mode & 0o777 == 0o700
    assert len(auth.read_secret_file(fresh)) >= 40
    os.remove(fresh)
    os.rmdir(os.path.dirname(fresh))


def test_a_manual_server_keeps_its_made_secret_in_its_directory(tmp_path):
    from trainmesh.ps import serve

    args = serve.build_parser().parse_args(["--dir", str(tmp_path / "state"), "--durability", "wal"])
    made = serve._secret(args)  # no variable, no file yet: made and written to DIR/secret
    path = tmp_path / "state" / "secret"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert serve._secret(args) == made  # a restart reads it back: its WAL stays readable
    exposed = serve.build_parser().parse_args(["--bind", "tcp://0.0.0.0:0"])
    with pytest.raises(ValueError, match="without a secret"):
        serve._secret(exposed)  # off loopback nothing is made up: the user gives the secret
