"""trainer_overhead.py's shared setup: the variants of each part and the comparisons made between them,
the DDP settings every DDP side gets, the MLP and its batches, and the order variants run in each round
(``round_order``, which the other step-time benchmarks import through ``trainer_overhead``).

It exists apart from the script because the worker (``trainer_overhead_worker.py``) and the report
(``trainer_overhead_report.py``) both read it: one definition of the work every variant does.
"""

from __future__ import annotations


import torch
from torch import nn


PARAM_TOLERANCE = 1e-5
IN_DIM, HIDDEN, OUT_DIM = 512, 1536, 512  # 512->1536->1536->512: 3.94M parameters
# Every DDP setting every DDP side uses, stated in the output. The Trainer's DataParallel defaults to
# gradient_as_bucket_view=True; the hand-written DDP, Accelerate and Fabric get exactly the same
# (torch's other DDP defaults apply to all: bucket_cap_mb=25, broadcast_buffers=True).
DDP_KWARGS = {"gradient_as_bucket_view": True}

# Part (a), one process. "hand-written-ddp" is a diagnostic: the same hand loop under torch DDP on the
# 1-process group, which is what the Trainer's model is wrapped in; it splits the Trainer's cost
# into "DDP on one process" and "the Trainer's own loop".
SINGLE = ("trainmesh", "hand-written", "hand-written-ddp")
# Part (b), two processes. "trainmesh-unchecked" is a diagnostic: the Trainer without its per-step
# agreement (``nonfinite_loss=None``, the loss reduced once at the end), which the peers do not do;
# it splits the Trainer's cost into "that one small all-reduce per step" and everything else.
MULTI = ("trainmesh", "accelerate", "fabric", "trainmesh-unchecked")
# (numerator, denominator, target or None, role). Headline: the Trainer as users get it (log_every_n_steps=1).
COMPARISONS = {
    "single": [
        ("trainmesh", "hand-written", 1.02, "headline"),
        ("hand-written-ddp", "hand-written", None, "diagnostic"),
        ("trainmesh", "hand-written-ddp", None, "diagnostic"),
    ],
    "multi": [
        ("trainmesh", "accelerate", 1.00, "headline"),
        ("trainmesh", "fabric", 1.00, "headline"),
        ("trainmesh", "trainmesh-unchecked", None, "diagnostic"),
        ("trainmesh-unchecked", "fabric", None, "diagnostic"),
    ],
}


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same seed -> bit-identical initial weights for every variant
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT_DIM)
    )


def make_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One distinct global batch for every step a variant takes: the Trainer sees the whole run as
    one epoch (so its per-epoch work, a forced loss sync on the last step and an all-reduce at the
    end, is not charged to every round), and every variant's k-th step uses global batch k."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # identical on every process, no broadcast needed
    n = cfg["rounds"] * (cfg["warmup"] + cfg["steps"]) * cfg["batch"]
    return torch.randn(n, IN_DIM, generator=gen), torch.randn(n, OUT_DIM, generator=gen)


def round_order(variants: tuple[str, ...], r: int) -> list[str]:
    """Rotate by one each round and reverse every other cycle: each variant takes every position,
    and follows every other variant, equally often (for two variants: ab, ba, ba, ab, ...)."""
    n = len(variants)
    order = list(variants[r % n :] + variants[: r % n])
    return order[::-1] if (r // n) % 2 else order
