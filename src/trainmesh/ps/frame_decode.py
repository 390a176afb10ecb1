"""Reading a parameter-server frame back: validation first, then tensors as views of the payload.

The frame format and the writing side are in ``protocol.py``. ``decode`` here checks a frame in the
order that keeps forged or malformed input away from everything costly: lengths and flags, then
the seal (HMAC or session token) before the JSON parser sees a byte, then the header's keys and
types, then each tensor's dtype, shape, offset and padding. It raises ``ProtocolError`` (and
nothing else) for any malformed input, and a frame from the network can only ever become strings,
numbers and tensors of a whitelisted dtype.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import warnings
from typing import Any

import torch

from .protocol import (
    _ALIGN,
    _HEADER_KEYS,
    _MAX_ELEMENTS_BOUND,
    _MESSAGE_TYPES,
    _PREFIX,
    _TENSOR_KEYS,
    DEFAULT_MAX_BYTES,
    DTYPES,
    FLAG_HMAC,
    FLAG_SESSION,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    AuthenticationError,
    Message,
    ProtocolError,
    _align,
    _check_secret,
    _is_int,
    _seal,
)


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


# One decoder for every frame (json.loads with options builds a new one per call); the same settings
# as ``json.loads(parse_constant=..., object_pairs_hook=...)``.
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
