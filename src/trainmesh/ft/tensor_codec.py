"""A state dict as a JSON header plus raw tensor bytes: what a recovering replica group receives.

torchft's own recovery transports unpickle what a peer sends (its HTTP transport with
``torch.load(weights_only=False)``, its process-group transport with ``pickle.loads`` on the
metadata), so a peer that can reach the port can run code in the receiver. Here the structure
travels as JSON (dicts, lists, tuples, ints, floats, strings, bools, None) and every tensor as its
dtype, shape and bytes: decoding runs no code, and anything else is refused, on both sides.

>>> header, tensors = encode_state({"w": torch.ones(2), "step": 3, "betas": (0.9, 0.99)})
>>> state = decode_state(header, [t.clone() for t in tensors])
>>> state["step"], state["betas"], state["w"].tolist()
(3, (0.9, 0.99), [1.0, 1.0])

No torchft import here: this file is tested, and usable, without it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["encode_state", "decode_state", "parse_header", "tensor_specs", "HEADER_MAGIC", "UnsafeStateError"]

# First bytes of every header: a pickle starts with b"\x80", torch.save's zip with b"PK".
HEADER_MAGIC = b"TMFT1"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
_MAX_HEADER_BYTES = 256 << 20


class UnsafeStateError(ValueError):
    """A recovery stream that is not trainmesh's JSON + tensors format (a pickle, say): refused."""


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise TypeError(
                f"only plain tensors travel in a recovery state (DTensor and subclasses are not "
                f"supported yet). Received: {type(value).__name__}"
            )
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"tensor dtype not supported in a recovery state. Received: {value.dtype}")
        tensors.append(value.detach())
        return {"t": len(tensors) - 1, "dtype": name, "shape": list(value.shape)}
    if isinstance(value, dict):
        return {"d": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "u": [_encode(v, tensors) for v in value]}
    raise TypeError(
        f"a recovery state holds tensors, dicts, lists, tuples and plain scalars only. Received: {type(value).__name__}"
    )


def encode_state(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``(header, tensors)``: the header is ``HEADER_MAGIC`` + JSON naming each tensor's dtype and shape."""
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors)
    header = HEADER_MAGIC + json.dumps({"tree": tree, "num_tensors": len(tensors)}).encode()
    return header, tensors


def parse_header(header: bytes) -> dict[str, Any]:
    """Check and parse a header; raises ``UnsafeStateError`` for anything that is not ours."""
    if len(header) > _MAX_HEADER_BYTES:
        raise UnsafeStateError(f"recovery header too large. Received: {len(header)} bytes")
    if not header.startswith(HEADER_MAGIC):
        raise UnsafeStateError(
            f"recovery stream refused: not a trainmesh JSON header (a pickle or another "
            f"format?). Received first bytes: {bytes(header[:8])!r}"
        )
    try:
        parsed = json.loads(header[len(HEADER_MAGIC) :].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnsafeStateError(f"recovery header is not valid JSON: {error}") from error
    if not isinstance(parsed, dict) or not isinstance(parsed.get("num_tensors"), int) or "tree" not in parsed:
        raise UnsafeStateError(f"recovery header lacks 'tree'/'num_tensors'. Received keys: {list(parsed)[:5]}")
    return parsed


def tensor_specs(parsed: dict[str, Any]) -> list[tuple[torch.dtype, list[int]]]:
    """Each tensor's (dtype, shape), in the order the bytes follow the header."""
    specs: list[Any] = [None] * parsed["num_tensors"]

    def walk(node: Any) -> None:
        if not isinstance(node, dict) or len(node) == 0:
            raise UnsafeStateError(f"malformed recovery header node. Received: {str(node)[:80]}")
        if "t" in node:
            index, dtype, shape = node["t"], node.get("dtype"), node.get("shape")
            if (
                not isinstance(index, int)
                or not 0 <= index < len(specs)
                or dtype not in _DTYPES
                or not isinstance(shape, list)
                or not all(isinstance(s, int) and s >= 0 for s in shape)
            ):
                raise UnsafeStateError(f"malformed tensor entry in recovery header. Received: {str(node)[:80]}")
            specs[index] = (_DTYPES[dtype], shape)
        elif "d" in node:
            for pair in node["d"]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise UnsafeStateError(f"malformed dict entry in recovery header. Received: {str(pair)[:80]}")
                walk(pair[0])
                walk(pair[1])
        elif "l" in node or "u" in node:
            for item in node.get("l", node.get("u")):
                walk(item)
        elif "v" not in node or not (node["v"] is None or isinstance(node["v"], (bool, int, float, str))):
            raise UnsafeStateError(f"unknown node in recovery header. Received: {str(node)[:80]}")

    walk(parsed["tree"])
    if any(s is None for s in specs):
        raise UnsafeStateError("recovery header names fewer tensors than num_tensors")
    return specs


def _decode(node: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    if "v" in node:
        return node["v"]
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    return tuple(_decode(v, tensors) for v in node["u"])


def decode_state(header: bytes, tensors: list[torch.Tensor]) -> Any:
    """The state back from a header and its tensors (already shaped, as ``tensor_specs`` says)."""
    parsed = parse_header(header)
    specs = tensor_specs(parsed)
    if len(tensors) != len(specs):
        raise UnsafeStateError(f"expected {len(specs)} tensors. Received: {len(tensors)}")
    for tensor, (dtype, shape) in zip(tensors, specs):
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            raise UnsafeStateError(
                f"tensor does not match its header. Received: {tensor.dtype} {list(tensor.shape)}, "
                f"expected {dtype} {shape}"
            )
    return _decode(parsed["tree"], tensors)
