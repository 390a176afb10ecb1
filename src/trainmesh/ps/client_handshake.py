"""The PS client's side of the handshake (session.py) and of the servers' refusals (auth.py).

Once per connection the I/O thread says HELLO, answers the server's CHALLENGE with AUTH, and from
then on seals every frame with the session token; requests submitted meanwhile wait, and are sent
once the connection is ready. A refusal fails what waits on that server with ``PSAuthError``
instead of resending until the timeout. It is apart from client_io.py because none of it depends
on how the thread polls its sockets: ``ClientIO`` calls it for unsealed frames and refusals.
"""

from __future__ import annotations

import logging
import time

from .auth import UNAUTHENTICATED, refusal_text, rejection_in
from .client_requests import _Server
from .errors import PSAuthError
from .frame_decode import decode
from .protocol import Message, MessageType, ProtocolError, encode, encode_parts
from .session import HANDSHAKE_MAX_BYTES

# Handshakes in a row that end refused, with no request served between them: then the refusal
# is the server's word, not a lost session (a restarted server), and requests fail.
_MAX_HANDSHAKES = 3

# Logged under the I/O thread's name, with its other warnings: one logger to configure for the thread.
log = logging.getLogger(__package__ + ".client_io")


class ClientHandshake:
    """The handshake half of ``ClientIO`` (see the module docstring); uses its ``sender``, ``_stats``
    and each ``_Server``'s ``transport``, ``session`` and ``pending``."""

    def _hello(self, server: _Server, now: float) -> None:
        server.transport.send(bytes(encode(server.session.hello(now))))

    def _seal(self, server: _Server, msg: Message) -> list | None:
        """``msg``'s parts sealed for ``server``'s connection; None while it is not authenticated."""
        if server.session is None:
            return encode_parts(msg)
        if server.session.state != "ready":
            return None
        return encode_parts(msg, token=server.session.token)

    def _on_unsealed(self, server: _Server, frame) -> None:
        """A frame without a seal: the server's challenge, or a rejection (see auth.py)."""
        try:
            msg = decode(frame, None, HANDSHAKE_MAX_BYTES)
        except ProtocolError as error:
            self._stats["rejected_replies"] += 1
            log.warning("PS client %s: dropped a malformed reply from %s: %s", self.sender, server.name, error)
            return
        session = server.session
        if msg.type is MessageType.CHALLENGE:
            auth, genuine = session.answer(msg)
            if auth is None:
                return  # the answer to an earlier HELLO of ours
            server.transport.send(bytes(encode(auth)))  # a stranger's server still sees our AUTH fail: it logs it
            if not genuine:
                return self._refused(server, UNAUTHENTICATED)
            for pending in server.pending.values():  # what waited for the handshake, sealed now
                pending.frame = encode_parts(pending.msg, token=session.token)
                pending.sent = time.monotonic()
                server.transport.send(pending.frame)
            return
        code = rejection_in(msg)
        if code is None:
            self._stats["rejected_replies"] += 1
            return
        if code == UNAUTHENTICATED and session.state == "hello":
            return  # refused frames sent before this handshake started
        if code == UNAUTHENTICATED and session.attempts < _MAX_HANDSHAKES:
            # The server does not know this connection's session: a restarted server, a forgotten
            # session, or a challenge it no longer holds. Authenticate again; requests wait.
            self._hello(server, time.monotonic())
            return
        session.state, session.token, session.attempts = "none", None, 0
        self._refused(server, code)

    def _refused(self, server: _Server, code: str) -> None:
        """The server rejected our frames (see auth.py): fail what waits on it, naming authentication,
        instead of resending until the timeout. The words are ours, not the (unsigned) reply's."""
        self._stats["refusals"] += 1
        for seq, pending in list(server.pending.items()):
            del server.pending[seq]
            pending.gather.fail(
                PSAuthError(
                    f"{pending.kind} (seq {seq}) to server {server.name}: {refusal_text(code, server.name)}", code
                )
            )
