"""Which kind of x86 CPU this is, as far as bf16 matmuls go: the question that splits them 400-fold.

torch computes a bf16 matmul on tile units with AMX (2-4x fp32's speed or more), on AVX512-BF16
dot products (faster than fp32 by a factor that varies by CPU), and with AVX2 alone by a fallback
~45x slower than fp32. torch's own feature detection (``torch.cpu``, the cpuinfo library its
kernels dispatch on) says which; where it cannot (another architecture, an older torch), the kind
is ``"other"`` and callers measure instead of assuming.

>>> cpu_kind() in CPU_KINDS
True
"""

from __future__ import annotations

import torch

# Best first: a CPU with AMX also has AVX512-BF16, and one with AVX512-BF16 has AVX512.
CPU_KINDS = ("amx", "avx512_bf16", "avx512", "avx2", "other")
_NAMES = {
    "amx": "AMX",
    "avx512_bf16": "AVX512-BF16",
    "avx512": "AVX512 without BF16",
    "avx2": "AVX2 only",
    "other": "no x86 vector extension torch reports",
}
# torch.cpu's detectors (private, present since torch 2.1): feature name -> function name.
_DETECTORS = {
    "amx": "_is_amx_tile_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512": "_is_avx512_supported",
    "avx2": "_is_avx2_supported",
}


def cpu_features() -> frozenset[str]:
    """The features of ``CPU_KINDS`` torch detects on this CPU (empty where it detects none)."""
    found = set()
    for feature, name in _DETECTORS.items():
        detector = getattr(torch.cpu, name, None)
        try:
            if detector is not None and detector():
                found.add(feature)
        except (RuntimeError, OSError):  # a detector that cannot tell is a feature we do not count on
            pass
    return frozenset(found)


def cpu_kind() -> str:
    """The best of ``CPU_KINDS`` this CPU has, from :func:`cpu_features`."""
    features = cpu_features()
    return next((kind for kind in CPU_KINDS if kind in features), "other")


def describe_cpu_kind(kind: str) -> str:
    """How a message names ``kind`` ("AMX", "AVX2 only", ...)."""
    if kind not in _NAMES:
        raise ValueError(f"kind must be one of {CPU_KINDS}. Received: kind={kind!r}")
    return _NAMES[kind]
