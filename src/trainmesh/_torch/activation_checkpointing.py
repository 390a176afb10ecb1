"""Activation checkpointing: recompute chosen modules' activations in backward instead of storing them.

One entry point, ``apply_activation_checkpointing(model, policy)``, and one query,
``checkpointed_module_paths(model, policy)`` (the memory planner asks it which modules a policy
would wrap, without touching the model). Policies:

- ``None``: nothing.
- ``"full"``: every *block* is recomputed in backward. A block is an element of an
  ``nn.ModuleList`` / ``nn.Sequential`` holding >= 2 children of the same class that has
  parameters (transformer layers, the Linear layers of a Sequential MLP). Only the outermost
  such containers count: the two Linears of a block's own MLP are not blocks.
- ``"every:K"``: blocks 0, K, 2K, ... of each such container.
- ``"selective"``: op-level selective checkpointing (torchtitan's "op" SAC) on every block:
  outputs of compute-heavy ops (matmuls, attention, reduce-scatter) are saved, the cheap
  rest (norms, activations, elementwise) is recomputed.

A model with its own mechanism (a transformers ``PreTrainedModel``: ``activation_checkpointing_enable``,
``gradient_checkpointing_enable`` in older releases) gets it for "full" and "selective"
(non-reentrant; "selective" passes the same op policy as ``context_fn``), which also switches
its KV cache off in training. For the other policies the hooks below are used and
``config.use_cache`` is switched off.
- any other string: a regex, ``re.fullmatch``-ed against ``named_modules()`` paths of the
  submodules; every matching module is checkpointed (of nested matches only the outermost).

Mechanism: torch's composable ``torch.distributed._composable.checkpoint``, which runs the
non-reentrant ``torch.utils.checkpoint`` engine from a forward pre-hook / forward hook pair.
It was chosen over ``checkpoint_wrapper`` because it inserts no ``_checkpoint_wrapped_module``
submodule: parameter names, buffer names, ``state_dict()`` keys and ``named_modules()`` paths
stay exactly as they were, so LayoutMap keys ("<module path>/output" included), checkpoints
and optimizer rebinding are unaffected. Recomputation calls the module again through
``__call__`` (with the checkpoint hooks disabled), so other hooks -- FSDP2's unshard, DTensor
input/output relayout -- run during recomputation as they did in forward. The RNG state is
preserved, so dropout masks are identical in the recomputation.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import partial

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as _composable_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["apply_activation_checkpointing", "checkpointed_module_paths"]

# Marker attribute on every module this file checkpointed, and on the root: the policy string.
_MARK = "_trainmesh_activation_checkpointing"
_EVERY = re.compile(r"every:(\d+)")


def _ops(*names: str) -> set:
    """``torch.ops`` overloads by 'namespace.op.overload' name; ones this torch build lacks are skipped."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        try:
            found.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            pass
    return found


# Outputs saved by "selective" (as torchtitan's op-level SAC, minus its every-other-matmul
# trick): matmuls and attention are where the FLOPs are; recomputing them would cost as much
# as the forward. Reduce-scatter outputs are saved so that recomputation does not communicate.
# ``aten.linear`` / ``aten.matmul`` are composite and reach the dispatch mode as mm/addmm/bmm;
# they are listed for builds where they do not decompose.
_SAVE_OPS = frozenset(
    _ops(
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.linear.default",
        "aten.matmul.default",
        "aten._scaled_mm.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten._flash_attention_forward.default",
        "aten._efficient_attention_forward.default",
        "_c10d_functional.reduce_scatter_tensor.default",
    )
)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _bad(policy, why: str) -> ValueError:
    return ValueError(
        f"activation_checkpointing must be None, 'full', 'selective', 'every:K' with an integer "
        f"K >= 1, or a regex on module paths; {why}. Received: policy={policy!r}"
    )


def _parse(policy):
    """-> (kind, arg): ('none', None) | ('full', None) | ('selective', None) | ('every', K) | ('regex', compiled)."""
    if policy is None:
        return "none", None
    if not isinstance(policy, str):
        raise _bad(policy, f"got a {type(policy).__name__}")
    if policy in ("full", "selective"):
        return policy, None
    if policy.startswith("every"):
        match = _EVERY.fullmatch(policy)
        if match is None or int(match.group(1)) < 1:
            raise _bad(policy, "'every:K' needs an integer K >= 1, e.g. 'every:2'")
        return "every", int(match.group(1))
    if not policy.strip():
        raise _bad(policy, "an empty string is not a policy (use None for no checkpointing)")
    try:
        return "regex", re.compile(policy)
    except re.error as e:
        raise _bad(policy, f"it is not a valid regex ({e})") from None


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_stacks(model: nn.Module) -> list[list[str]]:
    """Paths of the blocks of each outermost repeated-block container, container by container."""
    stacks: list[list[str]] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            counts = Counter(type(child) for _, child in children)
            repeated = {cls for cls, n in counts.items() if n >= 2}
            if getattr(module, "_trainmesh_blocks", False):  # a pipeline stage's blocks, even just one
                repeated = set(counts)
            blocks = [name for name, child in children if type(child) in repeated and _has_params(child)]
            if blocks:
                stacks.append([f"{path}.{name}" if path else name for name in blocks])
                return  # blocks inside blocks are not blocks
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return stacks


def _example_paths(model: nn.Module, n: int = 8) -> str:
    paths = [p for p, _ in model.named_modules() if p]
    more = f", ... ({len(paths)} in all)" if len(paths) > n else ""
    return ", ".join(repr(p) for p in paths[:n]) + more if paths else "(the model has no submodules)"


def _paths(model: nn.Module, kind: str, arg) -> list[str]:
    if kind == "none":
        return []
    if kind == "regex":
        matched: list[str] = []
        for path, _ in model.named_modules():
            if not path or not arg.fullmatch(path):
                continue
            if any(path.startswith(outer + ".") for outer in matched):
                continue  # nested inside a module already matched: the outer one covers it
            matched.append(path)
        if not matched:
            raise ValueError(
                f"activation_checkpointing regex {arg.pattern!r} matches no module path of "
                f"{type(model).__name__} (re.fullmatch against named_modules() paths). Example "
                f"paths: {_example_paths(model)}. Received: policy={arg.pattern!r}"
            )
        return matched
    stacks = _block_stacks(model)
    if not stacks:
        raise ValueError(
            f"activation_checkpointing={kind!r} checkpoints each block of a repeated-block "
            f"container (an nn.ModuleList / nn.Sequential with >= 2 children of one class), "
            f"and {type(model).__name__} has none. Pass a regex on module paths instead, e.g. "
            f"activation_checkpointing=r'layers\\.\\d+'. Module paths: {_example_paths(model)}."
        )
    step = arg if kind == "every" else 1
    return [path for stack in stacks for i, path in enumerate(stack) if i % step == 0]


def checkpointed_module_paths(model: nn.Module, policy) -> list[str]:
    """The ``named_modules()`` paths ``apply_activation_checkpointing(model, policy)`` checkpoints.

    Pure: the model is not changed (works on meta-device models). For "selective" these are the
    blocks that get op-level selective checkpointing. Raises ValueError as the apply would.
    """
    kind, arg = _parse(policy)
    return _paths(model, kind, arg)


def apply_activation_checkpointing(model: nn.Module, policy, *, model_mechanism: bool = True) -> nn.Module:
    """Checkpoint the modules ``policy`` names (see the module docstring); mutates and returns ``model``.

    Names of modules, parameters, buffers and state_dict keys are unchanged. Idempotent:
    applying the same policy again does nothing; applying a different one to a model that
    already has one raises ValueError (checkpoint hooks cannot be re-targeted in place).
    Call it before FSDP / DDP wrapping (torchtitan's order: TP, then AC, then FSDP).
    ``model_mechanism=False`` uses torch's hooks even on a model with its own mechanism (a pipeline
    stage substitutes its first block's input in a hook, which must run outside the recomputed region).
    """
    kind, arg = _parse(policy)
    previous = getattr(model, _MARK, None)
    if previous is not None:
        if previous == policy:
            return model
        raise ValueError(
            f"{type(model).__name__} already has activation_checkpointing={previous!r}; it "
            f"cannot be changed in place (build the model again). Received: policy={policy!r}"
        )
    paths = _paths(model, kind, arg)
    if not paths:
        return model
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) if kind == "selective" else None
    enable_own = _own_mechanism(model) if kind in ("full", "selective") and model_mechanism else None
    if enable_own is not None:
        # The model's own checkpointing (transformers' activation_checkpointing_enable) knows its
        # layers' call conventions and switches its KV cache off while training; recomputing a
        # layer that appends to a cache would append twice.
        enable_own({"use_reentrant": False, **({"context_fn": context_fn} if context_fn else {})})
        setattr(model, _MARK, policy)
        return model
    _switch_off_cache(model)
    modules = dict(model.named_modules())
    for path in paths:
        module = modules[path]
        if _composable_checkpoint.state(module) is not None:
            continue  # already checkpointed (by an earlier call or by the user): never twice
        _composable_checkpoint(module, context_fn=context_fn)
        setattr(module, _MARK, policy)
    setattr(model, _MARK, policy)
    return model


def _own_mechanism(model: nn.Module):
    """``enable(checkpoint_kwargs)`` switching on the model's own checkpointing, or None when it has none.
    Newer transformers call it ``activation_checkpointing_enable`` (the old name warns, and goes in v6)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    current = getattr(model, "activation_checkpointing_enable", None)
    if callable(current):
        return lambda kwargs: current(activation_checkpointing_kwargs=kwargs)
    older = getattr(model, "gradient_checkpointing_enable", None)
    if callable(older):
        return lambda kwargs: older(gradient_checkpointing_kwargs=kwargs)
    return None


def _switch_off_cache(model: nn.Module) -> None:
    """A model with a KV cache (transformers' ``config.use_cache``) must not fill it in a forward that
    will be recomputed: the recomputation would append the same keys again. Training never reads it."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
