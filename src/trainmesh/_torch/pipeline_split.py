"""Split an unmodified model into pipeline stages by pruning copies of its module tree.

A stage is a copy of the whole model in which only its own blocks remain, so the model's own
``forward`` (position ids, masks, rotary tables and all) runs unchanged and every parameter
keeps its global name (``model.layers.5.mlp.up_proj.weight``): layouts, checkpoints and
optimizer state line up across layouts. What it needs from the model, and nothing more:

* one container of repeated blocks (``nn.ModuleList`` / ``nn.Sequential``), the hidden state
  entering each block as its first argument and leaving as its output;
* parameters outside the blocks live in modules of their own (embeddings before the blocks,
  norms and head after them), not directly on the model.

On a stage that is not the first, the modules before the blocks become parameter-free stubs
(an embedding returns zeros of its output shape, which the stage then discards: the received
activation replaces the first block's input). On a stage that is not the last, the modules
after the blocks pass their input through, so the model's output *is* the hidden state after
this stage's last block. torchtitan prunes the same way (its models tolerate ``None``
modules); stubs let models that were not written for it run too.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import torch
from torch import nn

from .activation_checkpointing import _block_stacks
from .pipeline_frozen import split_points_for
from .pipeline_zero_bubble import not_a_view


class KeyedBlocks(nn.ModuleList):
    """A ModuleList that keeps its blocks' original indices as names (``layers.4``, ``layers.5``),
    so parameter names stay global; iteration, ``len`` and slicing see only the blocks held."""

    _trainmesh_blocks = True  # checkpointing and FSDP units treat every child as a block

    def __init__(self, modules=None):
        super().__init__()
        if isinstance(modules, dict):
            for key, module in modules.items():
                self.add_module(str(key), module)
        elif modules is not None:
            for index, module in enumerate(modules):
                self.add_module(str(index), module)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return KeyedBlocks(list(self._modules.values())[idx])
        return list(self._modules.values())[idx]


class EmbeddingStub(nn.Module):
    """An embedding on a stage that does not hold it: zeros of its output shape, no parameters."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.embedding_dim, self.dtype = embedding_dim, dtype

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)


class PassThrough(nn.Module):
    """A module held by another stage: returns its first input unchanged (a copy, when a view: a
    causal LM slices its hidden state before the head, and the split backward of the zero-bubble
    schedules cannot take a view as a stage's output; see ``pipeline_zero_bubble``)."""

    def forward(self, x, *args, **kwargs):
        return not_a_view(x) if torch.is_tensor(x) else x


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """Path of the repeated-block container and its block names, in order."""
    stacks = _block_stacks(model)
    if not stacks:
        raise ValueError(
            f"A pipeline splits a model's repeated blocks (an nn.ModuleList / nn.Sequential of >= 2 "
            f"modules of one class), and {type(model).__name__} has none."
        )
    stack = max(stacks, key=len)
    container = stack[0].rsplit(".", 1)[0] if "." in stack[0] else ""
    return container, [path.rsplit(".", 1)[-1] for path in stack]


def outer_modules(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Modules holding parameters outside the blocks: (before the blocks, after them), in the
    order they are registered, which is the order a transformer runs them."""
    before, after, seen_container = [], [], False
    ancestors = {container.rsplit(".", i)[0] for i in range(container.count(".") + 1)} | {""} if container else {""}
    for path, module in model.named_modules():
        if path == container:
            seen_container = True
            continue
        if container and path.startswith(container + "."):
            continue
        direct = [name for name, _ in module.named_parameters(recurse=False)]
        if not direct:
            continue
        if path in ancestors:
            raise ValueError(
                f"A pipeline needs parameters outside the blocks to live in modules of their own; "
                f"{type(module).__name__} at {path or '<root>'!r} holds {direct} directly."
            )
        if any(path.startswith(p + ".") for p in before + after):
            continue  # inside a module already claimed
        (after if seen_container else before).append(path)
    return before, after


def _block_costs(model: nn.Module, container: str, blocks: list[str], balance: str, example=None) -> list[float]:
    parent = model.get_submodule(container) if container else model
    if balance == "params" or example is None:
        return [float(sum(p.numel() for p in parent.get_submodule(b).parameters())) for b in blocks]
    costs = []
    for name in blocks:  # forward+backward of each block on the example hidden state
        block, x = parent.get_submodule(name), example.detach().clone().requires_grad_(True)
        start = time.perf_counter()
        for _ in range(3):
            out = block(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        costs.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
    return costs


def assign_blocks(
    model: nn.Module, num_stages: int, split_points: str | Sequence[str] = "auto", balance: str = "params", example=None
) -> tuple[str, list[list[str]]]:
    """The block names of every stage (contiguous runs, in order)."""
    container, blocks = find_blocks(model)
    if num_stages > len(blocks):
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks; "
            f"{type(model).__name__} has {len(blocks)} in {container!r}."
        )
    if not isinstance(split_points, str):
        points = split_points_for(model, split_points)  # a peft model's blocks by their base model's names too
        return container, split_at(blocks, points, num_stages, prefix=f"{container}." if container else "")
    return container, _balanced(blocks, _block_costs(model, container, blocks, balance, example), num_stages)


def split_at(blocks: list[str], points: Sequence[str], num_stages: int, *, prefix: str = "") -> list[list[str]]:
    """Blocks per stage when ``points`` name the blocks (``prefix`` + name) that begin stages 1, 2, ..."""
    starts = []
    for point in points:
        name = point[len(prefix) :] if point.startswith(prefix) else point
        if name not in blocks:
            raise ValueError(
                f"Split point {point!r} names no block; blocks are {prefix}{blocks[0]} .. "
                f"{prefix}{blocks[-1]}. Received: split_points={list(points)}"
            )
        starts.append(blocks.index(name))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(
            f"Split points must name distinct blocks after the first, in order. Received: split_points={list(points)}"
        )
    bounds = [0, *starts, len(blocks)]
    return [blocks[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def _balanced(blocks: list[str], costs: list[float], num_stages: int) -> list[list[str]]:
    """Contiguous partition minimising the largest stage cost (exact, by dynamic programming)."""
    n = len(blocks)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for end in range(s, n - (num_stages - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], prefix[end] - prefix[start])
                if value < best[s][end] - 1e-12:
                    best[s][end], cut[s][end] = value, start
    bounds, end = [n], n
    for s in range(num_stages, 0, -1):
        end = cut[s][end]
        bounds.append(end)
    bounds.reverse()
    return [blocks[bounds[i] : bounds[i + 1]] for i in range(num_stages)]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


def build_stage_model(
    model: nn.Module, container: str, stage_blocks: list[list[str]], stage_index: int, *, copy_model: bool = True
) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage_index``'s blocks (and, on the first / last stage,
    the modules before / after the blocks). Parameter names stay those of the whole model."""
    before, after = outer_modules(model, container)
    num_stages = len(stage_blocks)
    stage = (
        _copy_holding_only(
            model,
            container,
            stage_blocks[stage_index],
            before if stage_index == 0 else [],
            after if stage_index == num_stages - 1 else [],
        )
        if copy_model
        else model
    )
    parent = stage.get_submodule(container) if container else stage
    keep = {name: parent.get_submodule(name) for name in stage_blocks[stage_index]}
    _replace(stage, container, KeyedBlocks(keep))
    if stage_index > 0:
        for path in before:
            module = stage.get_submodule(path)
            stub = (
                EmbeddingStub(module.embedding_dim, module.weight.dtype)
                if isinstance(module, nn.Embedding)
                else PassThrough()
            )
            _replace(stage, path, stub)
    if stage_index < num_stages - 1:
        for path in after:
            _replace(stage, path, PassThrough())
    stage._trainmesh_stage = (stage_index, num_stages, container, list(keep))
    return stage


def _copy_holding_only(
    model: nn.Module, container: str, blocks: list[str], before: list[str], after: list[str]
) -> nn.Module:
    """``copy.deepcopy(model)`` that copies only the parameters this stage keeps (its blocks and the
    outer modules it holds); every other parameter becomes an empty meta placeholder, soon replaced
    by a stub. A stage copy then costs its own parameters, not the whole model's, per stage held."""
    parent = model.get_submodule(container) if container else model
    kept = [parent.get_submodule(name) for name in blocks] + [model.get_submodule(p) for p in before + after]
    keep = {id(p) for module in kept for p in module.parameters()}
    memo = {
        id(p): nn.Parameter(torch.empty(0, device="meta", dtype=p.dtype), requires_grad=p.requires_grad)
        for p in model.parameters()
        if id(p) not in keep
    }
    return copy.deepcopy(model, memo)


def merge_stage_models(stages: list[nn.Module]) -> nn.Module:
    """One module tree over several stage copies held by one process (interleaved schedules): their
    blocks under one container, each outer module from the copy that really holds it. It shares
    every parameter with the copies, for the optimizer and checkpoints; forward runs on the copies."""
    if len(stages) == 1:
        return stages[0]
    return _merge(stages)


def _is_stub(module: nn.Module) -> bool:
    return isinstance(module, (EmbeddingStub, PassThrough))


def _merge(modules: list[nn.Module]) -> nn.Module:
    real = [m for m in modules if not _is_stub(m)]
    if not real:
        return modules[0]
    if len({id(m) for m in real}) == 1 or not any(True for _ in real[0].children()):
        return real[0]  # a leaf (or one shared object): take the copy that holds it
    base = real[0]
    merged = object.__new__(base.__class__)  # not the class's __new__ (FSDP2's classes re-run __init__)
    merged.__dict__ = dict(base.__dict__)
    merged._modules = {}
    merged._parameters = dict(base._parameters)
    merged._buffers = dict(base._buffers)
    names = []
    for module in real:
        names += [n for n in module._modules if n not in names]
    for name in names:
        children = [m._modules[name] for m in real if m._modules.get(name) is not None]
        merged._modules[name] = _merge(children) if children else None
    if isinstance(base, KeyedBlocks):  # blocks in global order
        merged._modules = dict(sorted(merged._modules.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
    return merged
