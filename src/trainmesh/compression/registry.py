"""``get_compressor(spec)``: a compressor from a short spec string (config files, CLI flags).

Specs: ``None``/``"none"`` (no compression), ``"fp16"``, ``"bf16"``, ``"int8"``,
``"int8:stochastic"``, ``"int8:nearest"``, ``"topk"``/``"topk:0.01"`` (ratio; ``"topk:0.01:fp16"`` sends fp16 values),
``"powersgd"``/``"powersgd:2"`` (rank). A :class:`Compressor` instance passes through.
"""

from __future__ import annotations

from .base import Compressor
from .bf16 import BF16Compressor
from .fp16 import FP16Compressor
from .int8 import ROUNDINGS, Int8Compressor
from .powersgd import PowerSGDCompressor
from .topk import TopKCompressor

KNOWN_SPECS = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:stochastic",
    "int8:nearest",
    "topk:<ratio>",
    "topk:<ratio>:fp16",
    "powersgd:<rank>",
)


def _unknown(spec) -> ValueError:
    return ValueError(f"Unknown compression spec. Known: {', '.join(KNOWN_SPECS)}. Received: {spec!r}")


def _topk(spec: str, arg: str | None) -> Compressor:
    if arg is None:
        return TopKCompressor()
    # "topk:0.01:fp16" sends the kept values as fp16: 4 bytes per entry instead of 6 (16-bit block
    # offset + fp32 value; see topk.py), so 1% costs ~100x fewer bytes than fp32 instead of ~66.6x.
    ratio_text, _, values = arg.partition(":")
    if values not in ("", "fp16"):
        raise ValueError(
            f"topk spec takes an optional ':fp16' after the ratio, like 'topk:0.01:fp16'. Received: {spec!r}"
        )
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"topk spec needs a ratio in (0, 1], like 'topk:0.01'. Received: {spec!r}") from None
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"topk spec needs a ratio in (0, 1], like 'topk:0.01'. Received: {spec!r}")
    return TopKCompressor(ratio, values=values or "same")


def _powersgd(spec: str, arg: str | None) -> Compressor:
    if arg is None:
        return PowerSGDCompressor()
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"powersgd spec needs an integer rank >= 1, like 'powersgd:2'. Received: {spec!r}")
    return PowerSGDCompressor(int(arg))


def _int8(spec: str, arg: str | None) -> Compressor:
    if arg is None:
        return Int8Compressor()
    if arg not in ROUNDINGS:
        raise ValueError(f"int8 spec takes a rounding, one of {ROUNDINGS}, like 'int8:stochastic'. Received: {spec!r}")
    return Int8Compressor(rounding=arg)


def _cast(cls):
    def build(spec: str, arg: str | None) -> Compressor:
        if arg is not None:
            raise ValueError(f"{cls.name} spec takes no argument. Received: {spec!r}")
        return cls()

    return build


_BUILDERS = {
    "fp16": _cast(FP16Compressor),
    "bf16": _cast(BF16Compressor),
    "int8": _int8,
    "topk": _topk,
    "powersgd": _powersgd,
}


def get_compressor(spec) -> Compressor | None:
    """The compressor a spec names, None for no compression; see the module doc for specs."""
    if spec is None or isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"A compression spec is None, a str or a Compressor. Received: {type(spec).__name__} {spec!r}")
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    name, sep, arg = text.partition(":")
    builder = _BUILDERS.get(name.strip())
    if builder is None or (sep and not arg.strip()):
        raise _unknown(spec)
    return builder(spec, arg.strip() if sep else None)
