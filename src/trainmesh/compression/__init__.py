"""Gradient compression: pure tensor transforms with state (no communication, no trainmesh imports).

``get_compressor("topk:0.01")`` etc.; see ``docs/compression.md``.
"""

from .base import Compressed, Compressor
from .bf16 import BF16Compressor
from .fp16 import FP16Compressor
from .int8 import Int8Compressor
from .powersgd import PowerSGDCompressor
from .registry import KNOWN_SPECS, get_compressor
from .topk import TopKCompressor

__all__ = [
    "BF16Compressor",
    "Compressed",
    "Compressor",
    "FP16Compressor",
    "Int8Compressor",
    "KNOWN_SPECS",
    "PowerSGDCompressor",
    "TopKCompressor",
    "get_compressor",
]
