"""Sync rounds under any arrival order (issue 42): a server fed every frame of N workers in a
seeded random order, with duplicates and late resends, applies each round once and complete, and
ends with exactly the parameters of one worker pushing each round's summed gradient.

The frames are delivered by hand (``ParameterServer.handle`` and the loop's ``_answer_pending``),
not by threads: the order is the seed's alone, so every seed is a fixed, repeatable schedule
(deterministic by construction, no sleeps). What is held back follows what a real client does: a
worker sends round r + 1 only after its pull of round r was answered, while duplicates and resends
of any earlier frame may arrive at any later point.
"""

from __future__ import annotations

import random

import pytest
import torch

from trainmesh.ps.param_entries import normalize_entry
from trainmesh.ps.placement import Partitioner
from trainmesh.ps.protocol import Message, MessageType, ProtocolError, encode
from trainmesh.ps.frame_decode import decode
from trainmesh.ps.server import ParameterServer

pytestmark = pytest.mark.timeout(120)

NUMEL, PART = 6, 4  # two dense shards
OPTIMIZERS = {"momentum": {"name": "sgd", "lr": 0.5, "momentum": 0.9}, "adam": {"name": "adam", "lr": 0.1}}


class CapturingTransport:
    """A server transport that keeps what the server sends, per peer; frames are handed in by the test."""

    in_process = True
    address = "test"

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send(self, peer, frame) -> None:
        self.sent.append((peer, frame))

    def recv(self, timeout_s):  # (the test calls handle() itself)
        return None

    def close(self) -> None:
        pass


class Worker:
    """The frames of one worker, numbered as a PSClient numbers them (one session, seqs from 1)."""

    def __init__(self, worker: int, num_workers: int, spec: dict, parts, value: torch.Tensor):
        self.id, self.session, self.seq = str(worker), f"s{worker}", 0
        self.parts = parts
        self.setup = [
            self._frame(MessageType.REGISTER, {"worker": self.id, "num_workers": num_workers}),
            self._frame(
                MessageType.INIT, {"params": [spec]}, {p.shard_id: value[p.start : p.stop].clone() for p in parts}
            ),
        ]

    def _frame(self, kind: MessageType, meta: dict, tensors: dict | None = None) -> tuple[int, bytes]:
        self.seq += 1
        msg = Message(kind, self.id, self.seq, tensors=tensors or {}, meta={**meta, "session": self.session})
        return self.seq, encode(msg, None)

    def round_frames(self, round_: int, grad: torch.Tensor) -> tuple[list[bytes], int]:
        """Push of ``round_``, the clock that follows it and a sync pull at that clock; the pull's seq."""
        sids = [p.shard_id for p in self.parts]
        push_seq, push = self._frame(
            MessageType.PUSH,
            {"shards": sids, "rows": {}, "round": round_},
            {p.shard_id: grad[p.start : p.stop].clone() for p in self.parts},
        )
        _, clock = self._frame(MessageType.CLOCK, {"clock": round_ + 1, "after_pushes": [push_seq]})
        pull_seq, pull = self._frame(
            MessageType.PULL, {"clock": round_ + 1, "shards": sids, "rows": {}, "after_pushes": [push_seq]}
        )
        return [push, clock, pull], pull_seq


def _server(num_workers: int, **durability) -> tuple[ParameterServer, CapturingTransport]:
    transport = CapturingTransport()
    return ParameterServer(transport, server_id="s0", num_workers=0, **durability), transport  # count told at register


def _deliver(server: ParameterServer, peer: str, frame: bytes) -> None:
    server.handle(peer, frame)
    server._answer_pending()  # what serve_forever does after every frame


def _pull_answers(transport: CapturingTransport, seen: int) -> list[tuple[str, Message]]:
    answers = []
    for peer, frame in transport.sent[seen:]:
        try:
            msg = decode(frame, None)
        except ProtocolError:
            continue  # a push ack (its own short format)
        if msg.type is MessageType.ERROR:
            raise AssertionError(f"server error to {peer}: {msg.meta}")
        if msg.type is MessageType.PULL_REPLY:
            answers.append((peer, msg))
    return answers


def _run(
    num_workers: int,
    optimizer: dict,
    grads: list[list[torch.Tensor]],
    value: torch.Tensor,
    seed: int | None,
    duplicate: float = 0.3,
    late: float = 0.3,
    **durability,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Deliver every worker's frames (``seed``: random order, duplicates, late resends; None: in
    order, no faults); returns the final values and, per clock, what the sync pulls saw."""
    rng = random.Random(seed)
    spec, _ = normalize_entry(
        {"name": "w", "kind": "dense", "value": value, "mode": "sync", "staleness": 0}, optimizer, "sync", 0, 16, 0
    )
    parts = Partitioner(PART, 16).dense_shards("w", NUMEL)
    server, transport = _server(num_workers, **durability)
    workers = [Worker(w, num_workers, spec, parts, value) for w in range(num_workers)]
    for w in workers:
        for _, frame in w.setup:
            _deliver(server, w.id, frame)
    rounds = len(grads)
    pool: list[tuple[str, bytes]] = []  # frames in flight (and duplicates/resends yet to arrive)
    waiting = {}  # worker -> the seq of its pull that must be answered before its next round
    next_round = {w.id: 0 for w in workers}
    seen_at: dict[int, list[torch.Tensor]] = {}

    def release(worker: Worker) -> None:
        r = next_round[worker.id]
        if r == rounds:
            return
        frames, pull_seq = worker.round_frames(r, grads[r][int(worker.id)])
        waiting[worker.id] = pull_seq
        next_round[worker.id] = r + 1
        pool.extend((worker.id, f) for f in frames)

    for w in workers:
        release(w)
    sent_before = 0
    while pool:
        index = rng.randrange(len(pool)) if seed is not None else 0
        peer, frame = pool.pop(index)
        if seed is not None and rng.random() < duplicate:
            pool.append((peer, frame))  # a duplicate on the wire, or a resend after a lost ack
        if seed is not None and rng.random() < late:
            pool.append((peer, frame))  # ... and one more that arrives much later
            continue  # this copy was lost: only the later ones arrive
        _deliver(server, peer, frame)
        for answered_peer, reply in _pull_answers(transport, sent_before):
            if waiting.get(answered_peer) == reply.seq:
                clock = next_round[answered_peer]
                seen_at.setdefault(clock, []).append(torch.cat([reply.tensors[p.shard_id] for p in parts]))
                waiting.pop(answered_peer)
                release(next(w for w in workers if w.id == answered_peer))
        sent_before = len(transport.sent)
    assert not waiting and all(r == rounds for r in next_round.values()), (waiting, next_round)
    final = torch.cat([server.state.shards[p.shard_id].value.clone() for p in parts])
    assert server.counters["rounds_applied"] == rounds
    if durability:  # what a crash leaves: the log (no final snapshot), replayed by a new server
        server.state.store.close()
        replayed, _ = _server(num_workers, **durability)
        again = torch.cat([replayed.state.shards[p.shard_id].value for p in parts])
        assert torch.equal(again, final) and replayed.state.rounds.closed_below == rounds
        for p in parts:
            state, replayed_state = server.state.shards[p.shard_id].state, replayed.state.shards[p.shard_id].state
            assert all(torch.equal(state[k], replayed_state[k]) for k in state if torch.is_tensor(state[k]))
        replayed.state.store.close()
    return final, {c: torch.stack(v) for c, v in seen_at.items()}


def _one_process(optimizer: dict, grads: list[list[torch.Tensor]], value: torch.Tensor):
    """One worker pushing each round's global gradient (the sum of the workers'), in order."""
    summed = [[torch.stack(round_).sum(0)] for round_ in grads]
    return _run(1, optimizer, summed, value, seed=None)


@pytest.mark.parametrize("num_workers", [2, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_any_arrival_order_gives_one_process_parameters_exactly(num_workers, optimizer):
    """50 seeds each: drops (late resends), duplicates and reordering across and within workers."""
    gen = torch.Generator().manual_seed(num_workers)
    rounds = 4
    # Multiples of 1/8: every sum of them is exact in fp32, so any order of adding pushes gives
    # the same round gradient and the comparison can be exact.
    grads = [
        [torch.randint(-16, 17, (NUMEL,), generator=gen).float() / 8 for _ in range(num_workers)] for _ in range(rounds)
    ]
    value = torch.randint(-8, 9, (NUMEL,), generator=gen).float() / 4
    expected, expected_seen = _one_process(OPTIMIZERS[optimizer], grads, value)
    for seed in range(50):
        final, seen = _run(num_workers, OPTIMIZERS[optimizer], grads, value, seed)
        assert torch.equal(final, expected), (seed, final, expected)
        for clock, values in seen.items():  # BSP: a pull at clock c saw rounds < c, all of them, once
            assert torch.equal(values, expected_seen[clock][0].expand_as(values)), (seed, clock)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_write_ahead_log_replays_to_the_same_state(tmp_path, optimizer):
    """Any arrival order, logged: a new server replaying the log gets the same values, optimizer
    state and closed rounds."""
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randint(-16, 17, (NUMEL,), generator=gen).float() / 8 for _ in range(2)] for _ in range(3)]
    value = torch.zeros(NUMEL)
    expected, _ = _one_process(OPTIMIZERS[optimizer], grads, value)
    for seed in range(3):
        final, _ = _run(
            2, OPTIMIZERS[optimizer], grads, value, seed, durability="wal", directory=tmp_path / f"{optimizer}{seed}"
        )
        assert torch.equal(final, expected)


def test_a_dead_workers_late_push_for_a_closed_round_is_refused(caplog):
    """Worker 1 is declared dead: round 1 closes without it. Its push for round 1, arriving later,
    is refused by name (not applied as a round of its own); its pushes for later rounds count."""
    clock_now = [0.0]
    server, transport = _server(2)
    server.clocks.dead_after_s = 5.0
    server.clocks._now = lambda: clock_now[0]
    spec, _ = normalize_entry(
        {"name": "w", "kind": "dense", "value": torch.zeros(NUMEL), "mode": "sync"},
        {"name": "sgd", "lr": 1.0},
        "sync",
        0,
        16,
        0,
    )
    parts = Partitioner(PART, 16).dense_shards("w", NUMEL)
    workers = [Worker(w, 2, spec, parts, torch.zeros(NUMEL)) for w in range(2)]
    for w in workers:
        for _, frame in w.setup:
            _deliver(server, w.id, frame)
    ones = torch.ones(NUMEL)
    for w in workers:  # round 0: both
        for frame in w.round_frames(0, ones)[0]:
            _deliver(server, w.id, frame)
    frames_1, _ = workers[0].round_frames(1, ones)  # round 1: worker 0 only ...
    for frame in frames_1:
        _deliver(server, "0", frame)
    late_push, late_clock, _ = workers[1].round_frames(1, ones)[0]
    clock_now[0] = 6.0  # ... worker 1 silent past dead_after_s: declared dead
    server.handle("0", encode(Message(MessageType.HEARTBEAT, "0", 0, meta={"clock": 2}), None))
    server._answer_pending()
    assert server.state.rounds.closed_below == 2 and server.counters["rounds_applied"] == 2
    value = lambda: torch.cat([server.state.shards[p.shard_id].value for p in parts])  # noqa: E731
    assert torch.equal(value(), torch.full((NUMEL,), -3.0))  # 2 pushes + 1 push
    sent = len(transport.sent)
    with caplog.at_level("WARNING"):
        _deliver(server, "1", late_push)  # worker 1 is back, with its push for round 1
    errors = [decode(f, None) for _, f in transport.sent[sent:]]
    assert errors and errors[0].type is MessageType.ERROR and errors[0].meta["code"] == "round_closed", errors
    assert "worker 1 for round 1 refused" in errors[0].meta["error"]
    assert "round 1 refused" in caplog.text  # logged with its reason
    assert torch.equal(value(), torch.full((NUMEL,), -3.0)) and not server.state.rounds  # nothing applied
    _deliver(server, "1", late_clock)  # its clock still counts (the refused push is not waited for)
    for w in workers:  # round 2: both again, summed exactly
        for frame in w.round_frames(2, ones)[0]:
            _deliver(server, w.id, frame)
    assert torch.equal(value(), torch.full((NUMEL,), -5.0)) and server.counters["rounds_applied"] == 3


def test_a_sync_server_without_a_worker_count_refuses_sync_init():
    """--num-workers 0 and a client that does not say how many workers the job has: round 0 could
    close before the others registered, so sync mode is refused, saying how to fix it."""
    server, transport = _server(0)
    spec, value = normalize_entry(
        {"name": "w", "kind": "dense", "value": torch.zeros(NUMEL), "mode": "sync"},
        {"name": "sgd", "lr": 1.0},
        "sync",
        0,
        16,
        0,
    )
    init = Message(
        MessageType.INIT,
        "0",
        1,
        meta={"params": [spec], "session": "s"},
        tensors={p.shard_id: torch.zeros(p.stop - p.start) for p in Partitioner(PART, 16).dense_shards("w", NUMEL)},
    )
    _deliver(server, "0", encode(init, None))
    reply = decode(transport.sent[-1][1], None)
    assert reply.type is MessageType.ERROR and "--num-workers N" in reply.meta["error"], reply.meta
    assert not server.state.params  # nothing was created


def test_a_registered_worker_count_holds_round_0_for_workers_not_registered_yet():
    """The first worker registers (saying the job has 2), pushes and clocks: round 0 stays open
    until worker 1, not registered yet, has pushed and clocked too."""
    spec, _ = normalize_entry(
        {"name": "w", "kind": "dense", "value": torch.zeros(NUMEL), "mode": "sync"},
        {"name": "sgd", "lr": 1.0},
        "sync",
        0,
        16,
        0,
    )
    parts = Partitioner(PART, 16).dense_shards("w", NUMEL)
    server, _ = _server(0)
    early = Worker(0, 2, spec, parts, torch.zeros(NUMEL))
    for _, frame in early.setup:
        _deliver(server, "0", frame)
    for frame in early.round_frames(0, torch.ones(NUMEL))[0]:
        _deliver(server, "0", frame)
    assert server.counters["rounds_applied"] == 0 and server.state.rounds.pending_pushes == 1
    late = Worker(1, 2, spec, parts, torch.zeros(NUMEL))
    for _, frame in late.setup:
        _deliver(server, "1", frame)
    for frame in late.round_frames(0, torch.ones(NUMEL))[0]:
        _deliver(server, "1", frame)
    assert server.counters["rounds_applied"] == 1
    assert torch.equal(torch.cat([server.state.shards[p.shard_id].value for p in parts]), torch.full((NUMEL,), -2.0))
