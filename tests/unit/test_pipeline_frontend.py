"""Pipeline descriptions and splits: bad input raises a clear ValueError before any collective."""

import pytest
import torch

import trainmesh as tm
from trainmesh._torch.pipeline import plan_split, stage_indices, stage_owner
from trainmesh._torch.pipeline_split import assign_blocks, build_stage_model, merge_stage_models
from trainmesh.demo.char_gpt import CharGPT, GPTConfig

pytestmark = pytest.mark.usefixtures("no_process_group_left_behind")


def gpt(n_layer=4):
    torch.manual_seed(0)
    return CharGPT(GPTConfig(vocab_size=16, block_size=8, n_layer=n_layer, n_head=2, d_model=8))


def test_schedule_names_and_microbatches_are_checked_on_construction():
    with pytest.raises(ValueError, match="Unknown pipeline schedule.*Received: schedule='1f2b'"):
        tm.Pipeline(schedule="1f2b")
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        tm.Pipeline(microbatches=0)
    with pytest.raises(ValueError, match="runs one stage per process"):
        tm.Pipeline(schedule="gpipe", stages_per_rank=2)
    assert tm.Pipeline(schedule="zbv").stages_per_rank == 2


def test_fewer_microbatches_than_stages_and_batches_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="at least as many microbatches as pipeline ranks \\(4\\)"):
        tm.Pipeline(schedule="1f1b", microbatches=2).validate(4)
    tm.Pipeline(schedule="gpipe", microbatches=2).validate(4)  # GPipe runs with any number
    with pytest.raises(ValueError, match="6 rows\\) must divide into 4 microbatches"):
        tm.Pipeline(microbatches=4).validate(2, local_batch=6)


def test_more_stages_than_blocks_and_unknown_split_points_are_refused():
    with pytest.raises(ValueError, match="4 pipeline stages need at least 4 blocks; CharGPT has 2"):
        plan_split(gpt(2), tm.Pipeline(schedule="gpipe"), 4)
    with pytest.raises(ValueError, match="Split point 'blocks.9' names no block"):
        plan_split(gpt(4), tm.Pipeline(schedule="gpipe", split_points=["blocks.9"]), 2)
    with pytest.raises(ValueError, match="2 stages need 1 split points"):
        plan_split(gpt(4), tm.Pipeline(schedule="gpipe", split_points=["blocks.1", "blocks.2"]), 2)


def test_a_mesh_that_does_not_match_the_job_is_refused_before_any_collective():
    mesh = tm.DeviceMesh((2, 2), ["pipe", "data"], devices=[f"cpu:{i}" for i in range(4)])
    distribution = tm.DataParallel(device_mesh=mesh, pipeline=tm.Pipeline(schedule="gpipe"))
    with pytest.raises(ValueError, match="needs 4 processes but the job has 1"):
        distribution.distribute_model(gpt())
    with pytest.raises(ValueError, match="pipeline axis 'stage' is not an axis"):
        tm.DataParallel(device_mesh=mesh, pipeline=tm.Pipeline(axis="stage"))


def test_manual_and_balanced_splits_and_stage_placement():
    assert assign_blocks(gpt(4), 2, ["blocks.3"])[1] == [["0", "1", "2"], ["3"]]
    assert assign_blocks(gpt(4), 2)[1] == [["0", "1"], ["2", "3"]]  # equal blocks: equal halves
    assert stage_indices(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_indices(1, 4, 2, "zbv") == [1, 6] and stage_owner(6, 4, "zbv") == 1


def test_stage_copies_keep_global_names_and_together_run_the_whole_model():
    model = gpt(4)
    container, parts = assign_blocks(model, 2)
    first, last = (build_stage_model(model, container, parts, i) for i in (0, 1))
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert "blocks.3.mlp.0.weight" in names and "blocks.0.attn.qkv.weight" in names
    assert not any(n.startswith("blocks.3") for n, _ in first.named_parameters())
    ids = torch.randint(0, 16, (2, 8))
    hidden = first(ids)  # the stage's output is the hidden state after its last block
    from trainmesh._torch.pipeline import StageModule

    second = StageModule(last, is_first=False, forward_context=lambda: torch.autocast("cpu", enabled=False))
    second.install_entry_hook()
    assert torch.allclose(second(hidden), model(ids), atol=1e-6)
    merged = merge_stage_models([first, last])
    assert sorted(n for n, _ in merged.named_parameters()) == sorted(names)


def test_a_stage_copy_allocates_only_its_own_parameters():
    # Building a stage copies its blocks and outer modules, never the rest of the model: with 4
    # stages per process (interleaved), copies of the whole model would cost 4x its size first.
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default:  # how a Parameter deep-copies its data
                CountCopies.numel += out.numel()
            return out

    model = gpt(4)
    container, parts = assign_blocks(model, 4)
    whole = {id(p) for p in model.parameters()}
    for index in range(4):
        CountCopies.numel = 0
        with CountCopies():
            stage = build_stage_model(model, container, parts, index)
        own = dict(stage.named_parameters())
        assert not any(p.is_meta for p in own.values())  # the placeholders went with the stubs
        assert not whole & {id(p) for p in own.values()}  # copies, not the user's tensors
        own_numel = sum(p.numel() for p in own.values())
        assert own_numel < sum(p.numel() for p in model.parameters())
        assert CountCopies.numel <= own_numel + sum(b.numel() for b in model.buffers())
        for name, param in own.items():
            assert torch.equal(param, model.get_parameter(name))
