"""The small reductions behind the Trainer's per-step check, loss, metrics and flags, on real gloo
ranks: every rank gets the same bits, a NaN in one rank's sum reaches all, and the results equal
gloo's own all-reduce where the order of a sum cannot matter (two ranks), within float64 rounding
where it can (four), and max/min exactly. A guard for any cheaper way of reducing them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trainmesh._torch.reduce import all_reduce_floats_async, all_reduce_small, all_reduce_small_async
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _job() -> dict:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    values = torch.randn(11, generator=gen, dtype=torch.float64) * 10 ** torch.randint(-8, 9, (11,), generator=gen)
    values[3] = float("nan") if rank == 1 else 1.0  # one rank's non-finite value reaches everyone
    reference = values.clone()
    dist.all_reduce(reference)  # gloo's own
    maximum, minimum = values.clone(), values.clone()
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
    dist.all_reduce(minimum, op=dist.ReduceOp.MIN)
    # (each call gets its own copy: gloo's all-reduce may sum the caller's tensor in place)
    matrix = values[:10].clone().reshape(2, 5)
    pending = all_reduce_small_async(values.clone())
    return {
        "sum": all_reduce_small(values.clone()),
        "reference": reference,
        "max": all_reduce_small(values.clone(), op=dist.ReduceOp.MAX),
        "max_reference": maximum,
        "min": all_reduce_small(values.clone(), op=dist.ReduceOp.MIN),
        "min_reference": minimum,
        "async": pending(),
        "shape": tuple(all_reduce_small(matrix).shape),
        "floats": all_reduce_floats_async(values.tolist())(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_small_reductions_agree_on_every_rank_and_with_gloo(world):
    results = run_distributed(_job, world_size=world, timeout=90)
    first = results[0]
    for out in results:
        for key in ("sum", "max", "min", "async"):  # the same bits everywhere (NaN included)
            assert torch.equal(out[key].nan_to_num(7.0), first[key].nan_to_num(7.0))
        assert out["floats"] == pytest.approx(out["sum"].tolist(), nan_ok=True, rel=0, abs=0)
        assert out["shape"] == (2, 5)
    assert torch.isnan(first["sum"][3])  # (gloo's max and min need not propagate a NaN: not asked)
    finite = torch.arange(11) != 3
    if world == 2:  # a + b == b + a: gloo's order cannot matter
        assert torch.equal(first["sum"][finite], first["reference"][finite])
    else:
        torch.testing.assert_close(first["sum"][finite], first["reference"][finite], rtol=1e-15, atol=0)
    assert torch.equal(first["max"][finite], first["max_reference"][finite])
    assert torch.equal(first["min"][finite], first["min_reference"][finite])
