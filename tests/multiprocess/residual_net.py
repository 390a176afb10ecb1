"""The small transformer-ish model of the ZeRO and compile tests: residual MLP blocks in a
ModuleList (the default FSDP units and compile regions), an input layer and a head; seeded."""

from __future__ import annotations

import torch


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, hidden)
        self.down = torch.nn.Linear(hidden, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([Block(hidden), Block(hidden)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
