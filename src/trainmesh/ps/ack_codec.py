"""The push acknowledgement, written and read without the general codec's JSON machinery.

Every push gets one ack, so at 1 MB pushes its encode (server) and decode (client) are a
measurable share of the Python per push. ``AckWriter`` writes, byte for byte, what
``protocol.encode`` writes for ``Message(ACK, sender, seq, meta={"seq": seq})``; ``read_ack``
accepts only frames of exactly that shape (after the HMAC check, when there is a secret) and
returns None for anything else, which then goes through ``frame_decode.decode`` and all its checks.
So the fast path never accepts a frame the general decoder would refuse.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re

from .protocol import (
    _PREFIX,
    FLAG_HMAC,
    FLAG_SESSION,
    FORMAT_VERSION,
    HMAC_SIZE,
    MAGIC,
    TOKEN_SIZE,
    Message,
    MessageType,
    _check_secret,
    _pad_header,
)

# The header AckWriter writes, for a plain sender name (server ids are like "ps-0" or
# "127.0.0.1:5555"); acks from any other sender are read by the general decoder.
_ACK_HEADER = re.compile(
    rb'\{"type":"ack","sender":"([A-Za-z0-9_.:@#/-]{0,200})","seq":(0|[1-9][0-9]{0,17}),'
    rb'"version":0,"tensors":\[\],"meta":\{"seq":(0|[1-9][0-9]{0,17})\}\} *\Z'
)


class AckWriter:
    """Encodes the acks of one server (its ``sender`` and ``secret`` are fixed)."""

    def __init__(self, sender: str, secret: bytes | str | None = None):
        self.key = _check_secret(secret)
        self._head = ('{"type":"ack","sender":' + json.dumps(sender) + ',"seq":').encode("utf-8")
        self._middle = b',"version":0,"tensors":[],"meta":{"seq":'
        self._flags = FLAG_HMAC if self.key else 0

    def encode(self, seq: int, token: bytes | None = None) -> bytes:
        """The ack of ``seq``: sealed with the connection's session ``token`` when given (as
        ``protocol.encode(..., token=token)`` seals it), else with the secret's HMAC."""
        digits = str(seq).encode("ascii")
        header = _pad_header(self._head + digits + self._middle + digits + b"}}")
        if token is not None:
            return _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_SESSION, len(header)) + header + token
        frame = _PREFIX.pack(MAGIC, FORMAT_VERSION, self._flags, len(header)) + header
        if self.key:
            frame += hmac.new(self.key, frame, hashlib.sha256).digest()
        return frame


def read_ack(frame, key: bytes | None, token: bytes | None = None) -> Message | None:
    """The ack in ``frame`` (one bytes frame) if it has exactly the shape ``AckWriter`` writes and,
    with a ``key`` (from ``protocol._check_secret``), a valid HMAC, or with a session ``token``,
    that token; otherwise None."""
    if type(frame) is not bytes or len(frame) < _PREFIX.size:
        return None
    magic, version, flags, header_len = _PREFIX.unpack_from(frame, 0)
    body_end = _PREFIX.size + header_len
    if token is not None:
        expected_flags, trailer = FLAG_SESSION, TOKEN_SIZE
    else:
        expected_flags, trailer = (FLAG_HMAC, HMAC_SIZE) if key else (0, 0)
    if magic != MAGIC or version != FORMAT_VERSION or flags != expected_flags or len(frame) != body_end + trailer:
        return None
    if token is not None and not hmac.compare_digest(frame[body_end:], token):
        return None
    if (
        key
        and token is None
        and not hmac.compare_digest(
            hmac.new(key, memoryview(frame)[:body_end], hashlib.sha256).digest(), frame[body_end:]
        )
    ):
        return None
    match = _ACK_HEADER.match(frame, _PREFIX.size, body_end)
    if match is None or match.group(2) != match.group(3):
        return None
    seq = int(match.group(2))
    return Message(MessageType.ACK, match.group(1).decode("ascii"), seq, meta={"seq": seq})
