"""The regression task the compression tests train on: a noisy two-layer teacher, 16 inputs,
1,920 samples, and the same 3-layer MLP student (seeded) on every process and every run."""

from __future__ import annotations

import torch

IN, HIDDEN, N_SAMPLES = 16, 96, 1920


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, IN, generator=g)
    teacher_in, teacher_out = torch.randn(IN, 32, generator=g) / IN**0.5, torch.randn(32, 1, generator=g)
    y = torch.tanh(x @ teacher_in) @ teacher_out
    return x, y / y.std() + 0.25 * torch.randn(y.shape, generator=g)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )
