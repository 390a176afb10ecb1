"""Per-connection authentication (ps/session.py): a client proves the secret once per connection,
then its frames carry a session token; a connection that skipped or failed the handshake is
refused quickly, whatever identity it claims; a restarted server is authenticated again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from trainmesh.ps import auth
from trainmesh.ps.client import PSClient
from trainmesh.ps.errors import PSAuthError
from trainmesh.ps.inprocess_transport import InProcessHub
from trainmesh.ps.protocol import TOKEN_SIZE, AuthenticationError, Message, MessageType, encode, frame_flags
from trainmesh.ps.frame_decode import decode
from trainmesh.ps.server import ParameterServer
from trainmesh.ps.session import ClientSession, ServerSessions, session_token, signed_record

pytestmark = [pytest.mark.timeout(30), pytest.mark.xdist_group("serial")]

SECRET = b"the-job-secret"
SGD = {"name": "sgd", "lr": 1.0}


@pytest.fixture(autouse=True)
def _no_job_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)


class Served:
    """A server in a thread; ``restart()`` replaces it by a new one on the same transport name."""

    def __init__(self, hub, make_transport, **kwargs):
        self.hub, self.make_transport, self.kwargs = hub, make_transport, kwargs
        self.start()

    def start(self):
        self.server = ParameterServer(self.make_transport(), server_id="s0", secret=SECRET, **self.kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.stop()
        self.thread.join(5)
        self.server.transport.close()


@pytest.fixture
def zmq_served():
    pytest.importorskip("zmq")
    from trainmesh.ps.transport import ZmqServerTransport

    served = Served(None, lambda: ZmqServerTransport("tcp://127.0.0.1:0"))
    yield served
    served.stop()


def _raw_dealer(address: str, identity: bytes):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def _recv(sock, timeout_s: float):
    return sock.recv() if sock.poll(int(timeout_s * 1000)) else None


def test_frames_of_an_authenticated_client_carry_a_token_not_an_hmac(zmq_served):
    server = zmq_served.server
    with PSClient(servers=[server.transport.address], worker_id=0, num_workers=1, secret=SECRET) as client:
        client.init({"w": torch.zeros(4)}, optimizer=SGD)
        client.push({"w": torch.ones(4)}).result(10)
        assert torch.equal(client.pull(["w"]).result(10)["w"], -torch.ones(4))
        stats = client.stats().result(10)["servers"][0]
    assert stats["unauthenticated"] == 0 and stats["applied_pushes"] == 1
    assert len(server.sessions._tokens) == 1  # one connection, one session


def test_a_connection_that_skipped_or_failed_the_handshake_is_refused_within_a_second(zmq_served):
    server = zmq_served.server
    address = server.transport.address
    push = Message(MessageType.PUSH, "x", 5, meta={"shards": ["w#0"], "rows": {}}, tensors={"w#0": torch.ones(4)})
    with PSClient(servers=[address], worker_id=0, num_workers=1, secret=SECRET) as owner:
        owner.init({"w": torch.zeros(4)}, optimizer=SGD)
        owner_identity = owner.io.identity
        strangers = [
            # a token made up, on a connection that never said HELLO
            (b"stranger-1", [encode(push, token=bytes(TOKEN_SIZE))]),
            # the handshake with a wrong secret, then the token that secret would give
            (b"stranger-2", "wrong-secret"),
            # the owner's own identity (ROUTER_HANDOVER gives it the route): still no token
            (owner_identity, [encode(push, token=b"x" * TOKEN_SIZE), encode(push)]),
        ]
        for identity, frames in strangers:
            sock = _raw_dealer(address, identity)
            try:
                started = time.monotonic()
                if frames == "wrong-secret":
                    session = ClientSession(b"not-the-secret", "x")
                    sock.send(bytes(encode(session.hello(time.monotonic()))))
                    challenge = decode(_recv(sock, 5), None)
                    assert challenge.type is MessageType.CHALLENGE
                    answer, genuine = session.answer(challenge)
                    assert not genuine  # the client sees at once the server does not share its secret
                    token = session_token(
                        b"not-the-secret", session.nonce, bytes.fromhex(challenge.meta["server_nonce"])
                    )
                    frames = [encode(answer), encode(push, token=token)]
                for frame in frames:
                    sock.send(bytes(frame))
                reply = _recv(sock, 1.0)
                assert reply is not None and auth.rejection_code(reply) == "unauthenticated"
                assert time.monotonic() - started < 1.0
            finally:
                sock.close(linger=0)
        time.sleep(0.2)
        assert server.counters["applied_pushes"] == 0 and server.counters["unauthenticated"] >= 5
    # (the owner lost its route to the hijacker: checked above that nothing was applied, not its pulls)


def test_a_wrong_or_missing_secret_fails_fast_over_zeromq(zmq_served):
    address = zmq_served.server.transport.address
    for secret in (b"not-the-secret", None):
        started = time.monotonic()
        with pytest.raises(PSAuthError, match="authentication failed") as info:
            PSClient(servers=[address], worker_id=1, secret=secret, request_timeout_s=20)
        assert time.monotonic() - started < 1.0 and info.value.code == "unauthenticated"


def test_a_restarted_server_is_authenticated_again_and_its_wal_replays_session_frames(tmp_path):
    hub = InProcessHub()
    served = Served(hub, lambda: hub.server("s0"), durability="wal", directory=tmp_path)
    client = PSClient(
        transports=[hub.client("s0", b"w0")], worker_id=0, num_workers=1, secret=SECRET, retry_after_s=0.2
    )
    try:
        client.init({"w": torch.zeros(4)}, optimizer=SGD)
        client.push({"w": torch.full((4,), 2.0)}).result(10)
        # The log's records (init, push) carry the secret's HMAC, not the connection's token: a
        # replay can check them.
        records = [decode(r, SECRET) for r in served.server.state.store.wal.records()]
        assert [r.type for r in records] == [MessageType.INIT, MessageType.PUSH]
        served.stop()  # a new server: it knows no session (and restores the snapshot made at stop)
        served.start()
        client.push({"w": torch.ones(4)}).result(10)
        assert torch.equal(client.pull(["w"]).result(10)["w"], torch.full((4,), -3.0))
        assert served.server.sessions.token(b"w0") is not None
    finally:
        client.close()
        served.stop()


def test_server_sessions_refuse_auth_without_hello_or_with_a_wrong_proof():
    sessions = ServerSessions(SECRET, "s0", max_pending=2)
    client = ClientSession(SECRET, "w")
    with pytest.raises(AuthenticationError, match="without a HELLO"):
        sessions.authenticate(b"p", Message(MessageType.AUTH, "w", 0, meta={"proof": "00" * 32}))
    challenge = sessions.challenge(b"p", client.hello(0.0))
    assert sessions.challenge(b"p", client.resend_hello(0.1)).meta == challenge.meta  # a resent HELLO: same challenge
    with pytest.raises(AuthenticationError, match="another secret"):
        sessions.authenticate(b"p", Message(MessageType.AUTH, "w", 0, meta={"proof": "00" * 32}))
    assert sessions.token(b"p") is None
    challenge = sessions.challenge(b"p", client.hello(0.2))
    answer, genuine = client.answer(challenge)
    assert genuine and client.state == "ready"
    sessions.authenticate(b"p", answer)
    assert sessions.token(b"p") == client.token and len(client.token) == TOKEN_SIZE
    for bad in ({"nonce": "zz" * 16}, {"nonce": "00"}, {}):  # a stranger's HELLO meta is checked
        with pytest.raises(AuthenticationError):
            sessions.challenge(b"q", Message(MessageType.HELLO, "x", 0, meta=bad))


def test_a_wal_record_of_a_session_frame_authenticates_alone():
    msg = Message(MessageType.PUSH, "w", 3, tensors={"g": torch.arange(6.0)}, meta={"shards": ["g"]})
    frame = encode(msg, token=b"t" * TOKEN_SIZE)
    assert frame_flags(frame) == 2
    record = signed_record([bytes(frame[:20]), bytes(frame[20:])], SECRET)
    again = decode(record, SECRET)
    assert again.seq == 3 and torch.equal(again.tensors["g"], torch.arange(6.0))
    with pytest.raises(AuthenticationError):
        decode(record, b"another")


def test_a_stop_before_the_loop_starts_still_stops_the_server():
    # The parent watchdog of a server whose launcher died during its start-up calls stop() once,
    # before serve_forever: the server must not then serve forever as an orphan.
    server = ParameterServer(InProcessHub().server("s0"), server_id="s0", secret=SECRET)
    server.stop()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
