"""The planner against measured peak memory of real training steps on 2 gloo processes.

"Measured peak" here is the largest number of bytes held by live CPU tensor storages at any
dispatched op during ``Trainer.fit`` (two optimizer steps, so the optimizer state exists in the
second). A ``TorchDispatchMode`` registers every storage an op returns (parameters, DDP's
buckets, gradients, optimizer state, activations, temporaries) and drops it when its last
reference dies (a weakref finalizer). Storage resizes outside the dispatcher (FSDP2 frees and
re-allocates gathered parameters with ``untyped_storage().resize_``) are followed through a patch of
``UntypedStorage.resize_`` held while the tracker is active. It excludes allocator caching/fragmentation, Python objects, gloo's own buffers and
the interpreter: it is tensor bytes, the quantity the planner models.

The planner's ``total`` per rank must be within 15% of that peak.
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.testing import run_distributed
from trainmesh.testing.memory import LiveTensorBytes

pytestmark = [pytest.mark.dist, pytest.mark.timeout(360)]

TOLERANCE = 0.15
# ~25M parameters: 400 MB of fp32 Adam model state per rank, far above any noise.
GPT = dict(vocab_size=65, block_size=128, n_layer=8, n_head=8, d_model=512)
# The autocast case's model: bf16 matmuls on a CPU without a native bf16 path (AVX2 only) run ~45x
# slower than fp32, and GPT at 2,048 tokens a step would take minutes there. At width 128 it is still
# activation-heavy (activations several times the model state), which is what the case is for.
SMALL_GPT = dict(vocab_size=65, block_size=128, n_layer=4, n_head=4, d_model=128)


def _measure(precision: str, micro_batch: int, seq_len: int, zero_stage: int, accum: int, config: dict) -> dict:
    import trainmesh as tm
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig, lm_loss

    world = tm.world_size()
    n = world * micro_batch * accum * 2  # two optimizer steps
    ids = torch.randint(0, GPT["vocab_size"], (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    data = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    options = {"zero_stage": zero_stage} if zero_stage else {}
    with LiveTensorBytes("cpu") as tracker:
        torch.manual_seed(0)
        model = CharGPT(GPTConfig(**config))
        trainer = tm.Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-4),
            lm_loss,
            precision=precision,
            grad_accum_steps=accum,
            **options,
        )
        trainer.fit(data, epochs=1, batch_size=world * micro_batch * accum, shuffle=False)
    return {"peak": tracker.peak}


def _zero_landed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trainmesh._torch.zero") is not None


# (precision, micro_batch, seq_len, zero_stage, grad_accum_steps, model): model-state bound, activations ~
# gradients, activation-heavy under autocast, and accumulation (gradients and activations alive together).
CASES = [
    ("fp32", 4, 64, 0, 1, GPT),
    ("fp32", 8, 96, 0, 1, GPT),
    ("bf16-mixed", 16, 128, 0, 1, SMALL_GPT),
    ("fp32", 8, 96, 0, 2, GPT),
]
# Stage 1 is FSDP2 (``_torch/zero.py``): its gathered parameters are resized in place, followed above.
if _zero_landed():
    CASES.append(("fp32", 8, 96, 1, 1, GPT))


def _measure_all(cases) -> list[int]:
    return [_measure(*case)["peak"] for case in cases]


def test_planned_total_within_15_percent_of_measured_peak():
    from trainmesh.demo.char_gpt import CharGPT, GPTConfig
    from trainmesh.planner import format_bytes, plan

    # One launch for every case: process start-up and imports are paid once.
    measured = run_distributed(_measure_all, world_size=2, args=(CASES,), timeout=300)
    failures = []
    for index, (precision, micro_batch, seq_len, zero_stage, accum, config) in enumerate(CASES):
        report = plan(
            lambda: CharGPT(GPTConfig(**config)),
            world_size=2,
            zero_stage=zero_stage,
            precision=precision,
            micro_batch=micro_batch,
            seq_len=seq_len,
            grad_accum_steps=accum,
        )
        planned = report.rows[0].total
        for rank, peaks in enumerate(measured):
            error = planned / peaks[index] - 1
            line = (
                f"{precision} stage {zero_stage} micro-batch {micro_batch} T {seq_len} accum {accum} rank {rank}: "
                f"planned {format_bytes(planned)}, measured {format_bytes(peaks[index])} ({error:+.1%})"
            )
            print(line)
            if abs(error) > TOLERANCE:
                failures.append(line)
    assert not failures, "\n".join(failures)


# --- the dry run (fake process group, fake tensors) against the same step run for real ---------------

# ZeRO-3 + checkpointing, and TP x ZeRO-3 (2-D FSDP2 over tensor-parallel DTensors); DDP and TP alone
# are compared with real runs in benchmarks/plan_accuracy.py (kept out of the suite's time budget)
REAL_CASES = [("data=4", 3, "full"), ("data=2,model=2", 3, None)]


def _real_steps(cases) -> list[dict]:
    import trainmesh as tm
    from trainmesh.planner.dry_run import measure_step
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.models import model_factory

    out = []
    for mesh, zero, checkpointing in cases:
        torch.manual_seed(0)
        model = model_factory("tiny-llama")()
        ids = torch.randint(0, 1024, (2, 32))
        result = measure_step(
            model,
            MeshSpec.parse(mesh, tm.world_size()),
            tm.rank(),
            (),
            {"input_ids": ids, "labels": ids},
            zero_stage=zero,
            activation_checkpointing=checkpointing,
            precision="fp32",
        )
        out.append(result.to_dict())
    return out


@pytest.mark.timeout(300)
def test_dry_run_equals_the_real_step_on_4_processes():
    """Every byte and every collective the dry run reports is what the same step does on 4 real gloo
    processes: ZeRO-3 + checkpointing and TP x ZeRO-3 (a Llama from transformers)."""
    from trainmesh.planner.dry_run import run_rank
    from trainmesh.planner.mesh_spec import MeshSpec
    from trainmesh.planner.meta_model import build_meta_model
    from trainmesh.planner.models import model_factory

    real = run_distributed(_real_steps, world_size=4, args=(REAL_CASES,), timeout=280)
    meta = build_meta_model(model_factory("tiny-llama"))
    for index, (mesh, zero, checkpointing) in enumerate(REAL_CASES):
        for rank in (0, 3):
            planned = run_rank(
                meta,
                MeshSpec.parse(mesh, 4),
                rank,
                zero_stage=zero,
                activation_checkpointing=checkpointing,
                precision="fp32",
                micro_batch=2,
                seq_len=32,
            ).to_dict()
            measured = real[rank][index]
            for key in ("params", "grads", "optimizer", "activations", "buffers", "flops", "collectives"):
                assert planned[key] == measured[key], (
                    mesh,
                    zero,
                    checkpointing,
                    rank,
                    key,
                    planned[key],
                    measured[key],
                )
            assert measured["collectives"], "a 4-process step communicates"
