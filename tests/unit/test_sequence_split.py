"""The sequence axis's front end, one process: head-tail chunks, the batch split, the constructor checks."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainmesh as tm
from trainmesh.distribution.sequence_split import SequenceSplit, build_sequence_split

DEVICES4 = [f"cpu:{i}" for i in range(4)]


def test_head_tail_chunks_cover_the_sequence_once_with_equal_causal_work():
    split = SequenceSplit(axis="seq", axis_size=4)
    parts = [split.chunk_positions(32, i) for i in range(4)]
    assert [p.tolist()[:4] for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert parts[0].tolist()[4:] == list(range(28, 32))  # process 0: the first chunk and the last
    assert sorted(torch.cat(parts).tolist()) == list(range(32))
    # causal work of a query at position p is p + 1 keys: every process gets the same total
    assert len({int((p + 1).sum()) for p in parts}) == 1
    order = split.gathered_order(32)
    assert torch.equal(order, torch.cat(parts))
    assert torch.equal(order[torch.argsort(order)], torch.arange(32))


def test_contiguous_chunks_without_load_balance():
    split = SequenceSplit(axis="seq", axis_size=2, load_balance=False)
    assert split.chunk_positions(6, 1).tolist() == [3, 4, 5]


def test_split_batch_splits_tokens_and_targets_and_keeps_the_padding_mask_whole():
    split = SequenceSplit(axis="seq", axis_size=2)
    x = torch.arange(16).reshape(2, 8)
    inputs = {"input_ids": x, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    local_inputs, local_targets = split.split_batch((inputs, x + 100), index=1)
    assert local_inputs["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert local_targets.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert local_inputs["attention_mask"].shape == (2, 8)
    packed = {"input_ids": x, "position_ids": torch.arange(8).remainder(5).expand(2, -1)}
    assert split.split_batch((packed, x), index=1)[0]["position_ids"].shape == (2, 8)  # kept whole
    assert split.split_batch((x, x), index=0)[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]


@pytest.mark.parametrize(
    "batch,message",
    [
        ((torch.zeros(2, 6, dtype=torch.long),) * 2, r"divisible by 2 x the axis size \(4\)"),
        (
            ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8)}, torch.zeros(2, 8)),
            "labels",
        ),
        ((torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7)), "sequence length 8"),
        ((torch.zeros(8, dtype=torch.long), torch.zeros(8)), r"\[batch, seq"),
    ],
)
def test_bad_batches_are_value_errors(batch, message):
    with pytest.raises(ValueError, match=message):
        SequenceSplit(axis="seq", axis_size=2).split_batch(batch, index=0)


def test_distributions_take_a_sequence_axis():
    mesh = tm.DeviceMesh((2, 2), ["data", "seq"], devices=DEVICES4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a data x seq mesh is what DataParallel expects here: no warning
        dp = tm.DataParallel(mesh, sequence_dim_name="seq", context_parallel="ring")
    assert dp.batch_dim_name == "data" and dp.data_parallel_size == 2
    assert dp.sequence == SequenceSplit(axis="seq", axis_size=2, method="ring")
    assert [dp.sequence.index_of(mesh, r) for r in range(4)] == [0, 1, 0, 1]
    assert [dp.data_index(r) for r in range(4)] == [0, 0, 1, 1]  # seq peers read the same samples
    mp = tm.ModelParallel(layout_map=tm.LayoutMap(mesh), sequence_dim_name="seq")
    assert mp.batch_dim_name == "data" and mp.sequence.method == "auto"
    seq_only = tm.DataParallel(tm.DeviceMesh((4,), ["seq"], devices=DEVICES4), sequence_dim_name="seq")
    assert seq_only.batch_dim_name is None and seq_only.data_parallel_size == 1
    assert tm.DataParallel(devices=DEVICES4[:2]).sequence is None


def test_constructor_errors():
    mesh = tm.DeviceMesh((2, 2), ["data", "seq"], devices=DEVICES4)
    with pytest.raises(ValueError, match="not an axis"):
        build_sequence_split(mesh, "sequence", "auto", batch_dim_name="data")
    with pytest.raises(ValueError, match="must differ"):
        build_sequence_split(mesh, "data", "auto", batch_dim_name="data")
    with pytest.raises(ValueError, match="context_parallel must be one of"):
        tm.DataParallel(mesh, sequence_dim_name="seq", context_parallel="ringg")
    with pytest.raises(ValueError, match="needs a sequence axis"):
        tm.DataParallel(mesh, context_parallel="ring")
    # seq x pipe trains (tests/multiprocess/test_context_parallel_pipe.py) under gpipe, 1f1b and the looped
    # schedules; the zero-bubble ones (split backward) are refused by name, before any group exists
    pipe = tm.DeviceMesh((2, 2), ["pipe", "seq"], devices=DEVICES4)
    tm.ModelParallel(layout_map=tm.LayoutMap(pipe), sequence_dim_name="seq", pipeline=tm.Pipeline(axis="pipe"))
    for schedule in ("zbv", "interleaved_zero_bubble"):
        with pytest.raises(ValueError, match=f"zero-bubble schedules.*schedule='{schedule}'"):
            tm.ModelParallel(
                layout_map=tm.LayoutMap(pipe),
                sequence_dim_name="seq",
                pipeline=tm.Pipeline(axis="pipe", schedule=schedule),
            )
        with pytest.raises(ValueError, match="zero-bubble schedules"):  # DataParallel too
            tm.DataParallel(pipe, sequence_dim_name="seq", pipeline=tm.Pipeline(axis="pipe", schedule=schedule))


def test_auto_picks_ulysses_where_heads_divide():
    from trainmesh._torch.context_parallel import resolve_method

    assert resolve_method("auto", 32, 8, 4) == "ulysses"
    assert resolve_method("auto", 6, 2, 4) == "ring"
    with pytest.raises(ValueError, match="6 heads do not divide over 4"):
        resolve_method("ulysses", 6, 2, 4)


def test_sequence_parallel_needs_one_model_axis_and_takes_a_sequence_axis():
    mesh = tm.DeviceMesh((2, 2), ["data", "model"], devices=DEVICES4)
    assert tm.ModelParallel(layout_map=tm.LayoutMap(mesh), sequence_parallel=True).sequence_parallel
    assert not tm.ModelParallel(layout_map=tm.LayoutMap(mesh)).sequence_parallel
    with pytest.raises(ValueError, match="the mesh has 0"):
        tm.ModelParallel(
            layout_map=tm.LayoutMap(tm.DeviceMesh((4,), ["data"], devices=DEVICES4)), sequence_parallel=True
        )
    three = tm.DeviceMesh((1, 2, 2), ["data", "seq", "model"], devices=DEVICES4)
    # beside a sequence axis: the seq axis is not a model axis (parity in test_context_parallel.py)
    assert tm.ModelParallel(
        layout_map=tm.LayoutMap(three), sequence_dim_name="seq", sequence_parallel=True
    ).sequence_parallel
    with pytest.raises(ValueError, match="the mesh has 2"):  # without sequence_dim_name, "seq" is a model axis
        tm.ModelParallel(layout_map=tm.LayoutMap(three), sequence_parallel=True)
