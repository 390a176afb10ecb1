"""``direct_write``: whole pages with ``O_DIRECT``, edges through the page cache, every byte in place,
and the page cache alone where ``O_DIRECT`` is refused (at open, or at a write)."""

from __future__ import annotations

import errno
import os
import random

import pytest

from trainmesh.checkpoint import direct_write
from trainmesh.checkpoint.direct_write import PAGE, DirectWriter, aligned_split

pytestmark = pytest.mark.timeout(60)


def test_aligned_split_keeps_whole_pages_inside_the_range():
    assert aligned_split(0, 3 * PAGE) == (0, 3 * PAGE)
    assert aligned_split(1, 3 * PAGE) == (PAGE, 3 * PAGE)
    assert aligned_split(10, PAGE) == (10, 10)  # no whole page: all edge
    assert aligned_split(PAGE - 1, PAGE + 2) == (PAGE, 2 * PAGE)
    assert aligned_split(5, 0) == (5, 5)
    rng = random.Random(0)
    for _ in range(1000):
        at, size = rng.randrange(5 * PAGE), rng.randrange(5 * PAGE)
        start, stop = aligned_split(at, size)
        assert at <= start <= stop <= at + size
        if start < stop:
            assert start % PAGE == 0 and stop % PAGE == 0
            assert start - at < PAGE and at + size - stop < PAGE  # the edges are partial pages only
        else:
            assert start == at  # nothing direct


def _runs(total: int, seed: int) -> list[tuple[int, int]]:
    """Unaligned runs tiling ``[0, total)``, in a shuffled order (several writers' interleaving)."""
    rng = random.Random(seed)
    cuts = sorted({0, total, *(rng.randrange(total) for _ in range(40))})
    runs = list(zip(cuts, cuts[1:]))
    rng.shuffle(runs)
    return runs


def _write_all(path: str, expected: bytes, seed: int, writers: int = 3) -> None:
    handles = [DirectWriter(path) for _ in range(writers)]  # like processes: one descriptor pair each
    view = memoryview(expected)
    for i, (start, stop) in enumerate(_runs(len(expected), seed)):
        handles[i % writers].write(view[start:stop], start)
    for handle in handles:
        handle.fsync()
        handle.close()


@pytest.mark.parametrize("total", [1, PAGE - 3, 3 * PAGE + 17, (direct_write.BOUNCE * 2) + PAGE * 3 + 5])
def test_every_byte_lands_whatever_the_alignment(tmp_path, total):
    expected = random.Random(total).randbytes(total)
    path = str(tmp_path / "f")
    _write_all(path, expected, seed=total)
    with open(path, "rb") as fh:
        assert fh.read() == expected


def test_refused_at_open_goes_through_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT not supported (injected)")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_write.os, "open", refusing)
    expected = random.Random(1).randbytes(5 * PAGE + 99)
    path = str(tmp_path / "f")
    _write_all(path, expected, seed=1)
    with open(path, "rb") as fh:
        assert fh.read() == expected


def test_refused_at_a_write_falls_back_and_keeps_every_byte(tmp_path, monkeypatch):
    real_pwrite, refused = os.pwrite, []
    writer = DirectWriter(str(tmp_path / "f"))
    if writer._direct is None:
        writer.close()
        pytest.skip("this file system refuses O_DIRECT at open (covered above)")
    direct_fd = writer._direct

    def refusing(fd, data, at):
        if fd == direct_fd:
            refused.append(at)
            raise OSError(errno.EINVAL, "alignment (injected)")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(direct_write.os, "pwrite", refusing)
    expected = random.Random(2).randbytes(7 * PAGE + 3)
    writer.write(memoryview(expected)[5:], 5)
    writer.write(memoryview(expected)[:5], 0)
    writer.fsync()
    writer.close()
    assert refused == [PAGE]  # tried once, then the page cache for the rest of the file
    with open(tmp_path / "f", "rb") as fh:
        assert fh.read() == expected
