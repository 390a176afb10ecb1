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
whitelisted dtype. `decode` raises `ProtocolError` (and nothing else) for any malformed input.
See docs/parameter_server.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
import warnings
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


class _Parts:
    """A message given as several buffers (ZeroMQ frames) read as their concatenation."""

    def __init__(self, parts: list | tuple):
        self.views = []
        for part in parts:
            try:
                self.views.append(memoryview(part).cast("B"))
            except TypeError:
                raise TypeError(f"decode expects bytes, got {type(part).__name__} (or a list of bytes parts)") from None
        self.starts, position = [], 0
        for view in self.views:
            self.starts.append(position)
            position += view.nbytes
        self.nbytes = position

    def read(self, start: int, stop: int) -> tuple[memoryview, bool]:
        """Bytes [start, stop) and whether they are a view of one part (else a copy)."""
        for begin, view in zip(self.starts, self.views):
            if begin <= start and stop <= begin + view.nbytes:
                return view[start - begin : stop - begin], True
        out, position = bytearray(), start
        for begin, view in zip(self.starts, self.views):
            end = begin + view.nbytes
            if end > position and begin < stop:
                out += view[max(position, begin) - begin : min(stop, end) - begin]
        return memoryview(out), False

    def feed(self, mac, stop: int) -> None:
        for begin, view in zip(self.starts, self.views):
            if begin < stop:
                mac.update(view[: min(view.nbytes, stop - begin)])


def decode(
    data,
    secret: bytes | str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    copy: bool = True,
    token: bytes | None = None,
) -> Message:
    """Parse and validate one frame (bytes-like), or a message sent as several parts (a list of
    bytes-like, see ``encode_parts``). Raises ProtocolError for anything malformed or forged.

    The tensors are views of one copy of the payload. ``copy=False`` makes them views of
    ``data`` itself (no copy): only for a reader that never writes to them and drops them
    with the frame (the server's push path); ``data`` may be read-only. ``token``: the frame must
    be sealed with this session token (and not with an HMAC)."""
    key = _check_secret(secret)
    expected_flags, trailer = _seal(key, token)
    parts = _Parts(data if isinstance(data, (list, tuple)) else [data])
    if parts.nbytes > max_bytes:
        raise ProtocolError(f"message of {parts.nbytes} bytes exceeds max_bytes={max_bytes}")
    if parts.nbytes < _PREFIX.size:
        raise ProtocolError(f"message of {parts.nbytes} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, flags, header_len = _PREFIX.unpack_from(parts.read(0, _PREFIX.size)[0], 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ProtocolError(f"unsupported format version {version}, expected {FORMAT_VERSION}")
    if flags != expected_flags:
        if key and not flags & FLAG_HMAC:
            raise AuthenticationError("message has no HMAC but a secret is configured")
        if token is not None and not flags & FLAG_SESSION:
            raise AuthenticationError("message is not sealed with this connection's session token")
        if not key and flags == FLAG_HMAC:
            raise AuthenticationError("message carries an HMAC but no secret is configured")
        if token is None and flags == FLAG_SESSION:
            raise AuthenticationError("message carries a session token but this connection has no session")
        raise ProtocolError(f"unknown flags 0x{flags:02x}")
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")

    body_end = parts.nbytes - trailer
    payload_start = _PREFIX.size + header_len
    if payload_start > body_end:
        raise ProtocolError(f"header length {header_len} runs past the end of a {parts.nbytes}-byte message")
    if key:
        # Authenticate before parsing anything else: forged frames never reach the JSON parser.
        mac = hmac.new(key, digestmod=hashlib.sha256)
        parts.feed(mac, body_end)
        if not hmac.compare_digest(mac.digest(), parts.read(body_end, parts.nbytes)[0]):
            raise AuthenticationError("HMAC mismatch: message was altered or signed with another secret")
    elif token is not None and not hmac.compare_digest(token, bytes(parts.read(body_end, parts.nbytes)[0])):
        raise AuthenticationError("session token mismatch: not this connection's session")

    header = _parse_header(parts.read(_PREFIX.size, payload_start)[0])
    tensors = _decode_tensors(header["tensors"], parts, payload_start, body_end, copy)
    # (_parse_header checked the type is a known value: the member is looked up, not called for)
    return Message(
        type=_MESSAGE_TYPES[header["type"]],
        sender=header["sender"],
        seq=header["seq"],
        version=header["version"],
        tensors=tensors,
        meta=header["meta"],
    )


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"header contains non-JSON constant {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ProtocolError("header JSON has a duplicate key")
    return result


# One encoder and one decoder for every frame (json.dumps/loads with options build new ones per
# call); the same settings as ``json.dumps(allow_nan=False, separators=(",", ":"))`` and
# ``json.loads(parse_constant=..., object_pairs_hook=...)``.
_JSON_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def _parse_header(raw: memoryview) -> dict[str, Any]:
    try:
        header = _JSON_DECODER.decode(str(raw, "utf-8"))
    except ProtocolError:
        raise
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"header is not UTF-8: {exc}") from None
    except RecursionError:
        raise ProtocolError("header JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int strings over Python's digit limit
        raise ProtocolError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    if set(header) != _HEADER_KEYS:
        raise ProtocolError(f"header keys {sorted(header)} != required {sorted(_HEADER_KEYS)}")
    if not isinstance(header["type"], str) or header["type"] not in _MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {header['type']!r}")
    if not isinstance(header["sender"], str):
        raise ProtocolError(f"sender must be a string, got {header['sender']!r}")
    if not _is_int(header["seq"]) or header["seq"] < 0:
        raise ProtocolError(f"seq must be an int >= 0, got {header['seq']!r}")
    if not _is_int(header["version"]):
        raise ProtocolError(f"version must be an int, got {header['version']!r}")
    if not isinstance(header["meta"], dict):
        raise ProtocolError(f"meta must be a JSON object, got {type(header['meta']).__name__}")
    if not isinstance(header["tensors"], list):
        raise ProtocolError(f"tensors must be a list, got {type(header['tensors']).__name__}")
    return header


def _check_spec(spec: Any, expected_offset: int, payload_len: int) -> tuple[str, torch.dtype, list[int], int]:
    if not isinstance(spec, dict) or set(spec) != _TENSOR_KEYS:
        raise ProtocolError(f"tensor entry must be an object with keys {sorted(_TENSOR_KEYS)}, got {spec!r:.200}")
    name, dtype_name, shape, offset, nbytes = (spec[k] for k in ("name", "dtype", "shape", "offset", "nbytes"))
    if not isinstance(name, str):
        raise ProtocolError(f"tensor name must be a string, got {name!r:.100}")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {dtype_name!r:.100} not in {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(
            f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} ints >= 0, got {shape!r:.200}"
        )
    numel = bound = 1  # one loop over the dims, no generator (this runs for every tensor received)
    for d in shape:
        if not _is_int(d) or d < 0:
            raise ProtocolError(
                f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} ints >= 0, got {shape!r:.200}"
            )
        numel *= d
        if d > 1:
            bound *= d
    if bound > _MAX_ELEMENTS_BOUND:
        raise ProtocolError(f"tensor {name!r}: shape {shape} is too large")
    if not _is_int(nbytes) or not _is_int(offset):
        raise ProtocolError(f"tensor {name!r}: offset and nbytes must be ints, got {offset!r}, {nbytes!r}")
    dtype = DTYPES[dtype_name]
    if nbytes != numel * dtype.itemsize:
        raise ProtocolError(f"tensor {name!r}: nbytes {nbytes} != prod({shape}) * {dtype.itemsize}")
    # Segments are laid out back to back, each at the next 8-byte boundary: anything else
    # (overlap, gap, misalignment) is a malformed frame.
    if offset != expected_offset:
        raise ProtocolError(f"tensor {name!r}: offset {offset}, expected {expected_offset}")
    if offset + nbytes > payload_len:
        raise ProtocolError(
            f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) beyond the {payload_len}-byte payload"
        )
    return name, dtype, shape, nbytes


def _decode_tensors(
    specs: list[Any], parts: _Parts, payload_start: int, body_end: int, copy: bool
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    placed: list[tuple[str, torch.dtype, list[int], int, int]] = []
    offset, payload_len = 0, body_end - payload_start
    for spec in specs:
        name, dtype, shape, nbytes = _check_spec(spec, offset, payload_len)
        if name in tensors:
            raise ProtocolError(f"duplicate tensor name {name!r}")
        end = offset + nbytes
        if _align(end) > end and any(parts.read(payload_start + end, payload_start + _align(end))[0]):
            raise ProtocolError(f"tensor {name!r}: non-zero padding bytes")
        tensors[name] = None  # placeholder: names are checked for duplicates as we go
        placed.append((name, dtype, shape, offset, nbytes))
        offset = _align(end)
    if offset != payload_len:
        raise ProtocolError(f"payload is {payload_len} bytes but its tensors (padded to 8 bytes) take {offset}")
    if not payload_len:
        return {name: torch.empty(shape, dtype=dtype) for name, dtype, shape, _, _ in placed}
    if copy or len(parts.views) == 1:
        # Every tensor is a view of one byte tensor over the payload (offsets are 8-byte aligned)
        # and keeps it alive: by default one copy into a fresh (aligned, writable) buffer; with
        # copy=False the frame itself, unless its memory is not 8-byte aligned.
        payload, _ = parts.read(payload_start, body_end)
        base = None if copy else _view(payload)
        if base is None:
            base = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for name, dtype, shape, offset, nbytes in placed:
            tensors[name] = _typed(base[offset : offset + nbytes], dtype, shape)
        return tensors
    # Several parts, no copy: a tensor that is one part (how encode_parts sends a large one) is a
    # view of it; anything else (small tensors sharing a part, an odd split) is copied alone.
    for name, dtype, shape, offset, nbytes in placed:
        raw, whole = parts.read(payload_start + offset, payload_start + offset + nbytes)
        # Viewed in its own dtype at once (one torch call, not a byte view and then a dtype view).
        typed = _view(raw, dtype) if whole and nbytes else None
        if typed is None:
            base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            typed = _typed(base, dtype, [-1])
        tensors[name] = typed if len(shape) == 1 else typed.view(shape)
    return tensors


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The uint8 tensor ``raw`` read as ``dtype`` in ``shape`` (a 1-D result needs no reshape)."""
    typed = raw if dtype == torch.uint8 else raw.view(dtype)
    return typed if len(shape) == 1 else typed.view(shape)


_readonly_warning_spent = False  # torch's read-only-buffer warning has fired (it fires once per process)


def _view(raw: memoryview, dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
    """A 1-D ``dtype`` tensor over ``raw`` (a whole number of elements) without a copy, or None
    when its memory is not 8-byte aligned."""
    global _readonly_warning_spent
    if _readonly_warning_spent or not raw.readonly:
        base = torch.frombuffer(raw, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # Viewing a read-only frame is the point here (its readers never write to it); torch
            # warns about that once per process, so only the first view needs the filter (a
            # catch_warnings per frame cost more than the rest of the view).
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(raw, dtype=dtype)
        _readonly_warning_spent = True
    return None if base.data_ptr() % _ALIGN else base
