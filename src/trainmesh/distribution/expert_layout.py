"""Experts in the layout API: which modules of a model are mixtures of experts, and how their
expert dimension is laid out over a mesh axis (expert parallelism, EP).

An *experts module* holds every expert's weights stacked on dim 0 (transformers' MoE models since
5.0: ``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``, ``DeepseekV3NaiveMoe``, ...: 3-D
``gate_up_proj`` / ``down_proj`` of shape ``(num_experts, ...)``) and is called as
``experts(hidden_states, top_k_index, top_k_weights)`` by its MoE block after the block's router
chose each token's top-k experts. Expert parallelism lays dim 0 of those weights over a mesh axis:

    layout_map["model.layers.*.mlp.experts.gate_up_proj"] = ("data", None, None)

or ``LayoutMap.auto(model, mesh, expert_axis="data")``, which takes the experts from transformers'
``base_model_ep_plan`` where the model ships one and from the module tree otherwise (a module with
an int ``num_experts`` and 3-D parameters of that many rows), adds one such entry per expert
parameter and prints them.

Everything here is pure description (module types, shapes, signatures); the dispatch itself is
``trainmesh._torch.expert_parallel``. The checks raise ``ValueError`` naming the module and the axis
before any collective: a number of experts that does not divide over the axis, an expert layout on
a model without experts, an experts module whose call or router is not the top-k form above, and
a partial or non-dim-0 layout of one experts module.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

from .mesh import DeviceMesh

# The call an experts module must accept: transformers' ``use_experts_implementation`` contract.
_EXPERTS_CALL = ("hidden_states", "top_k_index", "top_k_weights")
# The same call under other names: GPT-OSS's experts take (hidden_states, router_indices, routing_weights),
# the same tensors in the same positions (indices and weights both (tokens, top_k)); the dispatcher calls
# the local experts positionally, so these run unchanged.
_EXPERTS_CALLS = (_EXPERTS_CALL, ("hidden_states", "router_indices", "routing_weights"))
# The attribute names routers carry their k under (transformers' routers: ``top_k``).
_TOP_K_NAMES = ("top_k", "num_experts_per_tok")


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module: its path, number of experts and the names of its stacked parameters."""

    path: str
    num_experts: int
    param_names: tuple[str, ...]
    router_path: str | None

    def param_paths(self) -> list[str]:
        return [f"{self.path}.{name}" if self.path else name for name in self.param_names]


def _num_experts(module: nn.Module) -> int | None:
    for name in ("num_experts", "num_local_experts"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _stacked_params(module: nn.Module, num_experts: int) -> tuple[str, ...]:
    """Parameters stacked over the experts on dim 0, if the module holds at least one 3-D one (expert
    weights; their 2-D biases come with them). A router's 2-D (num_experts, hidden) weight alone is not."""
    stacked = [
        (name, p) for name, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts
    ]
    return tuple(name for name, _ in stacked) if any(p.dim() >= 3 for _, p in stacked) else ()


def _shipped_patterns(model: nn.Module) -> list[str]:
    """Regexes of the experts modules named by transformers' ``base_model_ep_plan`` (full paths)."""
    from .auto_layout import _hf_pattern, _transformers_root

    root_path, root = _transformers_root(model)
    plan = getattr(getattr(root, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(root, "base_model_prefix", "") or ""
    if prefix and not hasattr(root, prefix):
        prefix = ""
    prefix = ".".join(p for p in (root_path, prefix) if p)
    return [_hf_pattern(prefix, key) for key, style in plan.items() if style == "ep_dispatch_experts"]


def find_experts(model: nn.Module) -> tuple[list[ExpertsModule], str]:
    """Every experts module of ``model`` and where they were found ("the model's own
    base_model_ep_plan" or "the module tree"). Pure: reads module attributes only."""
    patterns = _shipped_patterns(model)
    source = "the model's own base_model_ep_plan" if patterns else "the module tree"
    found: list[ExpertsModule] = []
    for path, module in model.named_modules():
        if patterns and not any(re.fullmatch(p, path) for p in patterns):
            continue
        num = _num_experts(module)
        if num is None:
            continue
        names = _stacked_params(module, num)
        if not names:
            continue
        found.append(ExpertsModule(path, num, names, _router_path(model, path)))
    return found, source


def _router_path(model: nn.Module, experts_path: str) -> str | None:
    """The sibling module that routes tokens to these experts (``gate`` / ``router``), if any."""
    parent_path = experts_path.rsplit(".", 1)[0] if "." in experts_path else ""
    parent = model.get_submodule(parent_path) if parent_path else model
    for name in ("gate", "router"):
        if isinstance(getattr(parent, name, None), nn.Module):
            return f"{parent_path}.{name}" if parent_path else name
    return None


def check_supported(model: nn.Module, experts: ExpertsModule, axis: str) -> None:
    """ValueError unless ``experts`` is called as ``(hidden_states, top_k_index, top_k_weights)`` and
    its router is a top-k router (the only routing trainmesh dispatches)."""
    module = model.get_submodule(experts.path)
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        params = []
    wrapped = getattr(type(module).forward, "__wrapped__", None)  # transformers' experts interface
    if wrapped is not None:
        params = list(inspect.signature(wrapped).parameters)[1:4]
    if tuple(params) not in _EXPERTS_CALLS:
        raise ValueError(
            f"Experts module {experts.path!r} ({type(module).__name__}) cannot be laid out over axis {axis!r}: "
            f"trainmesh dispatches experts called as forward{_EXPERTS_CALL} (transformers' experts "
            f"interface). Received: forward parameters {tuple(params)}"
        )
    if experts.router_path is None:
        raise ValueError(
            f"Experts module {experts.path!r} has no router beside it ('gate' or 'router'), so its routing "
            f"cannot be checked for expert parallelism over axis {axis!r}. Received: siblings of {experts.path!r}"
        )
    router = model.get_submodule(experts.router_path)
    top_k = next((getattr(router, n) for n in _TOP_K_NAMES if isinstance(getattr(router, n, None), int)), None)
    if top_k is None or not 0 < top_k <= experts.num_experts:
        raise ValueError(
            f"Router {experts.router_path!r} ({type(router).__name__}) is not a supported router for expert "
            f"parallelism over axis {axis!r}: trainmesh dispatches top-k routing (a router with an int "
            f"'top_k' between 1 and num_experts={experts.num_experts}). Received: top_k={top_k!r}"
        )


def check_divisible(experts: ExpertsModule, axis: str, size: int, axis_size: int | None = None) -> None:
    if experts.num_experts % size:
        where = f"mesh axis {axis!r} of size {size}"
        received = f"{axis}={size}"
        if axis_size not in (None, size):
            where = f"expert_parallel_size={size} processes of mesh axis {axis!r} (size {axis_size})"
            received = f"expert_parallel_size={size}"
        raise ValueError(
            f"Experts module {experts.path!r} holds {experts.num_experts} experts, which do not divide over "
            f"{where}: expert parallelism gives every process the same number of whole experts. "
            f"Received: num_experts={experts.num_experts}, {received}"
        )


def check_expert_parallel_size(ep_size, axis: str, axis_size: int) -> int:
    """The number of processes one set of experts is split over: the whole axis by default, or a divisor
    of it (EP 2 on a batch axis of 4: two groups of 2 processes, each group holding every expert once)."""
    if ep_size is None:
        return axis_size
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or axis_size % ep_size:
        raise ValueError(
            f"expert_parallel_size must be a positive divisor of the size of expert axis {axis!r} ({axis_size}): "
            f"the axis splits into groups of that many processes, each group holding every expert once. "
            f"Received: expert_parallel_size={ep_size!r}"
        )
    return ep_size


def expert_layouts(
    model: nn.Module, device_mesh: DeviceMesh, axis: str, ep_size: int | None = None
) -> tuple[dict[str, tuple], list[str], str]:
    """``{parameter path: (axis, None, ...)}`` for every expert parameter, checked; notes; source.

    Raises ValueError when ``model`` has no experts, or when an experts module is unsupported or does
    not divide over ``axis`` (or over ``ep_size`` processes of it)."""
    if axis not in device_mesh.axis_names:
        raise ValueError(
            f"expert_axis {axis!r} is not an axis of the mesh {device_mesh.axis_names}. Received: expert_axis={axis!r}"
        )
    found, source = find_experts(model)
    if not found:
        raise ValueError(
            f"expert_axis={axis!r} was given but {type(model).__name__} has no experts module (a module with an "
            f"int num_experts and parameters stacked over that many experts on dim 0; transformers' MoE models). "
            f"Received: expert_axis={axis!r}"
        )
    size = check_expert_parallel_size(ep_size, axis, device_mesh.axis_size(axis))
    layouts: dict[str, tuple] = {}
    for experts in found:
        check_supported(model, experts, axis)
        check_divisible(experts, axis, size, device_mesh.axis_size(axis))
        for path, name in zip(experts.param_paths(), experts.param_names):
            ndim = model.get_parameter(path).dim()
            layouts[path] = (axis,) + (None,) * (ndim - 1)
    axis_size = device_mesh.axis_size(axis)
    groups = f" in {axis_size // size} groups of {size} processes" if size < axis_size else ""
    notes = [
        f"{len(found)} experts modules of {found[0].num_experts} experts: {found[0].num_experts // size} "
        f"per process over {axis}={axis_size}{groups}"
    ]
    return layouts, notes, source


@dataclass(frozen=True)
class ExpertPlan:
    """What ``_torch.expert_parallel`` applies: the experts modules laid out over ``axis``."""

    axis: str
    size: int  # EP: the processes one set of experts is split over
    modules: tuple[ExpertsModule, ...]
    axis_size: int = 0  # the expert axis's size; a multiple of ``size`` (0: equal to it)

    @property
    def replicas(self) -> int:
        """How many groups of ``size`` processes along the axis each hold every expert."""
        return self.axis_size // self.size if self.axis_size else 1

    def param_paths(self) -> set[str]:
        return {p for m in self.modules for p in m.param_paths()}


def build_expert_plan(model: nn.Module, distribution) -> ExpertPlan | None:
    """The expert plan a ModelParallel's layout map asks for, validated; None without expert entries.

    An expert entry is a layout that shards dim 0 of an experts module's stacked parameter, or any
    key naming ``experts`` (so that a map written for a MoE model fails loudly on a dense one)."""
    layout_map = getattr(distribution, "layout_map", None)
    if layout_map is None:
        return None
    mesh = distribution.device_mesh
    found, _ = find_experts(model)
    if not found:
        keys = [k for k in layout_map if "experts" in k and any(a is not None for a in layout_map[k].axes)]
        if keys:
            raise ValueError(
                f"The LayoutMap lays out experts ({keys[0]!r}) but {type(model).__name__} has no experts module "
                f"(a module with an int num_experts and parameters stacked over that many experts). "
                f"Received: {keys[0]!r}={layout_map[keys[0]].axes}"
            )
        return None
    axes_by_module: dict[str, set] = {}
    for experts in found:
        for path in experts.param_paths():
            layout = layout_map[path]
            axes = layout.axes if layout is not None else None
            if axes is not None and any(a is not None for a in axes[1:]):
                raise ValueError(
                    f"Expert parameter {path!r} may be laid out over a mesh axis on its expert dim (dim 0) only; "
                    f"splitting inside an expert is not offered. Received: {path!r}={axes}"
                )
            axes_by_module.setdefault(experts.path, set()).add(axes[0] if axes else None)
    used = {a for axes in axes_by_module.values() for a in axes}
    if used == {None}:
        return None
    for path, axes in axes_by_module.items():
        if len(axes) > 1:
            raise ValueError(
                f"The parameters of experts module {path!r} are laid out over different axes ({sorted(map(str, axes))}); "
                f"all of one module's expert parameters go over the same axis. Received: {sorted(map(str, axes))}"
            )
    named = used - {None}
    if len(named) > 1:
        raise ValueError(f"All experts modules must use one expert axis. Received: {sorted(named)}")
    axis = named.pop()
    axis_size = mesh.axis_size(axis)
    sequence = getattr(distribution, "sequence", None)
    pipeline = getattr(distribution, "pipeline", None)
    if sequence is not None and sequence.axis_size > 1 and pipeline is not None and mesh.axis_size(pipeline.axis) > 1:
        # Beside a sequence axis the experts' gradients are averaged over the processes that hold the same
        # experts (``_torch/expert_grads.py``); the pipeline runner reduces a stage's gradients its own way
        # after the schedule, and that path has not been checked against one process with both axes.
        raise ValueError(
            f"Experts laid out over {axis!r} beside a sequence axis {sequence.axis!r} and a pipeline over "
            f"{pipeline.axis!r} are not offered: experts module {found[0].path!r} would have its gradients "
            f"reduced by the pipeline runner, which is not checked against one process with a sequence axis. "
            f"Drop one of the three axes. Received: expert axis {axis!r}, sequence_dim_name={sequence.axis!r}, "
            f"pipeline axis {pipeline.axis!r}"
        )
    size = check_expert_parallel_size(getattr(layout_map, "expert_parallel_size", None), axis, axis_size)
    if size < axis_size and axis != distribution.batch_dim_name:
        # Groups along a non-batch axis would see the same tokens; only the batch axis is offered.
        raise ValueError(
            f"expert_parallel_size={size} smaller than expert axis {axis!r} ({axis_size}) is offered on the batch "
            f"axis only ({distribution.batch_dim_name!r}). Received: expert axis {axis!r}, "
            f"expert_parallel_size={size}"
        )
    modules = tuple(m for m in found if axes_by_module[m.path] == {axis})
    for experts in modules:
        check_supported(model, experts, axis)
        check_divisible(experts, axis, size, axis_size)
    return ExpertPlan(axis, size, modules, axis_size)
