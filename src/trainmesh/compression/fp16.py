"""fp16 compression: cast to half precision for the wire (2x fewer bytes than fp32).

Like DDP's ``fp16_compress_hook`` and Horovod's ``Compression.fp16``: the halves can be summed
by an all-reduce (``summable``). Values beyond fp16's range (|x| > 65504) become inf, which a
loss scaler or non-finite guard then sees; use bf16 when gradients can be that large.
"""

from __future__ import annotations

import torch

from .base import Compressed, Compressor, dtype_from_name, tensor_meta


class CastCompressor(Compressor):
    """Send the tensor cast to ``wire_dtype``; decompress casts back."""

    summable = True
    elementwise = True
    wire_dtype: torch.dtype = torch.float16

    def _encode(self, corrected: torch.Tensor, key: str, dtype: torch.dtype) -> Compressed:
        return Compressed({"values": corrected.to(self.wire_dtype)}, tensor_meta(corrected, dtype))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        values = compressed.tensors["values"]
        return values.to(dtype_from_name(compressed.meta["dtype"])).reshape(compressed.meta["shape"])


class FP16Compressor(CastCompressor):
    """Cast to float16 for the wire; optional error feedback keeps the rounding error."""

    name = "fp16"
    wire_dtype = torch.float16

    def __init__(self, *, error_feedback: bool = False) -> None:
        super().__init__(error_feedback=error_feedback)
