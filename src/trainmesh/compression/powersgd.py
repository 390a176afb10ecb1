"""PowerSGD (Vogels et al. 2019): a rank-r approximation ``M ~ P @ Q^T`` by one power iteration.

The tensor is viewed as a matrix ``(shape[0], numel / shape[0])``; with ``Q`` from the last
step of the same key (warm start; random the first time), ``P = orth(M @ Q)`` and
``Q = M^T @ P``. ``P`` and ``Q`` are sent, ``(rows + cols) * r`` values instead of
``rows * cols``; error feedback keeps ``M - P @ Q^T``. Tensors with fewer than 2 dimensions,
and matrices too small to gain ``min_compression_rate``, pass through uncompressed
(``meta["passthrough"] = True``), as in torch's PowerSGD hook.

As a pure transform, both matmuls use the local matrix. Across processes the exact algorithm
all-reduces ``P`` before orthogonalizing and ``Q`` after; torch ships it as a DDP hook:
``ddp.register_comm_hook(compressor.torch_state(group), powerSGD_hook)`` (see ``torch_state``).
"""

from __future__ import annotations

import zlib

import torch

from .base import Compressed, Compressor, dtype_from_name, tensor_meta


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start of ``Q``."""

    name = "powersgd"
    summable = False  # P and Q of two ranks cannot be summed into the sum of their products
    _MEAN_FIELDS = ("residuals", "q_memory")

    def __init__(
        self,
        rank: int = 1,
        *,
        error_feedback: bool = True,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__(error_feedback=error_feedback)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd: rank must be an int >= 1. Received: rank={rank!r}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"powersgd: warm_start must be a bool. Received: warm_start={warm_start!r}")
        if (
            isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, (int, float))
            or min_compression_rate < 1
        ):
            raise ValueError(f"powersgd: min_compression_rate must be >= 1. Received: {min_compression_rate!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"powersgd: seed must be an int. Received: seed={seed!r}")
        self.rank, self.warm_start = rank, warm_start
        self.min_compression_rate, self.seed = float(min_compression_rate), seed
        self.q_memory: dict[str, torch.Tensor] = {}

    def matrix_shape(self, shape) -> tuple[int, int] | None:
        """``(rows, cols)`` the tensor is compressed as, or None when it passes through."""
        if len(shape) < 2:
            return None
        rows = int(shape[0])
        cols = 1
        for size in shape[1:]:
            cols *= int(size)
        rank = min(self.rank, rows, cols)
        if rows * cols == 0 or (rows + cols) * rank * self.min_compression_rate > rows * cols:
            return None
        return rows, cols

    def _initial_q(self, key: str, cols: int, rank: int, dtype, device) -> torch.Tensor:
        # Seeded per key, so every rank (and a resumed run) starts from the same Q.
        seed = (self.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(cols, rank, generator=generator, dtype=dtype).to(device)

    def _encode(self, corrected: torch.Tensor, key: str, dtype: torch.dtype) -> Compressed:
        meta = tensor_meta(corrected, dtype)
        shape = self.matrix_shape(corrected.shape)
        if shape is None:
            meta["passthrough"] = True
            return Compressed({"values": corrected.to(dtype)}, meta)
        rows, cols = shape
        rank = min(self.rank, rows, cols)
        # fp32 at least: a power iteration in half precision loses the small singular directions.
        compute = torch.promote_types(corrected.dtype, torch.float32)
        matrix = corrected.reshape(rows, cols).to(compute)
        q = self.q_memory.get(key) if self.warm_start else None
        if q is None or q.shape != (cols, rank):
            q = self._initial_q(key, cols, rank, compute, matrix.device)
        p = torch.linalg.qr(matrix @ q.to(device=matrix.device, dtype=compute)).Q
        q = matrix.T @ p
        if self.warm_start:
            self.q_memory[key] = q.clone()
        meta.update(passthrough=False, rank=rank, rows=rows, cols=cols)
        return Compressed({"p": p.to(dtype), "q": q.to(dtype)}, meta)

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        meta = compressed.meta
        dtype = dtype_from_name(meta["dtype"])
        if meta.get("passthrough"):
            return compressed.tensors["values"].to(dtype).reshape(meta["shape"])
        p, q = compressed.tensors["p"], compressed.tensors["q"]
        compute = torch.promote_types(p.dtype, torch.float32)
        return (p.to(compute) @ q.to(compute).T).to(dtype).reshape(meta["shape"])

    def torch_state(self, process_group=None, *, start_iter: int = 2):
        """A ``PowerSGDState`` for torch's DDP hook with this compressor's settings.

        ``ddp.register_comm_hook(state, torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook)``.
        Mapping: rank -> matrix_approximation_rank, error_feedback -> use_error_feedback,
        warm_start -> warm_start, min_compression_rate, seed -> random_seed. ``start_iter``
        (torch: start_powerSGD_iter) runs plain all-reduce for the first steps, as torch requires
        (> 1 with error feedback or warm start). torch's hook keeps its own residuals and Q per
        bucket inside the state, not in this compressor.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        return PowerSGDState(
            process_group,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.error_feedback,
            warm_start=self.warm_start,
            random_seed=self.seed,
        )

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["q_memory"] = {k: v.detach().to("cpu", copy=True) for k, v in self.q_memory.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q_memory = {k: v.detach().clone() for k, v in state.get("q_memory", {}).items()}

    def __repr__(self) -> str:
        return (
            f"PowerSGDCompressor(rank={self.rank}, error_feedback={self.error_feedback}, "
            f"warm_start={self.warm_start}, min_compression_rate={self.min_compression_rate})"
        )
