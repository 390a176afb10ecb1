"""The demo's text: this interpreter's own standard-library ``.py`` sources, offline and deterministic.

Every machine that can run trainmesh has a Python standard library, so the demo needs no
download. For one Python installation everything here is a pure function of its arguments:
the file list is sorted, the selection is a fixed stride through it, the vocabulary is a
sorted character set, and the windows are cut at fixed offsets. Every process of a job
therefore builds the same corpus without talking to the others.
"""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset

# Decoded in place of ids that no character maps to (and printed for characters the
# vocabulary does not know), so a decoded sample shows where information was lost.
UNKNOWN_CHAR = "\ufffd"
UNKNOWN_ID = 0


def stdlib_dir() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def select_sources(root: Path, char_budget: int, max_file_chars: int) -> list[Path]:
    """The stdlib's top-level modules to read, in order: a fixed stride through the sorted list.

    Taking the first files alphabetically would fill the budget with ``_py*`` and ``a..c``
    modules; striding by ``(capped) total size / budget`` samples the whole alphabet instead,
    so the held-out files (the last ones) come from different modules than the training files.
    """
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"No .py files in the standard library directory {str(root)!r}")
    # Bytes approximate characters well enough here: the sources are almost all ASCII.
    total = sum(min(p.stat().st_size, max_file_chars) for p in files)
    stride = max(1, total // max(1, char_budget))
    return files[::stride]


def read_sources(files: Sequence[Path], char_budget: int, max_file_chars: int) -> list[str]:
    """The texts of ``files``, each cut to ``max_file_chars`` at a line end, stopping at ``char_budget``.

    The per-file cap keeps one large module (``_pydecimal`` is ~230k characters) from
    dominating the corpus.
    """
    texts: list[str] = []
    used = 0
    for path in files:
        if used >= char_budget:
            break
        # errors="replace": a stray undecodable byte must not make the demo machine-dependent.
        text = path.read_text(encoding="utf-8", errors="replace")
        limit = min(max_file_chars, char_budget - used)
        if len(text) > limit:
            cut = text.rfind("\n", 0, limit)
            text = text[: cut + 1 if cut > 0 else limit]
        texts.append(text)
        used += len(text)
    return texts


class CharVocab:
    """Characters <-> ids. Id 0 is the unknown character; the others are a sorted character set.

    >>> vocab = CharVocab("ba")
    >>> vocab.encode("abz").tolist(), vocab.decode([1, 2, 0])
    ([1, 2, 0], 'ab\\ufffd')
    """

    def __init__(self, chars: str | Sequence[str]):
        self.chars: list[str] = sorted(set(chars) - {UNKNOWN_CHAR})
        self._ids = {c: i + 1 for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str, min_count: int = 1) -> "CharVocab":
        """The characters that occur at least ``min_count`` times (rarer ones become unknown)."""
        counts = Counter(text)
        return cls([c for c, n in counts.items() if n >= min_count])

    def __len__(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        """A 1-D int64 tensor of ids."""
        get = self._ids.get
        return torch.tensor([get(c, UNKNOWN_ID) for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        chars = self.chars
        return "".join(chars[i - 1] if 0 < i <= len(chars) else UNKNOWN_CHAR for i in ids)

    def to_json(self) -> str:
        """Saved next to a checkpoint so the model can be sampled later without the corpus."""
        return json.dumps({"unknown_id": UNKNOWN_ID, "chars": self.chars}, ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str) -> "CharVocab":
        return cls(json.loads(text)["chars"])


class CharWindows(Dataset):
    """``(input, target)`` pairs of ``block_size`` ids, the target shifted one character ahead.

    Window ``i`` starts at ``i * stride``; ``stride == block_size`` (the default) gives
    non-overlapping windows, so an epoch sees every character once.
    """

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1. Received: {block_size}")
        stride = block_size if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be >= 1. Received: {stride}")
        if len(ids) < block_size + 1:
            raise ValueError(f"Need at least block_size + 1 = {block_size + 1} ids. Received: {len(ids)}")
        self.ids = ids.to(torch.long)
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.ids) - 1 - self.block_size) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class Corpus:
    """The demo's text, split by file: the last ``heldout_fraction`` of the files are held out."""

    train_text: str
    heldout_text: str
    vocab: CharVocab
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]

    def datasets(self, block_size: int) -> tuple[CharWindows, CharWindows]:
        """Non-overlapping training and held-out windows."""
        return (
            CharWindows(self.vocab.encode(self.train_text), block_size),
            CharWindows(self.vocab.encode(self.heldout_text), block_size),
        )


def build_corpus(
    char_budget: int = 1_500_000,
    *,
    heldout_fraction: float = 0.1,
    max_file_chars: int = 50_000,
    min_char_count: int = 20,
    root: Path | None = None,
) -> Corpus:
    """Read up to ``char_budget`` characters of stdlib source and split it into train / held out.

    Splitting by whole files (not by position inside one text) makes the held-out loss a
    measure of modules the model never saw. The vocabulary comes from the training text
    only; characters rarer than ``min_char_count`` there map to the unknown id.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1). Received: {heldout_fraction}")
    root = stdlib_dir() if root is None else Path(root)
    files = select_sources(root, char_budget, max_file_chars)
    texts = read_sources(files, char_budget, max_file_chars)
    if len(texts) < 2:
        raise ValueError(f"Need at least 2 source files to split; a budget of {char_budget} chars read {len(texts)}")
    n_heldout = max(1, round(len(texts) * heldout_fraction))
    names = [p.name for p in files[: len(texts)]]
    # A blank line between modules, as between top-level definitions inside one.
    train_text = "\n\n".join(texts[:-n_heldout])
    heldout_text = "\n\n".join(texts[-n_heldout:])
    return Corpus(
        train_text=train_text,
        heldout_text=heldout_text,
        vocab=CharVocab.from_text(train_text, min_count=min_char_count),
        train_files=tuple(names[:-n_heldout]),
        heldout_files=tuple(names[-n_heldout:]),
    )
