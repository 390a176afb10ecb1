"""Per-connection authentication: a challenge-response once per connection, then a session token.

Hashing every frame (HMAC-SHA256 over the payload, on both sides) cost more than the wire itself
at 1 MB pushes. So a client proves the job's secret once per connection and its frames then carry
a 16-byte session token that the server compares (see ``protocol.FLAG_SESSION``):

```
client -> HELLO      meta {"nonce": cn}                        unsealed
server -> CHALLENGE  meta {"nonce": cn, "server_nonce": sn,    unsealed; the server proves the
                           "proof": HMAC(secret, server|cn|sn)}  secret first (mutual)
client -> AUTH       meta {"proof": HMAC(secret, client|cn|sn)}  unsealed, then its requests
both:  token = HMAC(secret, session|cn|sn)[:16]                never sent in the handshake
```

Nonces are fresh random 16 bytes on both sides, so no proof can be replayed, and the server's
proof (which a stranger can ask for) is made with another label than the client's. The server
keeps the token per ROUTER peer (connection identity): a frame is served only if its peer
authenticated *and* it carries that peer's token, so a stranger who claims a worker's identity
(ZeroMQ's ROUTER_HANDOVER) still holds no token. Frames with a per-frame HMAC stay valid on their
own (admin tools, write-ahead-log records). The threat model is in docs/parameter_server.md.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets

from .protocol import FLAG_HMAC, FLAG_SESSION, TOKEN_SIZE, AuthenticationError, Message, MessageType, frame_flags
from .frame_decode import decode
from .transport import frame_nbytes, joined

HANDSHAKE_MAX_BYTES = 4096  # an unsealed frame (handshake or rejection) is never larger
_NONCE_BYTES = 16
_DOMAIN = b"trainmesh-ps-session-v1|"


def _mac(key: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + label + b"|" + client_nonce + b"|" + server_nonce, hashlib.sha256).digest()


def session_token(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The token both ends derive after a handshake (never on the wire during it)."""
    return _mac(key, b"session", client_nonce, server_nonce)[:TOKEN_SIZE]


def _nonce_of(meta: dict, name: str) -> bytes:
    """A nonce from a peer's (unauthenticated) meta, checked: 32 hex digits."""
    value = meta.get(name)
    if not isinstance(value, str) or len(value) != 2 * _NONCE_BYTES:
        raise AuthenticationError(f"handshake: {name} must be {2 * _NONCE_BYTES} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise AuthenticationError(f"handshake: {name} must be {2 * _NONCE_BYTES} hex digits") from None


def _proof_of(meta: dict) -> bytes:
    value = meta.get("proof")
    if not isinstance(value, str) or len(value) != 64:
        raise AuthenticationError("handshake: proof must be 64 hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise AuthenticationError("handshake: proof must be 64 hex digits") from None


class ServerSessions:
    """The server's side: challenges waiting for their answer, and each authenticated peer's token.

    Both tables are bounded (oldest forgotten first): a forgotten peer is refused once and
    authenticates again (the client does that by itself), so memory stays bounded however many
    connections come and go."""

    def __init__(self, key: bytes, server_id: str, *, max_pending: int = 4096, max_sessions: int = 65536):
        self.key, self.server_id = key, server_id
        self.max_pending, self.max_sessions = max_pending, max_sessions
        self._pending: collections.OrderedDict = collections.OrderedDict()  # peer -> (cn, sn)
        self._tokens: collections.OrderedDict = collections.OrderedDict()  # peer -> token

    def open(self, peer, frame, max_bytes: int) -> tuple[Message | None, Message | None]:
        """``(request, None)`` for a frame sealed with ``peer``'s session token or the secret's
        HMAC (decoded without a copy); ``(None, reply or None)`` for a handshake frame (HELLO gets
        a CHALLENGE, a good AUTH nothing). Raises ProtocolError for anything else: a frame of a
        connection that did not authenticate is never parsed past its prefix."""
        flags = frame_flags(frame)
        if flags == FLAG_SESSION:
            token = self._tokens.get(peer)
            if token is None:
                raise AuthenticationError("this connection has not authenticated (no handshake, or a restarted server)")
            return decode(frame, None, max_bytes, copy=False, token=token), None
        if flags != 0:  # the HMAC of a frame that authenticates alone; or not a frame at all
            return decode(frame, self.key, max_bytes, copy=False), None
        if frame_nbytes(frame) > HANDSHAKE_MAX_BYTES:
            raise AuthenticationError("message has no HMAC and no session token")
        msg = decode(frame, None, HANDSHAKE_MAX_BYTES)
        if msg.type is MessageType.HELLO:
            return None, self.challenge(peer, msg)
        if msg.type is MessageType.AUTH:
            self.authenticate(peer, msg)
            return None, None
        raise AuthenticationError("message has no HMAC but a secret is configured (and no session token)")

    def token(self, peer) -> bytes | None:
        """The session token of ``peer`` (a connection that authenticated), else None."""
        return self._tokens.get(peer)

    def challenge(self, peer, hello: Message) -> Message:
        """The answer to a HELLO: a fresh server nonce and the server's proof. A HELLO resent with
        the same client nonce gets the same challenge (its AUTH may already be on the way)."""
        client_nonce = _nonce_of(hello.meta, "nonce")
        pending = self._pending.get(peer)
        if pending is None or pending[0] != client_nonce:
            pending = (client_nonce, secrets.token_bytes(_NONCE_BYTES))
            self._pending[peer] = pending
            if len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
        client_nonce, server_nonce = pending
        proof = _mac(self.key, b"server", client_nonce, server_nonce)
        meta = {"nonce": client_nonce.hex(), "server_nonce": server_nonce.hex(), "proof": proof.hex()}
        return Message(MessageType.CHALLENGE, self.server_id, 0, meta=meta)

    def authenticate(self, peer, auth: Message) -> None:
        """Check an AUTH against this peer's challenge; on success the peer's frames are trusted
        while they carry its token. Raises AuthenticationError (the peer stays a stranger)."""
        pending = self._pending.pop(peer, None)
        if pending is None:
            raise AuthenticationError("handshake: AUTH without a HELLO on this connection")
        client_nonce, server_nonce = pending
        if not hmac.compare_digest(_proof_of(auth.meta), _mac(self.key, b"client", client_nonce, server_nonce)):
            raise AuthenticationError("handshake: the client's proof was made with another secret")
        self._tokens[peer] = session_token(self.key, client_nonce, server_nonce)
        self._tokens.move_to_end(peer)
        if len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)


class ClientSession:
    """One client connection's side of the handshake (used by the client's I/O thread only).

    ``state``: "none" (not started), "hello" (HELLO sent, waiting for the challenge), "ready"
    (AUTH sent, ``token`` set: requests go out sealed with it)."""

    def __init__(self, key: bytes, sender: str):
        self.key, self.sender = key, sender
        self.state, self.token = "none", None
        self.nonce = b""
        self.hello_sent = 0.0
        self.attempts = 0  # handshakes since the server last served a sealed request

    def hello(self, now: float) -> Message:
        """Start a (new) handshake: the HELLO to send."""
        self.state, self.token = "hello", None
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.hello_sent = now
        self.attempts += 1
        return self.resend_hello(now)

    def resend_hello(self, now: float) -> Message:
        self.hello_sent = now
        return Message(MessageType.HELLO, self.sender, 0, meta={"nonce": self.nonce.hex()})

    def answer(self, challenge: Message) -> tuple[Message | None, bool]:
        """``(AUTH to send or None, server proved the secret)`` for a CHALLENGE. None for a stale
        challenge (another handshake's); a server that cannot prove the secret still gets our
        AUTH (so it logs the stranger), and the caller fails its requests."""
        if self.state != "hello" or challenge.meta.get("nonce") != self.nonce.hex():
            return None, True
        server_nonce = _nonce_of(challenge.meta, "server_nonce")
        try:
            proof = _proof_of(challenge.meta)
        except AuthenticationError:
            proof = b""
        genuine = hmac.compare_digest(proof, _mac(self.key, b"server", self.nonce, server_nonce))
        auth = Message(
            MessageType.AUTH, self.sender, 0, meta={"proof": _mac(self.key, b"client", self.nonce, server_nonce).hex()}
        )
        if genuine:
            self.state, self.token = "ready", session_token(self.key, self.nonce, server_nonce)
        else:
            self.state, self.token = "none", None
        return auth, genuine


def signed_record(frame, key: bytes) -> bytes:
    """A frame sealed with a session token, resealed with the secret's HMAC (one joined copy): a
    write-ahead-log record must authenticate on its own when the log is replayed."""
    data = bytearray(joined(frame))
    if data[5] != FLAG_SESSION:
        return bytes(data)
    del data[-TOKEN_SIZE:]
    data[5] = FLAG_HMAC
    data += hmac.new(key, data, hashlib.sha256).digest()
    return bytes(data)
