"""Weight and element formats: one definition per format (``docs/numerics.md``).

``FORMATS`` maps a device weight-format name (as in ``program.info["weight_formats"]``)
to its :class:`~nhil.numerics.formats.base.WeightFormat`; ``bf16`` is the ISA v0 format
(``nhil.numerics.bf16``, CFR ``W_FMT`` = 0) and has no entry. ``get_format`` also
accepts ``fp8-e4m3-pc`` style aliases for the per-channel scale variant.
"""

from __future__ import annotations

from nhil.numerics.formats.base import MacOperands, QTensor, WeightFormat, mac_bursts_q, reference_qgemv
from nhil.numerics.formats.gguf_blocks import GGML_TYPES, Q4_0, Q4_1, Q8_0, dequantize_q4_k, dequantize_q6_k
from nhil.numerics.formats.intgroup import INT4
from nhil.numerics.formats.minifloat import E2M1, E2M3, E3M2, E4M3FN, E5M2, ELEMENTS, FP16, UE4M3, MiniFloat, QuantizeError, e8m0_decode
from nhil.numerics.formats.mx import MXFP4, MXFP4_RCEIL, MXFP6_E2M3, MXFP6_E3M2, MXFP8_E4M3, MXFP8_E4M3_RCEIL, MXFP8_E5M2, MXINT8
from nhil.numerics.formats.nvfp4 import NVFP4
from nhil.numerics.formats.prequant import FP8_BLOCK, INT4_F32S, NVFP4_GS, PREQUANT_FORMATS
from nhil.numerics.formats.scalar import FP8_E4M3, FP8_E5M2, FP16_W, INT8, FP8Scaled

BF16_CODE = 0

_ALL: list[WeightFormat] = [FP16_W, INT8, FP8_E4M3, FP8_E5M2, *INT4.values(), MXFP8_E4M3, MXFP8_E5M2, MXFP6_E3M2, MXFP6_E2M3, MXFP4, MXINT8, MXFP4_RCEIL, MXFP8_E4M3_RCEIL, NVFP4, Q8_0, Q4_0, Q4_1]
FORMATS: dict[str, WeightFormat] = {f.name: f for f in _ALL}
# formats of pre-quantized checkpoints (QUANT=native, nhil.models.prequant): simulator and reference only, not the RTL
PREQUANT: dict[str, WeightFormat] = {f.name: f for f in PREQUANT_FORMATS}
BY_CODE: dict[int, WeightFormat] = {f.code: f for f in [*_ALL, *PREQUANT_FORMATS]}
assert len(BY_CODE) == len(_ALL) + len(PREQUANT_FORMATS) and BF16_CODE not in BY_CODE
DEVICE_FORMATS = frozenset({"bf16", *FORMATS, *PREQUANT})

_PER_CHANNEL = {"fp8-e4m3-pc": FP8Scaled(E4M3FN, FP8_E4M3.code, "per-channel"), "fp8-e5m2-pc": FP8Scaled(E5M2, FP8_E5M2.code, "per-channel")}


def get_format(name: str) -> WeightFormat:
    """The WeightFormat called ``name`` (``fp8-*-pc``: per-channel-scale quantizer of the same device format).

    Raises:
        QuantizeError: unknown name (lists the known ones).
    """
    if name in FORMATS:
        return FORMATS[name]
    if name in PREQUANT:
        return PREQUANT[name]
    if name in _PER_CHANNEL:
        return _PER_CHANNEL[name]
    raise QuantizeError(f"unknown weight format {name!r}; known: bf16, {', '.join(sorted([*FORMATS, *PREQUANT, *_PER_CHANNEL]))}")


__all__ = [
    "BF16_CODE", "BY_CODE", "DEVICE_FORMATS", "FORMATS", "PREQUANT", "FP8_BLOCK", "INT4_F32S", "NVFP4_GS", "GGML_TYPES", "MacOperands", "QTensor", "QuantizeError", "WeightFormat",
    "get_format", "mac_bursts_q", "reference_qgemv", "dequantize_q4_k", "dequantize_q6_k", "e8m0_decode",
    "E2M1", "E2M3", "E3M2", "E4M3FN", "E5M2", "ELEMENTS", "FP16", "UE4M3", "MiniFloat",
    "Q4_0", "Q4_1", "Q8_0", "INT4", "INT8", "FP8_E4M3", "FP8_E5M2", "FP16_W", "MXFP4", "MXFP4_RCEIL", "MXFP6_E2M3", "MXFP6_E3M2",
    "MXFP8_E4M3", "MXFP8_E4M3_RCEIL", "MXFP8_E5M2", "MXINT8", "NVFP4",
]
