"""Turn a text corpus (or token arrays) into a directory of token shards for ``TokenShardDataset``.

Layout of the directory::

    shard_00000.bin   raw little-endian uint16/uint32 tokens (or shard_00000.npy)
    shard_00001.bin
    index.json        format, dtype, vocab_size, per-shard token counts and sha256, total, tokenizer

``index.json`` is the completion marker: it is written last, to a temporary name, flushed to
disk and renamed into place, so a directory whose writer crashed half-way has no index and
is rejected by the reader instead of being trained on with shards missing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

INDEX_NAME = "index.json"
INDEX_VERSION = 1
FORMATS = ("bin", "npy")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; always little-endian on disk."""
    if not 1 <= int(vocab_size) <= 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32]. Received: vocab_size={vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(i: int, fmt: str) -> str:
    return f"shard_{i:05d}.{fmt}"


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """sha256 of a file read in chunks, so hashing a large shard never holds it in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class _ShardSink:
    """Fills one fixed-size buffer and flushes it as the next shard whenever it is full.

    Buffering a whole shard (2-4 MiB at the default size) lets ``.npy`` shards, whose header
    holds the length, be written in one go, and keeps memory bounded for any corpus size.
    """

    def __init__(self, out_dir: Path, fmt: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.fmt, self.dtype = out_dir, fmt, dtype
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.filled = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), len(self.buffer) - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == len(self.buffer):
                self.flush()

    def flush(self) -> None:
        if not self.filled:
            return
        name = shard_name(len(self.shards), self.fmt)
        path = self.out_dir / name
        data = self.buffer[: self.filled]
        with open(path, "wb") as fh:
            if self.fmt == "npy":
                np.save(fh, data, allow_pickle=False)
            else:
                fh.write(data.tobytes())  # dtype is explicitly little-endian: bytes are portable
            fh.flush()
            os.fsync(fh.fileno())  # the index must never describe bytes still in the page cache only
        self.shards.append({"file": name, "tokens": int(self.filled), "sha256": file_sha256(path)})
        self.filled = 0


def _as_tokens(item: Any, tokenizer: Callable[[str], Sequence[int]] | None, vocab_size: int, dtype, index: int):
    if isinstance(item, str):
        if tokenizer is None:
            raise ValueError(f"Item {index} is text but no tokenizer was given. Received: tokenizer=None")
        item = tokenizer(item)
    if hasattr(item, "numpy") and callable(item.numpy):  # a torch tensor, without importing torch
        item = item.detach().cpu().numpy() if hasattr(item, "detach") else item.numpy()
    ids = np.asarray(item)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(
            f"Item {index} must be text or a 1-D integer token array. Received: shape={ids.shape}, dtype={ids.dtype}"
        )
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"Item {index} has token id {bad} outside [0, vocab_size={vocab_size}).")
    return ids.astype(dtype, copy=False)


def _describe(tokenizer: Any) -> str:
    if tokenizer is None:
        return "pre-tokenized"
    return getattr(tokenizer, "__qualname__", None) or type(tokenizer).__qualname__


def write_token_shards(
    texts_or_token_arrays: Iterable[str | Sequence[int] | np.ndarray],
    out_dir: str | os.PathLike,
    *,
    vocab_size: int,
    tokenizer: Callable[[str], Sequence[int]] | None = None,
    shard_tokens: int = 1 << 20,
    format: str = "bin",  # noqa: A002 - the issue's name for it
    eot_id: int | None = None,
    tokenizer_description: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the items (texts, tokenized by ``tokenizer``, or token arrays) as shards; return the index.

    Items are concatenated in order (``eot_id``, when given, is appended after each one) and cut
    every ``shard_tokens`` tokens. The items are consumed as a stream, so a generator over a
    corpus larger than memory works.

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> write_token_shards([[1, 2, 3], [4, 5]], out, vocab_size=8, shard_tokens=4)["shard_tokens"]
    [4, 1]
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}. Received: format={format!r}")
    if int(shard_tokens) < 1:
        raise ValueError(f"shard_tokens must be >= 1. Received: shard_tokens={shard_tokens}")
    dtype = token_dtype(vocab_size)
    if eot_id is not None and not 0 <= eot_id < vocab_size:
        raise ValueError(f"eot_id must be in [0, vocab_size={vocab_size}). Received: eot_id={eot_id}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / INDEX_NAME
    if index_path.exists():
        if not overwrite:
            raise FileExistsError(
                f"{str(index_path)!r} exists: the directory already holds complete shards "
                "(pass overwrite=True to replace them)"
            )
        # Remove the marker first: a crash during the rewrite must leave an incomplete directory.
        index_path.unlink()
    for stale in out.glob("shard_*.*"):
        stale.unlink()

    sink = _ShardSink(out, format, dtype, int(shard_tokens))
    eot = None if eot_id is None else np.array([eot_id], dtype=dtype)
    for i, item in enumerate(texts_or_token_arrays):
        sink.add(_as_tokens(item, tokenizer, vocab_size, dtype, i))
        if eot is not None:
            sink.add(eot)
    sink.flush()
    if not sink.shards:
        raise ValueError("No tokens to write: the input was empty.")

    index = {
        "version": INDEX_VERSION,
        "format": format,
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": int(vocab_size),
        "shard_tokens": [s["tokens"] for s in sink.shards],
        "total_tokens": sum(s["tokens"] for s in sink.shards),
        "shards": sink.shards,
        "tokenizer": tokenizer_description if tokenizer_description is not None else _describe(tokenizer),
    }
    _write_atomically(index_path, json.dumps(index, indent=1))
    return index


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see no index or the whole index
    try:  # make the rename itself durable; not possible (nor needed) on every platform
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def write_char_shards(text: str, out_dir: str | os.PathLike, vocab: Any, **kwargs: Any) -> dict[str, Any]:
    """Shards of ``text`` encoded by a character vocabulary (the demo's ``CharVocab``).

    The vocabulary's JSON goes into the index as the tokenizer description, so the shards
    can be decoded without the corpus. Extra keyword arguments go to ``write_token_shards``.
    """
    ids = vocab.encode(text)
    description = "char:" + vocab.to_json() if hasattr(vocab, "to_json") else "char"
    return write_token_shards([ids], out_dir, vocab_size=len(vocab), tokenizer_description=description, **kwargs)
