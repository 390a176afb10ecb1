"""``MemoryOptions``: the ZeRO stage, shard unit, CPU offload and reduce dtype of a distribution.

Pure metadata, validated at construction (before any process group exists), so a typo fails
on every process the same way instead of hanging one of them in a collective. Turned into
torch machinery by ``trainmesh._torch.parallelize``.

=====  ======================================  ================================================
stage  what is sharded over the batch axis     torch engine
=====  ======================================  ================================================
0      nothing (replicas, all-reduce)          ``DistributedDataParallel``
1      optimizer state (+ gradients at the     FSDP2 ``fully_shard(reshard_after_forward=False)``,
       step, + parameters between steps)       unsharded gradients kept over accumulation
2      + gradients (reduce-scatter)            FSDP2 ``fully_shard(reshard_after_forward=False)``
3      + parameters (gathered per unit, freed) FSDP2 ``fully_shard(reshard_after_forward=True)``;
                                               frozen sub-units kept to backward (``keep_frozen_gathered``)
=====  ======================================  ================================================

Stage 1 is a superset of ZeRO-1, as DeepSpeed's is (``_torch/zero.py`` says why and what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
# Accepted spellings of the gradient-reduction dtype; kept as strings so this module needs no torch.
REDUCE_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _normalise_reduce_dtype(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    if name not in REDUCE_DTYPES:
        raise ValueError(
            f"reduce_dtype must be None or one of {sorted(set(REDUCE_DTYPES.values()))} (a string or torch dtype). "
            f"Received: reduce_dtype={value!r}"
        )
    return REDUCE_DTYPES[name]


def _validate_shard_unit(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(
            f"shard_unit must be None, a module class, a tuple of classes or an int. Received: shard_unit={value!r}"
        )
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"shard_unit as a byte threshold must be >= 1. Received: shard_unit={value!r}")
        return value
    classes = value if isinstance(value, tuple) else (value,)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ValueError(
            "shard_unit must be None, a module class (each instance is one FSDP unit), a tuple of classes, "
            f"or an int byte threshold. Received: shard_unit={value!r}"
        )
    return classes


@dataclass(kw_only=True, frozen=True)
class MemoryOptions:
    """How model state is spread over the batch axis.

    >>> MemoryOptions(zero_stage=3, reduce_dtype="bf16").reduce_dtype
    'bfloat16'
    """

    zero_stage: int = 0
    shard_unit: Any = None  # None | module class | tuple of classes | int byte threshold
    cpu_offload: bool = False
    reduce_dtype: str | None = None  # None: reduce in the parameters' (compute) dtype
    # Stage 3: frozen units (a LoRA base) gathered once per step, kept to backward (``_torch/frozen_units.py``)
    keep_frozen_gathered: bool | str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}. Received: zero_stage={self.zero_stage!r}")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"cpu_offload must be True or False. Received: cpu_offload={self.cpu_offload!r}")
        if self.cpu_offload and self.zero_stage < 2:
            # torch offloads only FSDP2-managed state (CPUOffloadPolicy); DDP/ZeroRedundancyOptimizer cannot.
            raise ValueError(
                "cpu_offload=True needs zero_stage 2 or 3 (FSDP2's CPUOffloadPolicy). "
                f"Received: zero_stage={self.zero_stage!r}, cpu_offload=True"
            )
        if not (isinstance(self.keep_frozen_gathered, bool) or self.keep_frozen_gathered == "auto"):
            raise ValueError(
                "keep_frozen_gathered must be True, False or 'auto'. "
                f"Received: keep_frozen_gathered={self.keep_frozen_gathered!r}"
            )
        object.__setattr__(self, "shard_unit", _validate_shard_unit(self.shard_unit))
        object.__setattr__(self, "reduce_dtype", _normalise_reduce_dtype(self.reduce_dtype))

    def replace(self, **changes: Any) -> "MemoryOptions":
        """A copy with ``changes`` (``None`` values keep the current setting)."""
        values = {
            "zero_stage": self.zero_stage,
            "shard_unit": self.shard_unit,
            "cpu_offload": self.cpu_offload,
            "reduce_dtype": self.reduce_dtype,
            "keep_frozen_gathered": self.keep_frozen_gathered,
        }
        values.update({k: v for k, v in changes.items() if v is not None})
        return MemoryOptions(**values)
