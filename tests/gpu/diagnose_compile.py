"""Why a compiled model would run eager on this GPU machine: dynamo's counters on a bare
``module.compile()`` and on the Trainer's regional compile (run: python tests/gpu/diagnose_compile.py)."""

import sys
import os

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(__file__))

if __name__ == "__main__":
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).cuda()
    block.compile()
    block(torch.randn(4, 8, device="cuda"))
    print("bare module.compile on cuda:", dict(counters["stats"]), flush=True)
    import test_cuda_training as cases

    result = cases.on_gpu({"compiled": {"compile": "regional"}})["compiled"]
    print("Trainer regional compile on cuda: mode", result["compiled"], "graphs per step", result["graphs"])
