"""The CUDA and NCCL paths, on a machine with a GPU (skipped without one; CI has none).

Every job runs in its own process that joins gloo + NCCL (``run_distributed(device="cuda")``,
one process per GPU: one here, so the collectives are NCCL's world-of-one paths, which still
run every kernel, hook and stream of DDP, FSDP2, DTensor and DCP on the device). What is checked:

* fp32 on the GPU trains like fp32 on the CPU (same model, seed, batches; TF32 off, torch's
  default): within 1e-4 on losses and parameters after 8 Adam steps (summation order differs);
* ZeRO 1, 2, 3 and ZeRO-3 with CPU offload equal DataParallel on the GPU within 1e-5;
* a transformers Llama under ModelParallel (DTensor on a CUDA mesh) with activation checkpointing
  ("full" and "selective") equals the same model without it within 1e-5;
* bf16-mixed and fp16-mixed (dynamic loss scaling) train: finite, falling losses, near fp32's;
* ``compile="regional"`` with inductor (Triton kernels) equals eager within 1e-5 (8 SGD steps)
  and compiles nothing new after step 2, with torch's default mode and with ``compile_mode=
  "reduce-overhead"`` (CUDA graphs replayed);
* a ZeRO-3 sharded checkpoint saved asynchronously from the GPU resumes on a CPU process and
  ends where an uninterrupted GPU run ends;
* the matmul peak probe and MFU on CUDA; two processes on one GPU are refused with a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainmesh.testing import run_distributed

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N, BATCH, EPOCHS = 64, 16, 2  # 8 steps
VOCAB, SEQ = 64, 16


class Net(torch.nn.Module):
    """Residual MLP blocks in a ModuleList (the FSDP units and compile regions), seeded."""

    def __init__(self, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(32), torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, 32)
            )
            for _ in range(2)
        )
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def regression_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g)


def llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).float()


def token_data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (N, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(
    *,
    zero=0,
    precision="fp32",
    compile=False,
    offload=False,
    ac=None,
    model="net",
    epochs=EPOCHS,
    callbacks=(),
    resume=False,
    peak_flops=None,
    optimizer="adam",
    compile_mode=None,
):
    """Train the seeded model; return losses, parameters (on the CPU), graphs compiled per step."""
    import torch._dynamo

    import trainmesh as tm
    from trainmesh._torch.compile import compiled_mode

    graphs = []

    class CountGraphs(tm.Callback):
        def on_train_begin(self, logs=None):
            self.before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

        def on_train_batch_end(self, step, logs=None):
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - self.before)

    torch._dynamo.reset()
    if model == "llama":
        net, data, loss = llama(), token_data(), lm_loss
        mesh = tm.DeviceMesh((1, 1), ["data", "model"], devices=tm.list_devices())
        distribution = tm.ModelParallel(layout_map=tm.LayoutMap.auto(net, mesh, verbose=False), batch_dim_name="data")
    else:
        net, data, loss = Net(), regression_data(), torch.nn.MSELoss()
        distribution = tm.DataParallel()
    # SGD where kernels differ (compiled vs eager): parameters then differ by what the gradients differ
    # by, where Adam's normalisation turns a rounding difference in a near-zero gradient into up to
    # an lr-sized step (an H200 read 6.9e-6 on one run and 1.7e-5 on the next with Adam).
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(net.parameters(), lr=1e-2)
    trainer = tm.Trainer(
        net,
        opt,
        loss,
        distribution=distribution,
        zero_stage=zero,
        precision=precision,
        compile=compile,
        compile_mode=compile_mode,
        cpu_offload=offload,
        activation_checkpointing=ac,
        max_grad_norm=1.0,
        peak_flops=peak_flops,
        callbacks=[CountGraphs(), *callbacks],
        progress=False,
    )
    history = trainer.fit(data, epochs=epochs, batch_size=BATCH, shuffle=False, resume=resume)
    params = {k: v.detach().float().cpu().clone() for k, v in trainer.state_dict()["model"].items()}
    return {
        "losses": [s["loss"] for s in history.steps],
        "params": params,
        "graphs": graphs,
        "device": str(next(trainer.unwrapped_model.parameters()).device),
        "compiled": compiled_mode(trainer.unwrapped_model),
        "steps": [dict(s) for s in history.steps],
        "scaler": trainer.state_dict()["scaler"],
    }


def _cases(cases: dict) -> dict:
    return {name: train(**kwargs) for name, kwargs in cases.items()}


def on_gpu(cases: dict) -> dict:
    return run_distributed(_cases, world_size=1, args=(cases,), device="cuda", timeout=540, collective_timeout=300)[0]


def on_cpu(cases: dict) -> dict:
    return run_distributed(_cases, world_size=1, args=(cases,), device="cpu", timeout=540, collective_timeout=300)[0]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def gpu():
    return on_gpu(
        {
            "dp": {},
            "zero1": {"zero": 1},
            "zero2": {"zero": 2},
            "zero3": {"zero": 3},
            "zero3_offload": {"zero": 3, "offload": True},
            "bf16": {"precision": "bf16-mixed"},
            "fp16": {"precision": "fp16-mixed"},
            "sgd": {"optimizer": "sgd"},
            "compiled": {"compile": "regional", "optimizer": "sgd"},
            "cudagraphs": {"compile": "regional", "optimizer": "sgd", "compile_mode": "reduce-overhead"},
            "llama": {"model": "llama"},
            "llama_ac_full": {"model": "llama", "ac": "full"},
            "llama_ac_selective": {"model": "llama", "ac": "selective"},
            "mfu": {"peak_flops": 1e12},
        }
    )


def test_gpu_fp32_trains_like_the_cpu(gpu):
    cpu = on_cpu({"dp": {}})["dp"]
    assert gpu["dp"]["device"].startswith("cuda") and cpu["device"] == "cpu"
    diff = max_diff(gpu["dp"]["params"], cpu["params"])
    print(f"max |gpu - cpu| over parameters after {len(cpu['losses'])} steps: {diff:.3g}")
    assert diff <= 1e-4
    assert gpu["dp"]["losses"] == pytest.approx(cpu["losses"], abs=1e-4)
    assert max_diff(cpu["params"], {k: v for k, v in Net().state_dict().items()}) > 1e-2  # it trained


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_zero_on_gpu_equals_dataparallel(gpu, name):
    diff = max_diff(gpu[name]["params"], gpu["dp"]["params"])
    print(f"{name}: max |zero - dp| = {diff:.3g}")
    assert diff <= 1e-5
    assert gpu[name]["losses"] == pytest.approx(gpu["dp"]["losses"], abs=1e-5)


@pytest.mark.parametrize("name", ["llama_ac_full", "llama_ac_selective"])
def test_activation_checkpointing_on_a_cuda_mesh(gpu, name):
    diff = max_diff(gpu[name]["params"], gpu["llama"]["params"])
    print(f"{name}: max |checkpointed - plain| = {diff:.3g}")
    assert gpu[name]["device"].startswith("cuda")
    assert diff <= 1e-5


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_trains(gpu, name):
    losses, reference = gpu[name]["losses"], gpu["dp"]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    half = len(losses) // 2  # the second epoch's mean loss is below the first's
    assert sum(losses[half:]) < sum(losses[:half])
    # Half-precision matmuls change the trajectory a little, not its course.
    assert losses[-1] == pytest.approx(reference[-1], rel=0.1)
    if name == "fp16":
        assert gpu[name]["scaler"] is not None  # dynamic loss scaling ran


@pytest.mark.parametrize("case", ["compiled", "cudagraphs"])
def test_regional_compile_with_inductor_equals_eager(gpu, case):
    from trainmesh._torch.compile import compile_unavailable_reason

    reason = compile_unavailable_reason("inductor", "cuda")
    if reason:
        pytest.skip(reason)
    compiled, eager = gpu[case], gpu["sgd"]
    diff = max_diff(compiled["params"], eager["params"])
    print(f"compiled (inductor, Triton) vs eager: {diff:.3g}; graphs per step {compiled['graphs']}")
    assert compiled["compiled"] == "regional"  # compile was applied, block by block
    assert compiled["graphs"][1] > 0  # and dynamo compiled graphs
    assert compiled["graphs"][1:] == [compiled["graphs"][1]] * (len(compiled["graphs"]) - 1)  # and never again
    assert diff <= 1e-5
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)


def test_mfu_is_reported_on_cuda(gpu):
    steps = gpu["mfu"]["steps"]
    rated = [s for s in steps if "mfu" in s]
    assert rated, steps[-1].keys()
    # model FLOPs/s over the stated 1 TFLOP/s peak: a positive number that matches its own parts
    last = rated[-1]
    assert last["mfu"] > 0
    assert last["mfu"] == pytest.approx(last["model_flops_per_s"] / 1e12, rel=1e-6)


def _resume_on_cpu(directory: str) -> dict:
    import trainmesh as tm

    return train(zero=0, epochs=EPOCHS, callbacks=[tm.ShardedCheckpoint(directory, async_save=False)], resume=True)


def _first_epoch_on_gpu(directory: str) -> dict:
    import trainmesh as tm

    return train(zero=3, epochs=1, callbacks=[tm.ShardedCheckpoint(directory, async_save=True)])


def test_sharded_checkpoint_from_gpu_resumes_on_cpu(gpu, tmp_path):
    directory = str(tmp_path / "ckpt")
    first = run_distributed(_first_epoch_on_gpu, world_size=1, args=(directory,), device="cuda", timeout=300)[0]
    resumed = run_distributed(_resume_on_cpu, world_size=1, args=(directory,), device="cpu", timeout=300)[0]
    assert resumed["device"] == "cpu"
    assert len(resumed["graphs"]) == len(first["graphs"])  # it ran the second epoch only
    assert first["losses"] == pytest.approx(gpu["zero3"]["losses"][: len(first["losses"])], abs=1e-5)
    diff = max_diff(resumed["params"], gpu["zero3"]["params"])
    print(f"ZeRO-3 on the GPU for one epoch, resumed on the CPU: max |resumed - uninterrupted| = {diff:.3g}")
    assert diff <= 1e-4


def _peak() -> float:
    from trainmesh.trainer.throughput import measure_peak_flops

    return measure_peak_flops(torch.bfloat16, device_type="cuda", seconds=1.0, save=False)


def test_peak_probe_on_cuda():
    peak = run_distributed(_peak, world_size=1, device="cuda", timeout=120)[0]
    print(f"bf16 matmul peak of {torch.cuda.get_device_name()}: {peak / 1e12:.0f} TFLOP/s")
    assert peak > 1e12  # any GPU with bf16 units does more than 1 TFLOP/s


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs more processes than GPUs")
def test_more_processes_than_gpus_is_refused_before_connecting():
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }  # nothing listens there: connecting would hang
    proc = subprocess.run(
        [sys.executable, "-c", "import trainmesh as tm; tm.initialize()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "NCCL needs a GPU per process" in proc.stderr, proc.stderr[-2000:]
