"""Parameter-server wire format: one frame = fixed prefix, JSON header, raw tensor bytes, seal.

```
magic b"TMPS" | format version u8 | flags u8 (bit0: HMAC, bit1: session) | header length u32 LE
| header (UTF-8 JSON object) | payload (tensor bytes, each segment 8-byte aligned)
| seal: HMAC-SHA256 of all before it (bit0), or the connection's 16-byte session token (bit1)
```

The HMAC authenticates a frame on its own (WAL records, admin tools); the session token is what
frames carry on a connection that authenticated once (``session.py``): checking it costs a
16-byte compare, not a hash of every byte on both sides.

No pickle: a frame from the network can only ever become strings, numbers and tensors of a
whitelisted dtype: `decode` (``frame_decode.py``) raises `ProtocolError` (and nothing else) for any malformed input.
See docs/parameter_server.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

MAGIC = b"TMPS"
FORMAT_VERSION = 1
FLAG_HMAC = 0x01
FLAG_SESSION = 0x02
HMAC_SIZE = 32
TOKEN_SIZE = 16  # a session token (see session.py)
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB per message
MAX_HEADER_BYTES = 1 << 20  # 1 MiB of JSON
MAX_NDIM = 32
_ALIGN = 8
_PREFIX = struct.Struct("<4sBBI")  # magic, version, flags, header length
_HEADER_KEYS = frozenset({"type", "sender", "seq", "version", "tensors", "meta"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
# Stride arithmetic in torch is int64; bounding the product of dims keeps it from overflowing
# for zero-size tensors whose other dims are huge.
_MAX_ELEMENTS_BOUND = 1 << 62

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class ProtocolError(ValueError):
    """A frame that is not a valid trainmesh PS message (malformed, oversized or forged)."""


class AuthenticationError(ProtocolError):
    """A frame whose HMAC is missing, unexpected or wrong: not from a holder of the secret."""


class MessageType(str, enum.Enum):
    REGISTER = "register"
    INIT = "init"
    PULL = "pull"
    PULL_REPLY = "pull_reply"
    PUSH = "push"
    ACK = "ack"
    CLOCK = "clock"
    HEARTBEAT = "heartbeat"
    EXPORT = "export"
    IMPORT = "import"
    STATS = "stats"
    SHUTDOWN = "shutdown"
    HELLO = "hello"  # the per-connection handshake (session.py)
    CHALLENGE = "challenge"
    AUTH = "auth"
    OK = "ok"
    ERROR = "error"


_MESSAGE_TYPES: dict[str, MessageType] = {t.value: t for t in MessageType}


@dataclass
class Message:
    type: MessageType
    sender: str
    seq: int
    version: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.type) is MessageType:  # the usual case: no Enum lookup (a Python call per message)
            return
        try:
            self.type = MessageType(self.type)
        except ValueError:
            raise ValueError(
                f"unknown message type {self.type!r}; expected one of {[t.value for t in MessageType]}"
            ) from None


def payload_nbytes(msg: Message) -> int:
    """Bytes of tensor data the message carries (without header, padding or HMAC)."""
    return sum(t.numel() * t.element_size() for t in msg.tensors.values())


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _check_secret(secret: bytes | str | None) -> bytes | None:
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, str or None, got {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty (an empty key authenticates nothing)")
    return bytes(secret)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_bytes(name: str, tensor: Any) -> tuple[str, torch.Size, memoryview]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # (cheaper than building tensor.device)
        raise ValueError(f"tensor {name!r} is on {tensor.device}; move it to the CPU before encoding")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} has layout {tensor.layout}; send dense values and indices instead")
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {sorted(DTYPES)}")
    data = tensor.detach() if tensor.requires_grad else tensor  # (numpy() refuses autograd tensors)
    if not data.is_contiguous():
        data = data.contiguous()
    # Few torch calls on the hot path (each one lets another thread take the GIL): numpy's view
    # of the memory, read as bytes. bfloat16 has no numpy dtype: viewed as uint8 first.
    array = data.reshape(-1).view(torch.uint8).numpy() if data.dtype == torch.bfloat16 else data.numpy()
    return dtype_name, tensor.shape, memoryview(array.reshape(-1).view("u1"))


def _pad_header(header: bytes) -> bytes:
    """The JSON header padded with spaces (still valid JSON) so the payload after it starts 8-byte
    aligned in the frame."""
    return header + b" " * (_align(_PREFIX.size + len(header)) - _PREFIX.size - len(header))


def _seal(key: bytes | None, token: bytes | None) -> tuple[int, int]:
    """(flags, trailer bytes) of a frame sealed with ``key`` (HMAC) or ``token`` (session) or neither."""
    if key is not None and token is not None:
        raise ValueError("a frame is sealed with a secret (HMAC) or a session token, not both")
    if token is not None:
        if type(token) is not bytes or len(token) != TOKEN_SIZE:
            raise ValueError(f"a session token is {TOKEN_SIZE} bytes. Received: {token!r:.60}")
        return FLAG_SESSION, TOKEN_SIZE
    return (FLAG_HMAC, HMAC_SIZE) if key else (0, 0)


def frame_flags(data) -> int | None:
    """The flags byte of a frame (or of a message's first part), None when it is too short to have one."""
    first = data[0] if isinstance(data, (list, tuple)) else data
    try:
        view = memoryview(first)
    except TypeError:
        return None
    return view[5] if view.nbytes >= _PREFIX.size and view.ndim == 1 and view.itemsize == 1 else None


def _layout(
    msg: Message, key: bytes | None, max_bytes: int, token: bytes | None = None
) -> tuple[bytes, list[tuple[int, memoryview]], int]:
    """(prefix + header, [(payload offset, tensor bytes)], payload length) of ``msg``, checked."""
    if not isinstance(msg, Message):
        raise TypeError(f"encode expects a Message, got {type(msg).__name__}")
    if not isinstance(msg.sender, str):
        raise TypeError(f"Message.sender must be a str, got {type(msg.sender).__name__}")
    if not _is_int(msg.seq) or msg.seq < 0:
        raise ValueError(f"Message.seq must be an int >= 0, got {msg.seq!r}")
    if not _is_int(msg.version):
        raise ValueError(f"Message.version must be an int, got {msg.version!r}")
    if not isinstance(msg.meta, dict):
        raise TypeError(f"Message.meta must be a dict, got {type(msg.meta).__name__}")
    if not isinstance(msg.tensors, dict):
        raise TypeError(f"Message.tensors must be a dict, got {type(msg.tensors).__name__}")

    specs, segments, offset = [], [], 0
    for name, tensor in msg.tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        dtype_name, shape, raw = _tensor_bytes(name, tensor)
        specs.append({"name": name, "dtype": dtype_name, "shape": list(shape), "offset": offset, "nbytes": raw.nbytes})
        segments.append((offset, raw))
        offset += _align(raw.nbytes)

    kind = msg.type if type(msg.type) is MessageType else MessageType(msg.type)
    header_obj = {
        "type": kind.value,
        "sender": msg.sender,
        "seq": msg.seq,
        "version": msg.version,
        "tensors": specs,
        "meta": msg.meta,
    }
    try:
        header = _JSON_ENCODER.encode(header_obj).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Message.meta must be plain JSON (str/int/float/bool/None/list/dict, no NaN): {exc}") from exc
    header = _pad_header(header)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(
            f"message header is {len(header)} bytes, over the {MAX_HEADER_BYTES} limit "
            f"(too many tensors or too large a meta)"
        )
    flags, trailer = _seal(key, token)
    total = _PREFIX.size + len(header) + offset + trailer
    if total > max_bytes:
        raise ValueError(f"encoded message would be {total} bytes, over max_bytes={max_bytes}")
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(header)) + header
    return head, segments, offset


def encode(
    msg: Message, secret: bytes | str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, *, token: bytes | None = None
) -> bytearray:
    """Serialize `msg` into one new frame; with `secret`, append an HMAC-SHA256 over the frame;
    with ``token`` (a connection's session token, see session.py), append that instead."""
    key = _check_secret(secret)
    head, segments, payload_len = _layout(msg, key, max_bytes, token)
    body_end = len(head) + payload_len
    # One preallocated frame; each tensor's bytes are copied into it once (the padding stays zero).
    frame = bytearray(body_end + _seal(key, token)[1])
    view = memoryview(frame)
    view[: len(head)] = head
    for start, raw in segments:
        view[len(head) + start : len(head) + start + raw.nbytes] = raw
    if key:
        view[body_end:] = hmac.new(key, view[:body_end], hashlib.sha256).digest()
    elif token is not None:
        view[body_end:] = token
    view.release()
    return frame


def encode_parts(
    msg: Message,
    secret: bytes | str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    zero_copy_min_bytes: int = 65536,
    *,
    token: bytes | None = None,
) -> list:
    """`msg` as a list of buffers whose concatenation is exactly ``encode(msg, secret)``.

    Each tensor of at least ``zero_copy_min_bytes`` is its own part, a view of the tensor's
    memory (no copy: ZeroMQ sends it from there as one frame of a multipart message); smaller
    pieces (header, small tensors, padding, HMAC) are copied into shared small parts. The
    caller must not modify such a tensor while the parts are in use."""
    key = _check_secret(secret)
    head, segments, payload_len = _layout(msg, key, max_bytes, token)
    parts: list = []
    small = bytearray(head)
    position = 0  # payload bytes placed so far
    for start, raw in segments:
        small += bytes(start - position)  # the previous segment's zero padding
        if raw.nbytes >= zero_copy_min_bytes:
            parts.append(small)
            parts.append(raw)
            small = bytearray()
        else:
            small += raw
        position = start + raw.nbytes
    small += bytes(payload_len - position)
    if key:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in (*parts, small):
            mac.update(part)
        small += mac.digest()
    elif token is not None:
        small += token
    if small:
        parts.append(small)
    return parts


# One encoder for every frame (json.dumps with options builds a new one per call); the same settings
# as ``json.dumps(allow_nan=False, separators=(",", ":"))``.
_JSON_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
