"""PS wire format: round trips, HMAC, limits, and a seeded fuzz test that decode only ever
raises ProtocolError."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import struct
import time
import warnings

import pytest
import torch

from trainmesh.ps.protocol import (
    DTYPES,
    MAX_HEADER_BYTES,
    Message,
    MessageType,
    ProtocolError,
    encode,
    encode_parts,
    payload_nbytes,
)
from trainmesh.ps.frame_decode import decode

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("serial")]

SECRET = b"test-secret"


def _frame(header, payload: bytes = b"", flags: int = 0, header_bytes: bytes | None = None) -> bytes:
    """Build a frame by hand (correct prefix and lengths) around an arbitrary header."""
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    return b"TMPS" + struct.pack("<BBI", 1, flags, len(raw)) + raw + payload


def _header(**overrides):
    header = {"type": "push", "sender": "w0", "seq": 1, "version": 0, "tensors": [], "meta": {}}
    header.update(overrides)
    return header


def _spec(name="g", dtype="float32", shape=(2,), offset=0, nbytes=8):
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included), dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


def _random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_round_trip_every_dtype_and_shape(dtype_name):
    dtype = DTYPES[dtype_name]
    rng = random.Random(dtype_name)
    tensors = {f"t{i}": _random_tensor(rng, dtype) for i in range(6)}
    tensors["scalar"] = torch.tensor(3, dtype=dtype)
    tensors["empty"] = torch.empty(0, 7, dtype=dtype)
    tensors["odd"] = torch.ones(3, dtype=dtype)  # needs padding to the 8-byte boundary
    msg = Message(MessageType.PUSH, "worker-3", 17, version=5, tensors=tensors)
    for secret in (None, SECRET):
        out = decode(encode(msg, secret), secret)
        assert out.type is MessageType.PUSH and out.sender == "worker-3" and out.seq == 17 and out.version == 5
        assert list(out.tensors) == list(tensors)
        for name, tensor in tensors.items():
            assert _same_tensor(out.tensors[name], tensor), name


def test_bfloat16_bits_preserved_including_nan_and_inf():
    bits = torch.tensor([0x7FC1, 0x7F80, -0x0080, 0x0001, 0x3F80], dtype=torch.int16)
    value = bits.view(torch.bfloat16)
    out = decode(encode(Message("push", "w", 0, tensors={"b": value}))).tensors["b"]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), bits)


def test_meta_and_all_message_types_round_trip():
    meta = {
        "shards": ["emb#0", "emb#1"],
        "rows": {"emb#0": "rows0"},
        "lr": 0.01,
        "clock": 3,
        "flag": True,
        "none": None,
        "nested": {"a": [1, [2, {"b": "é"}]]},
    }
    for msg_type in MessageType:
        out = decode(encode(Message(msg_type.value, "s", 2**40, version=-1, meta=meta)))
        assert out.type is msg_type and out.meta == meta and out.seq == 2**40 and out.version == -1
        assert out.tensors == {}


def test_decoded_tensors_own_separate_writable_memory():
    msg = Message("pull_reply", "server-0", 1, tensors={"a": torch.zeros(4), "b": torch.zeros(4)})
    out = decode(encode(msg))
    out.tensors["a"].add_(1.0)  # would fail or warn on a read-only frame buffer
    assert torch.equal(out.tensors["b"], torch.zeros(4))
    assert torch.equal(msg.tensors["a"], torch.zeros(4))


def test_decode_without_copy_views_the_frame_and_with_copy_does_not():
    msg = Message("push", "w", 1, tensors={"a": torch.arange(3.0), "ids": torch.tensor([7, 8])})
    frame = encode(msg)
    assert isinstance(frame, bytearray) and len(frame) % 8 == 0
    viewed, copied = decode(frame, copy=False), decode(frame)
    frame[-8:] = torch.tensor([9], dtype=torch.int64).numpy().tobytes()  # the last payload bytes: ids[1]
    assert viewed.tensors["ids"].tolist() == [7, 9]  # a view of the frame: no copy made
    assert copied.tensors["ids"].tolist() == [7, 8]  # its own memory
    assert torch.equal(viewed.tensors["a"], torch.arange(3.0))
    read_only = decode(bytes(encode(msg)), copy=False)  # bytes frames (what ZeroMQ hands over) work too
    assert torch.equal(read_only.tensors["ids"], torch.tensor([7, 8]))


def test_decoding_read_only_frames_in_place_never_warns():
    # The server views ZeroMQ's read-only buffers in place, many times a second: torch's warning
    # about read-only memory must never reach the caller, on the first frame or any later one.
    grad = torch.arange(20000.0)  # 80,000 bytes: its own part
    parts = [bytes(part) for part in encode_parts(Message("push", "w", 1, tensors={"g": grad}))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert torch.equal(decode(parts, copy=False).tensors["g"], grad)


def _mixed_message() -> Message:
    """Large tensors (their own parts), small ones and odd sizes (padding) in one push."""
    big = torch.arange(40000, dtype=torch.float32)  # 160,000 bytes: over the zero-copy threshold
    odd = torch.arange(20001, dtype=torch.int8)  # 20,001 bytes: under it, 7 bytes of padding follow
    return Message(
        "push",
        "w",
        3,
        tensors={
            "small": torch.ones(3, dtype=torch.int8),
            "big": big,
            "odd": odd,
            "big2": big.flip(0).contiguous(),
            "last": torch.ones(1),
        },
        meta={"shards": ["big"]},
    )


@pytest.mark.parametrize("secret", [None, SECRET])
def test_encode_parts_concatenate_to_the_frame_and_send_large_tensors_without_a_copy(secret):
    msg = _mixed_message()
    parts = encode_parts(msg, secret, zero_copy_min_bytes=65536)
    assert b"".join(parts) == encode(msg, secret)
    # The two large tensors are parts of their own, views of the tensors' memory (no copy).
    pointers = [torch.frombuffer(p, dtype=torch.uint8).data_ptr() for p in parts if memoryview(p).nbytes == 160000]
    assert pointers == [msg.tensors["big"].data_ptr(), msg.tensors["big2"].data_ptr()]
    viewed, copied = decode(parts, secret, copy=False), decode(parts, secret)
    for name, tensor in msg.tensors.items():
        assert torch.equal(viewed.tensors[name], tensor) and torch.equal(copied.tensors[name], tensor)
    assert viewed.tensors["big"].data_ptr() == msg.tensors["big"].data_ptr()  # decoded in place
    assert copied.tensors["big"].data_ptr() != msg.tensors["big"].data_ptr()
    assert viewed.meta == msg.meta and viewed.seq == 3


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_frame_split_anywhere_decodes_like_the_frame_and_a_changed_part_is_refused(secret):
    frame = bytes(encode(_mixed_message(), secret))
    whole = decode(frame, secret)
    rng = random.Random(5)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(frame)), rng.randint(1, 6)))
        parts = [frame[a:b] for a, b in zip([0, *cuts], [*cuts, len(frame)])]
        for copy in (True, False):
            out = decode(parts, secret, copy=copy)
            assert all(torch.equal(out.tensors[k], v) for k, v in whole.tensors.items())
    parts = encode_parts(_mixed_message(), secret)
    parts[1] = bytes(parts[1][:-4]) + b"\x01\x02\x03\x04"  # one large part altered in transit
    if secret:
        with pytest.raises(ProtocolError, match="HMAC"):
            decode(parts, secret)
    else:  # without a secret only the framing is checked: the altered bytes decode as data
        assert not torch.equal(decode(parts).tensors["big"], _mixed_message().tensors["big"])
    with pytest.raises(ProtocolError):
        decode([*encode_parts(_mixed_message(), secret), b"x"], secret)  # a stray trailing part


def test_non_contiguous_and_grad_tensors_are_encoded_by_value():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    leaf = torch.ones(2, requires_grad=True)
    window = base.reshape(-1)[5:9]  # contiguous, but starts inside its storage
    out = decode(encode(Message("push", "w", 0, tensors={"t": base.t(), "leaf": leaf, "window": window})))
    assert torch.equal(out.tensors["t"], base.t())
    assert torch.equal(out.tensors["window"], torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert torch.equal(out.tensors["leaf"], torch.ones(2)) and not out.tensors["leaf"].requires_grad


def test_payload_is_aligned_and_counted():
    msg = Message("push", "w", 0, tensors={"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5)})
    assert payload_nbytes(msg) == 3 + 20
    data = encode(msg)
    header_len = struct.unpack_from("<I", data, 6)[0]
    assert (10 + header_len) % 8 == 0
    specs = json.loads(data[10 : 10 + header_len])["tensors"]
    assert [s["offset"] for s in specs] == [0, 8]
    assert len(data) == 10 + header_len + 8 + 24


def test_encode_rejects_bad_messages_with_clear_errors():
    with pytest.raises(ValueError, match="unknown message type 'bogus'"):
        Message("bogus", "w", 0)
    with pytest.raises(ValueError, match="seq must be an int >= 0, got -1"):
        encode(Message("push", "w", -1))
    with pytest.raises(TypeError, match="sender must be a str"):
        encode(Message("push", 7, 0))
    with pytest.raises(ValueError, match="dtype torch.complex64"):
        encode(Message("push", "w", 0, tensors={"c": torch.zeros(2, dtype=torch.complex64)}))
    with pytest.raises(ValueError, match="layout torch.sparse_coo"):
        encode(Message("push", "w", 0, tensors={"s": torch.eye(2).to_sparse()}))
    with pytest.raises(ValueError, match="is on meta"):
        encode(Message("push", "w", 0, tensors={"m": torch.empty(2, device="meta")}))
    with pytest.raises(TypeError, match="tensor 'x' must be a torch.Tensor"):
        encode(Message("push", "w", 0, tensors={"x": [1.0]}))
    with pytest.raises(ValueError, match="plain JSON"):
        encode(Message("push", "w", 0, meta={"s": {1, 2}}))
    with pytest.raises(ValueError, match="plain JSON"):
        encode(Message("push", "w", 0, meta={"lr": float("nan")}))
    with pytest.raises(ValueError, match="over max_bytes=100"):
        encode(Message("push", "w", 0, tensors={"g": torch.zeros(100)}), max_bytes=100)
    with pytest.raises(ValueError, match="header is .* over the"):
        encode(Message("push", "w", 0, meta={"big": "x" * MAX_HEADER_BYTES}))
    with pytest.raises(ValueError, match="secret must not be empty"):
        encode(Message("push", "w", 0), b"")


def test_hmac_accepts_the_right_secret_and_rejects_everything_else():
    msg = Message("push", "w", 4, tensors={"g": torch.randn(16)}, meta={"lr": 0.1})
    signed = encode(msg, SECRET)
    assert torch.equal(decode(signed, SECRET).tensors["g"], msg.tensors["g"])
    assert torch.equal(decode(signed, SECRET.decode()).tensors["g"], msg.tensors["g"])  # str secret
    with pytest.raises(ProtocolError, match="HMAC mismatch"):
        decode(signed, b"other-secret")
    for position in (0 + 12, len(signed) // 2, len(signed) - 33, len(signed) - 1):
        tampered = bytearray(signed)
        tampered[position] ^= 0x01
        with pytest.raises(ProtocolError):
            decode(bytes(tampered), SECRET)
    with pytest.raises(ProtocolError, match="no HMAC but a secret is configured"):
        decode(encode(msg), SECRET)
    with pytest.raises(ProtocolError, match="carries an HMAC but no secret"):
        decode(signed)
    # Stripping the MAC and clearing the flag does not help a forger.
    stripped = bytearray(signed[:-32])
    stripped[5] = 0
    with pytest.raises(ProtocolError, match="no HMAC"):
        decode(bytes(stripped), SECRET)


def test_size_limits():
    data = encode(Message("push", "w", 0, tensors={"g": torch.zeros(1000)}))
    assert decode(data, max_bytes=len(data)).tensors["g"].numel() == 1000
    with pytest.raises(ProtocolError, match="exceeds max_bytes"):
        decode(data, max_bytes=len(data) - 1)
    huge_header_len = b"TMPS" + struct.pack("<BBI", 1, 0, MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(ProtocolError, match="header length"):
        decode(huge_header_len)
    with pytest.raises(ProtocolError, match="runs past the end"):
        decode(b"TMPS" + struct.pack("<BBI", 1, 0, 100) + b"{}")


def test_large_tensor_encodes_and_decodes_quickly():
    tensor = torch.randn(4 * 1024 * 1024)  # 16 MiB
    msg = Message("push", "w", 0, tensors={"g": tensor})
    start = time.perf_counter()
    out = decode(encode(msg))
    elapsed = time.perf_counter() - start
    assert torch.equal(out.tensors["g"], tensor)
    assert elapsed < 2.0, f"16 MiB encode+decode took {elapsed:.2f}s"


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "shorter than"),
        (b"XXXX" + struct.pack("<BBI", 1, 0, 2) + b"{}", "bad magic"),
        (b"TMPS" + struct.pack("<BBI", 2, 0, 2) + b"{}", "format version 2"),
        (b"TMPS" + struct.pack("<BBI", 1, 0x80, 2) + b"{}", "unknown flags"),
        (_frame(None, header_bytes=b"\xff\xfe{}"), "not UTF-8"),
        (_frame(None, header_bytes=b"{"), "not valid JSON"),
        (_frame(None, header_bytes=b"[" * 100_000 + b"]" * 100_000), "JSON|nested"),
        (_frame(None, header_bytes=b'{"seq": ' + b"9" * 5000 + b"}"), "not valid JSON"),
        (_frame(None, header_bytes=b'{"seq": NaN}'), "non-JSON constant"),
        (_frame(None, header_bytes=b'{"a": 1, "a": 2}'), "duplicate key"),
        (_frame([1, 2]), "must be a JSON object"),
        (_frame({"type": "push"}), "header keys"),
        (_frame(_header(extra=1)), "header keys"),
        (_frame(_header(type="launch")), "unknown message type"),
        (_frame(_header(sender=5)), "sender"),
        (_frame(_header(seq=-1)), "seq"),
        (_frame(_header(seq=True)), "seq"),
        (_frame(_header(version=1.5)), "version"),
        (_frame(_header(meta=[])), "meta must be a JSON object"),
        (_frame(_header(tensors={})), "tensors must be a list"),
        (_frame(_header(tensors=[7])), "tensor entry"),
        (_frame(_header(tensors=[_spec(dtype="object")]), bytes(8)), "dtype 'object'"),
        (_frame(_header(tensors=[_spec(shape=(-2,), nbytes=-8)]), bytes(8)), "shape"),
        (_frame(_header(tensors=[_spec(shape=(1.0,), nbytes=4)]), bytes(8)), "shape"),
        (_frame(_header(tensors=[_spec(shape=[1] * 33, nbytes=4)]), bytes(8)), "shape"),
        (_frame(_header(tensors=[_spec(shape=(0, 2**40, 2**40), nbytes=0)])), "too large"),
        (_frame(_header(tensors=[_spec(nbytes=12)]), bytes(16)), "nbytes 12"),
        (_frame(_header(tensors=[_spec(offset=8)]), bytes(16)), "offset 8, expected 0"),
        (_frame(_header(tensors=[_spec(), _spec(name="h", offset=4)]), bytes(16)), "offset 4, expected 8"),
        (_frame(_header(tensors=[_spec(), _spec(offset=8)]), bytes(16)), "duplicate tensor name"),
        (_frame(_header(tensors=[_spec(shape=(4,), nbytes=16)]), bytes(8)), "beyond"),
        (_frame(_header(tensors=[_spec(shape=(1,), nbytes=4)]), bytes(4) + b"\x01" + bytes(3)), "padding"),
        (_frame(_header(tensors=[_spec()]), bytes(16)), "payload is 16 bytes"),
        (_frame(_header(), b"junk"), "payload is 4 bytes"),
    ],
)
def test_malformed_frames_raise_protocol_error(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_decode_rejects_non_bytes_with_type_error():
    with pytest.raises(TypeError, match="decode expects bytes, got str"):
        decode("TMPS")


def _assert_valid_or_protocol_error(data: bytes, secret=None) -> bool:
    """The property: ProtocolError, or a Message that re-encodes to an equivalent one; the
    zero-copy decode (the server's) accepts and rejects exactly the same frames."""
    try:
        msg = decode(data, secret)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            decode(data, secret, copy=False)
        return False
    viewed = decode(data, secret, copy=False)
    assert viewed.meta == msg.meta and list(viewed.tensors) == list(msg.tensors)
    assert all(_same_tensor(viewed.tensors[k], v) for k, v in msg.tensors.items())
    assert isinstance(msg, Message) and isinstance(msg.meta, dict)
    again = decode(encode(msg, secret), secret)
    assert again.meta == msg.meta and list(again.tensors) == list(msg.tensors)
    assert all(_same_tensor(again.tensors[k], v) for k, v in msg.tensors.items())
    return True


def _valid_frames(rng: random.Random, secret) -> list[bytes]:
    frames = []
    for i in range(12):
        dtypes = rng.sample(sorted(DTYPES.values(), key=str), rng.randint(0, 3))
        tensors = {f"p{j}#{i}": _random_tensor(rng, dt) for j, dt in enumerate(dtypes)}
        msg = Message(
            rng.choice(list(MessageType)),
            f"w{i}",
            rng.randrange(100),
            tensors=tensors,
            meta={"shards": list(tensors), "clock": i},
        )
        frames.append(encode(msg, secret))
    return frames


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and buf:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del buf[rng.randrange(len(buf) + 1) :]
    elif kind == 2:  # append junk
        buf += rng.randbytes(rng.randint(1, 32))
    elif kind == 3 and buf:  # insert or delete a run in the middle
        at = rng.randrange(len(buf))
        if rng.random() < 0.5:
            buf[at:at] = rng.randbytes(rng.randint(1, 16))
        else:
            del buf[at : at + rng.randint(1, 16)]
    else:  # set the header length field to something random
        buf[6:10] = struct.pack("<I", rng.choice([0, 1, len(buf), rng.randrange(1 << 32)]))
    return bytes(buf)


def _random_json(rng: random.Random, depth: int = 0):
    makers = [
        lambda: None,
        lambda: True,
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.uniform(-1e3, 1e3),
        lambda: "x" * rng.randint(0, 3),
        lambda: rng.choice([0, 1, -1, 8, 2**63]),
        lambda: rng.choice(list(DTYPES) + ["push", "float128"]),
    ]
    if depth < 3:
        makers += [
            lambda: [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {str(k): _random_json(rng, depth + 1) for k in range(rng.randint(0, 3))},
        ]
    return rng.choice(makers)()


def _mutate_header(rng: random.Random, data: bytes) -> bytes:
    """Replace one value anywhere in a valid header: exercises the field checks, not the JSON parser."""
    header_len = struct.unpack_from("<I", data, 6)[0]
    header = json.loads(data[10 : 10 + header_len])
    payload = data[10 + header_len :]
    # Half the time aim at the tensor specs, where the layout checks live.
    node, key = header, "tensors" if header["tensors"] and rng.random() < 0.5 else rng.choice(list(header))
    while isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.7:
        node = node[key]
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
    node[key] = _random_json(rng)
    return _frame(header, payload)


def _sign(frame: bytes, secret: bytes) -> bytes:
    body = frame[:5] + b"\x01" + frame[6:]
    return body + hmac.new(secret, body, hashlib.sha256).digest()


@pytest.mark.timeout(60)
def test_fuzz_decode_only_raises_protocol_error():
    rng = random.Random(20240611)
    deadline = time.monotonic() + 20.0  # bound the run time on a slow machine
    tried = accepted = 0
    for secret in (None, SECRET):
        seeds = _valid_frames(rng, secret)
        unsigned = _valid_frames(rng, None)
        for i in range(2500):
            if time.monotonic() > deadline:
                break
            kind = i % 5
            if kind == 0:
                data = rng.randbytes(rng.randint(0, 64))
            elif kind == 1:  # a valid prefix followed by random bytes
                body = rng.randbytes(rng.randint(0, 64))
                data = b"TMPS" + struct.pack("<BBI", 1, 1 if secret else 0, rng.randint(0, len(body))) + body
            elif kind == 2:
                data = _mutate(rng, rng.choice(seeds))
            elif kind == 3:
                data = _mutate(rng, _mutate(rng, rng.choice(seeds)))
            else:  # a broken header behind a valid HMAC
                data = _mutate_header(rng, rng.choice(unsigned))
                if secret:
                    data = _sign(data, secret)
            tried += 1
            accepted += _assert_valid_or_protocol_error(data, secret)
        for frame in seeds:  # unmutated frames still decode
            assert _assert_valid_or_protocol_error(frame, secret)
    assert tried >= 1000, f"only {tried} fuzz cases ran before the time bound"
    assert accepted < tried  # the mutations really produced invalid frames
