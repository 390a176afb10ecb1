"""Write-ahead log and snapshots on real files, with real torn writes and a real SIGKILL."""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trainmesh.ps.wal import SNAPSHOT_FILE, WAL_FILE, CorruptSnapshotError, WriteAheadLog, read_snapshot, write_snapshot

pytestmark = pytest.mark.timeout(60)


def _records(n):
    # Varied sizes, including empty and binary records.
    return [bytes([i % 256]) * (i * 37 % 1000) + f"record {i}".encode() for i in range(n)] + [b""]


def test_append_reopen_replay(tmp_path):
    recs = _records(50)
    with WriteAheadLog(tmp_path) as wal:
        assert wal.count == 0 and list(wal.records()) == []
        for r in recs:
            wal.append(r)
        assert wal.count == len(recs)
        assert list(wal.records()) == recs
    with WriteAheadLog(tmp_path) as wal:
        assert wal.count == len(recs)
        assert list(wal.records()) == recs
        wal.append(bytearray(b"more"))
        wal.append(memoryview(b"and more"))
    with WriteAheadLog(tmp_path) as wal:
        assert list(wal.records()) == recs + [b"more", b"and more"]


def test_records_stop_at_the_records_present_when_called(tmp_path):
    with WriteAheadLog(tmp_path) as wal:
        for i in range(3):
            wal.append(b"%d" % i)
        replayed = []
        for record in wal.records():  # replay through a path that appends again must end
            replayed.append(record)
            wal.append(record)
        assert replayed == [b"0", b"1", b"2"] and wal.count == 6


def test_reset_empties_durably(tmp_path):
    with WriteAheadLog(tmp_path) as wal:
        for r in _records(5):
            wal.append(r)
        wal.reset()
        assert wal.count == 0 and list(wal.records()) == []
        wal.append(b"after snapshot")
    assert os.path.getsize(tmp_path / WAL_FILE) == 8 + len(b"after snapshot")
    with WriteAheadLog(tmp_path) as wal:
        assert list(wal.records()) == [b"after snapshot"]


@pytest.mark.parametrize("cut", [1, 4, 7, 8, 9, 20])
@pytest.mark.parametrize("garbage", [b"", b"\xff" * 3, os.urandom(64), b"\x10\x00\x00\x00" + b"\x00" * 40])
def test_torn_tail_recovers_every_complete_record(tmp_path, cut, garbage, caplog):
    recs = [b"a" * 10, b"b" * 30, b"c" * 25]
    with WriteAheadLog(tmp_path) as wal:
        for r in recs:
            wal.append(r)
    path = tmp_path / WAL_FILE
    full = os.path.getsize(path)
    last_frame = 8 + len(recs[-1])
    # A crash mid-append: the last frame is cut after ``cut`` bytes, then junk follows.
    with open(path, "r+b") as f:
        f.truncate(full - last_frame + cut)
        f.seek(0, os.SEEK_END)
        f.write(garbage)
    with caplog.at_level(logging.WARNING, logger="trainmesh.ps.wal"):
        wal = WriteAheadLog(tmp_path)
    with wal:
        assert list(wal.records()) == recs[:2] and wal.count == 2
        assert "torn or corrupt tail" in caplog.text
        assert os.path.getsize(path) == full - last_frame  # tail truncated on open
        wal.append(b"d")
    with WriteAheadLog(tmp_path) as wal:
        assert list(wal.records()) == recs[:2] + [b"d"]


def test_flipped_bit_stops_replay_at_the_corrupt_record(tmp_path):
    with WriteAheadLog(tmp_path) as wal:
        for r in (b"first", b"second", b"third"):
            wal.append(r)
    path = tmp_path / WAL_FILE
    blob = bytearray(path.read_bytes())
    blob[8 + 5 + 8 + 2] ^= 0x01  # inside b"second"
    path.write_bytes(bytes(blob))
    with WriteAheadLog(tmp_path) as wal:
        assert list(wal.records()) == [b"first"]


def test_a_huge_garbage_length_is_not_allocated(tmp_path):
    with WriteAheadLog(tmp_path) as wal:
        wal.append(b"ok")
    with open(tmp_path / WAL_FILE, "ab") as f:
        f.write(b"\xff\xff\xff\xff\x00\x00\x00\x00abc")
    with WriteAheadLog(tmp_path) as wal:
        assert list(wal.records()) == [b"ok"]


_CHILD = textwrap.dedent("""
    import os, signal, sys
    from trainmesh.ps.wal import WriteAheadLog
    wal = WriteAheadLog(sys.argv[1])
    for i in range(int(sys.argv[2])):
        wal.append(b"record-%d-" % i + bytes(i % 7) * i)
    # No close, no flush at exit: the process dies right after the last append returned.
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_records_survive_sigkill_right_after_append(tmp_path):
    n = 200
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), str(n)], env=env, capture_output=True, timeout=50
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with WriteAheadLog(tmp_path) as wal:  # the killed child's lock is gone
        assert wal.count == n
        assert list(wal.records()) == [b"record-%d-" % i + bytes(i % 7) * i for i in range(n)]


def test_one_writer_per_directory(tmp_path):
    with WriteAheadLog(tmp_path):
        with pytest.raises(RuntimeError, match="already open"):
            WriteAheadLog(tmp_path)
    with WriteAheadLog(tmp_path) as wal:  # released on close
        wal.append(b"x")


def test_wal_rejects_bad_use(tmp_path):
    wal = WriteAheadLog(tmp_path)
    with pytest.raises(TypeError, match="str"):
        wal.append("text")
    wal.close()
    with pytest.raises(ValueError, match="closed"):
        wal.append(b"x")


def test_snapshot_round_trip_and_replace(tmp_path):
    assert read_snapshot(tmp_path) is None
    write_snapshot(tmp_path, b"one")
    assert read_snapshot(tmp_path) == b"one"
    big = os.urandom(3_000_000)
    path = write_snapshot(tmp_path, big)
    assert os.path.basename(path) == SNAPSHOT_FILE
    assert read_snapshot(tmp_path) == big
    write_snapshot(tmp_path, b"")
    assert read_snapshot(tmp_path) == b""
    assert sorted(os.listdir(tmp_path)) == [SNAPSHOT_FILE]


def test_leftover_temp_file_is_ignored_and_cleaned(tmp_path):
    write_snapshot(tmp_path, b"good")
    # A crash mid-write leaves a half-written temp file next to the real snapshot.
    leftover = tmp_path / f".{SNAPSHOT_FILE}.abc123.tmp"
    leftover.write_bytes(b"TMSNAP01 half written")
    assert read_snapshot(tmp_path) == b"good"
    write_snapshot(tmp_path, b"newer")
    assert not leftover.exists()
    assert read_snapshot(tmp_path) == b"newer"


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "short"])
def test_corrupt_snapshot_raises_naming_the_file(tmp_path, damage):
    write_snapshot(tmp_path, b"x" * 100)
    path = tmp_path / SNAPSHOT_FILE
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-10] ^= 0x40
    elif damage == "truncate":
        blob = blob[:-1]
    elif damage == "magic":
        blob[:8] = b"NOTASNAP"
    else:
        blob = blob[:5]
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptSnapshotError, match=str(path)):
        read_snapshot(tmp_path)


def test_append_fsyncs_before_returning(tmp_path, monkeypatch):
    import trainmesh.ps.wal as wal_module

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(wal_module.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with WriteAheadLog(tmp_path) as wal:
        before = len(synced)
        wal.append(b"durable")
        assert len(synced) == before + 1


def test_failed_snapshot_write_keeps_the_old_snapshot(tmp_path, monkeypatch):
    import trainmesh.ps.wal as wal_module

    write_snapshot(tmp_path, b"old")

    def disk_error(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(wal_module.os, "fsync", disk_error)
    with pytest.raises(OSError, match="Input/output"):
        write_snapshot(tmp_path, b"new" * 1000)
    monkeypatch.undo()
    assert read_snapshot(tmp_path) == b"old"
    assert sorted(os.listdir(tmp_path)) == [SNAPSHOT_FILE]
