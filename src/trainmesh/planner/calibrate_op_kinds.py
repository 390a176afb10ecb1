"""Rates of the op kinds the roofline misprices, measured by probes (``trainmesh plan --calibrate``).

``op_costs.price`` prices an op at ``max(flops / matmul rate, bytes / add bandwidth)``. Two kinds of
op do more work than that says, and a training step of an attention model has both:

* fused scaled-dot-product attention (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward on a CPU): between its two matmuls it masks, exponentiates, and rescales a running
  softmax block by block. Timed against its FLOPs it gets well under what a matmul of the same
  FLOPs gets (on an AVX2 EPYC, one thread: 2-3x slower); its backward, which recomputes the
  probabilities, less again;
* element-wise ops bound by their arithmetic rather than by their bytes (``op_costs.ARITHMETIC_OPS``:
  ``exp``, ``silu``, ``_log_softmax``, ... ): on the same CPU 2-12x the time of an add that moves
  the same bytes (a log-softmax over a vocabulary row reads it twice and takes a max, an exp and a
  log per element).

Each is measured the way the planner counts it: the probe runs under ``op_costs.OpProfile``, which
gives the FLOPs (attention) or bytes (element-wise) the dry run would file for that op, and is timed
with the median of repeats; the rate is that work over the time less the dispatch floor (priced
once per op as overhead). Attention is probed causal (as transformers' decoders call it) at three
sizes, each element-wise op at three sizes; between them ``op_costs.rate_at`` interpolates.

>>> curves = dict(measure_op_kind_curves(floor=0.0, repeats=1, numels=(2**10,), attention_shapes=((1, 1, 16, 8),)))
>>> sorted(curves)[:3], curves["exp"][0][1] > 0
(['_log_softmax', '_log_softmax_backward_data', '_softmax'], True)
"""

from __future__ import annotations

import torch

from .op_costs import ARITHMETIC_OPS, OpProfile

NUMELS = (2**14, 2**18, 2**21)  # 64 KiB .. 8 MiB per fp32 operand
ATTENTION_SHAPES = ((1, 4, 64, 64), (2, 8, 128, 64), (2, 8, 256, 64))  # (batch, heads, seq, head dim)
_ROW = 1024  # softmax rows: between an attention row and a vocabulary row


def _elementwise_probes(numel: int) -> dict:
    """One call per kind in ``ARITHMETIC_OPS``, each dispatching that one op on ``numel`` elements
    (positive inputs: a square root or log of a negative number takes a slow path a step never does)."""
    aten = torch.ops.aten
    x, g = torch.rand(numel) + 0.5, torch.randn(numel)
    rows, grows = x.view(-1, min(_ROW, numel)), g.view(-1, min(_ROW, numel))
    probs, logp = torch.softmax(rows, -1), torch.log_softmax(rows, -1)
    return {
        "exp": lambda: torch.exp(x),
        "log": lambda: torch.log(x),
        "sqrt": lambda: torch.sqrt(x),
        "rsqrt": lambda: torch.rsqrt(x),
        "tanh": lambda: torch.tanh(x),
        "sigmoid": lambda: torch.sigmoid(x),
        "silu": lambda: torch.nn.functional.silu(x),
        "gelu": lambda: torch.nn.functional.gelu(x),
        "erf": lambda: torch.erf(x),
        "_softmax": lambda: torch.softmax(rows, -1),
        "_log_softmax": lambda: torch.log_softmax(rows, -1),
        "silu_backward": lambda: aten.silu_backward(g, x),
        "gelu_backward": lambda: aten.gelu_backward(g, x),
        "sigmoid_backward": lambda: aten.sigmoid_backward(g, x),
        "tanh_backward": lambda: aten.tanh_backward(g, x),
        "_softmax_backward_data": lambda: aten._softmax_backward_data(grows, probs, -1, torch.float32),
        "_log_softmax_backward_data": lambda: aten._log_softmax_backward_data(grows, logp, -1, torch.float32),
    }


def _attention_probes(shape: tuple) -> dict:
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    forward = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    grad = torch.randn(*shape)
    return {"attention": forward, "attention_backward": lambda: torch.autograd.grad(forward(), (q, k, v), grad)}


def _work(kind: str, fn) -> float:
    """FLOPs (attention) or bytes (element-wise) the planner files for ``kind`` in one call of ``fn``."""
    with OpProfile() as profile:
        fn()
    keys = [(key, n) for key, n in profile.counts.items() if key[4] == kind]
    return float(sum((key[2] if kind.startswith("attention") else key[3]) * n for key, n in keys))


def measure_op_kind_curves(
    floor: float, repeats: int = 7, numels: tuple = NUMELS, attention_shapes: tuple = ATTENTION_SHAPES
) -> tuple:
    """``((kind, ((work, rate), ...)), ...)`` for attention (FLOPs, FLOP/s) and every element-wise kind
    (bytes moved, bytes/s), ascending in work; ``floor`` is the dispatch time of the cheapest op."""
    from .calibrate_ops import _median_time

    points: dict[str, list] = {}

    def add(kind: str, fn, seconds: float | None = None) -> None:
        work = _work(kind, fn)
        if work:
            t = _median_time(fn, repeats) if seconds is None else seconds
            points.setdefault(kind, []).append((work, work / max(t - floor, t * 0.05)))

    for numel in numels:
        for kind, fn in _elementwise_probes(numel).items():
            add(kind, fn)
    for shape in attention_shapes:
        probes = _attention_probes(shape)
        forward = _median_time(probes["attention"], repeats)
        add("attention", probes["attention"], forward)
        # the backward alone: the probe runs a forward first (a fresh graph each time)
        add(
            "attention_backward",
            probes["attention_backward"],
            max(_median_time(probes["attention_backward"], repeats) - forward, forward * 0.05),
        )
    assert set(points) <= set(ARITHMETIC_OPS) | {"attention", "attention_backward"}
    return tuple((kind, tuple(sorted(curve))) for kind, curve in sorted(points.items()))


__all__ = ["measure_op_kind_curves", "NUMELS", "ATTENTION_SHAPES"]
