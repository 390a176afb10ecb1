"""Why a compiled model would run eager on this GPU machine: the environment and dynamo's
settings, dynamo's counters on a bare ``module.compile()`` (eager and inductor backends), and on
the Trainer's regional compile (run: python tests/gpu/diagnose_compile.py)."""

import os
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(__file__))


def _show_settings() -> None:
    print("python", sys.version.split()[0], "torch", torch.__version__, flush=True)
    print(
        "env:", {k: v for k, v in os.environ.items() if any(s in k for s in ("TORCH", "DYNAMO", "INDUCTOR", "TRITON"))}
    )
    print(
        "dynamo supported:",
        torch._dynamo.is_dynamo_supported(),
        "config.disable:",
        getattr(torch._dynamo.config, "disable", None),
        flush=True,
    )
    try:
        import triton

        print("triton", triton.__version__, flush=True)
    except ImportError as missing:
        print("triton missing:", missing, flush=True)


def _bare_compile(backend: str) -> None:
    counters.clear()
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).cuda()
    block.compile(backend=backend)
    block(torch.randn(4, 8, device="cuda"))
    print(f"bare module.compile(backend={backend!r}) on cuda:", {k: dict(v) for k, v in counters.items()}, flush=True)


if __name__ == "__main__":
    _show_settings()
    for backend in ("eager", "inductor"):
        try:
            _bare_compile(backend)
        except Exception as error:  # print and go on: this script exists to find out
            print(f"backend {backend!r} failed: {type(error).__name__}: {error}", flush=True)
    import test_cuda_training as cases

    counters.clear()
    result = cases.on_gpu({"compiled": {"compile": "regional"}})["compiled"]
    print("Trainer regional compile on cuda: mode", result["compiled"], "graphs per step", result["graphs"])
    print("counters after the Trainer run:", {k: dict(v) for k, v in counters.items()}, flush=True)
