"""Replicated parameters whose gradients arrive partial over the model axis, completed by one all-reduce.

Under tensor parallelism some replicated parameters see only this process's share of the activations,
so autograd gives each process a part of their gradient:

* the norms of a sequence-parallel residual stream (``sequence_parallel.py``): 1/TP of the tokens;
* modules a transformers model's own plan marks ``"replicated_with_grad_allreduce"``: Qwen3's
  ``q_norm`` / ``k_norm``, which normalise each head of the column-wise q/k projections' output, so
  each process sees only its own heads.

Both become replicated DTensors on the model axis; their inputs are DTensors sharded along a dim other
than the one they reduce over, so DTensor marks the weight's gradient ``Partial``, and
``complete_partial_grad`` all-reduces it the moment it is accumulated. The placements record whether a
gradient is summed yet, so gradient accumulation (a ``Partial`` added to an already completed one) and
FSDP2 (which redistributes a DTensor gradient to its parameter's placements itself) stay exact, where a
plain ``all_reduce`` in a hook would sum an accumulated gradient twice.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

GRAD_ALLREDUCE = "replicated_with_grad_allreduce"  # transformers' name for such an entry of its TP plan


def complete_partial_grad(param) -> None:
    """A gradient that arrived partial (each process summed over its own share): one all-reduce over the
    model axis, as it is accumulated, so clipping and the optimizer see the whole gradient."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def replicate_with_partial_grads(module: nn.Module, device_mesh) -> None:
    """``module``'s own parameters as replicated DTensors whose gradients ``complete_partial_grad`` sums."""
    for name, param in list(module.named_parameters(recurse=False)):
        dparam = nn.Parameter(
            DTensor.from_local(param.detach(), device_mesh, [Replicate()] * device_mesh.ndim, run_check=False),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dparam)
        if dparam.requires_grad:
            dparam.register_post_accumulate_grad_hook(complete_partial_grad)


def _shipped_patterns(model: nn.Module) -> list[str]:
    """Module-path regexes of the ``replicated_with_grad_allreduce`` entries of every transformers plan in
    ``model`` (the base model's ``config.base_model_tp_plan``, keyed below its ``base_model_prefix``)."""
    patterns = []
    for path, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if not plan or not any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
            continue
        prefix = getattr(module, "base_model_prefix", "") or ""
        prefix = ".".join(p for p in (path, prefix if hasattr(module, prefix) else "") if p)
        for key, style in plan.items():
            if style == GRAD_ALLREDUCE:
                escaped = re.escape(key).replace(r"\*", r"\d+")
                patterns.append((re.escape(prefix) + r"\." if prefix else "") + escaped)
        break  # the outermost transformers model carries the plan; inner ones repeat it
    return patterns


def apply_grad_allreduce_modules(model: nn.Module, plans: dict, device_mesh) -> list[str]:
    """The modules a shipped plan marks ``replicated_with_grad_allreduce`` whose unit keeps a column-wise
    projection's output sharded (else their input is whole and their gradient complete already).

    Their input (a q/k projection's output viewed ``[batch, seq, heads/TP, head_dim]``) enters as a
    DTensor sharded over the heads (dim -2; the norm reduces over the last dim, so each process's
    numbers are exactly the one-process ones for its heads) and leaves as the local tensor it was.
    Returns their paths."""
    patterns = _shipped_patterns(model)
    sharded_units = {p.rsplit(".", 1)[0] for p in plans if plans[p].style == "colwise" and not plans[p].gather_output}
    applied = []
    for path, module in model.named_modules():
        if not any(re.fullmatch(pattern, path) for pattern in patterns) or path in plans:
            continue
        if (path.rsplit(".", 1)[0] if "." in path else "") not in sharded_units:
            continue

        def to_dtensor(module, args, mesh=device_mesh):
            x = args[0]
            if isinstance(x, DTensor) or x.dim() < 2:
                return args
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)] * mesh.ndim, run_check=False), *args[1:])

        def to_local(module, args, output):
            return output.to_local() if isinstance(output, DTensor) else output

        replicate_with_partial_grads(module, device_mesh)
        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(to_local)
        applied.append(path)
    return applied
