"""bf16 compression: cast to bfloat16 for the wire (2x fewer bytes than fp32).

fp32's exponent range (no overflow, unlike fp16) with 8 bits of mantissa; summable like fp16.
Pairs well with error feedback when the rounding error matters.
"""

from __future__ import annotations

import torch

from .fp16 import CastCompressor


class BF16Compressor(CastCompressor):
    """Cast to bfloat16 for the wire; optional error feedback keeps the rounding error."""

    name = "bf16"
    wire_dtype = torch.bfloat16

    def __init__(self, *, error_feedback: bool = False) -> None:
        super().__init__(error_feedback=error_feedback)
