"""Formats with one scale per output row (or none): fp16, int8 per-channel, fp8 with per-tensor/per-channel scale.

* ``fp16``: IEEE binary16 elements, no scale (overflow -> Inf, IEEE RNE).
* ``int8`` (per-channel symmetric; LLM.int8/SmoothQuant/torchao ``Int8WeightOnlyConfig``
  PerRow): ``w = s_c * q``, ``q in [-127, 127]`` (-128 unused), ``s_c = max|W_c| / 127``
  in fp32, ``q = clamp(round_half_even(w / s_c))``; a zero row gets ``s_c = 0``, ``q = 0``.
* ``fp8-e4m3`` / ``fp8-e5m2`` (torchao ``Float8WeightOnlyConfig``, PerTensor or PerRow):
  ``w = s * fp8(q)``, ``s = amax / max_elem`` (448 or 57344) over the tensor or the row,
  ``q = fp8(w / s)`` RNE with saturation (OCP OFP8 "saturating" conversion; equals torch
  2.13's cast, whereas ml_dtypes gives NaN above 464 for E4M3FN; after scaling nothing
  exceeds max_elem except by rounding, so the choice only matters for robustness).

Row layout: a 4-byte little-endian fp32 scale header (every bank row repeats the scale
of its output row; per-tensor scales are the same in every row), then the element codes.
MAC operands: ``e = element value``, ``c1 = s``.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, WeightFormat, check_finite, f32_bytes, f32_field, rne_int
from nhil.numerics.formats.minifloat import E4M3FN, E5M2, FP16, MiniFloat


class FP16Format(WeightFormat):
    name, code, block, elem_bits = "fp16", 1, 16, 16
    source = "IEEE 754 binary16"

    def quantize(self, w):
        w = check_finite(w, self.name)
        codes = FP16.encode(w, saturate=False)
        return self._qtensor(np.zeros((w.shape[0], 0)), np.zeros((w.shape[0], 0)), codes, w.shape)

    def operands(self, header, rec, codes, k):
        return MacOperands(FP16.decode(codes[..., :k]))


class Int8PerChannel(WeightFormat):
    name, code, block, header_bytes, elem_bits = "int8", 2, 16, 4, 8
    source = "symmetric per-output-channel int8 (LLM.int8 arXiv:2208.07339, torchao Int8WeightOnlyConfig PerRow)"

    def quantize(self, w):
        w = check_finite(w, self.name)
        amax = np.abs(w).max(axis=1)
        s = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s[:, None] > 0, rne_int(w / s[:, None]), 0)
        q = np.clip(q, -127, 127).astype(np.int8)
        return self._qtensor(f32_bytes(s), np.zeros((w.shape[0], 0)), q.view(np.uint8), w.shape, granularity="per-channel")

    def operands(self, header, rec, codes, k):
        e = codes[..., :k].astype(np.uint8).view(np.int8).astype(np.float32)
        s = f32_field(header[..., :4])
        return MacOperands(e, c1=np.broadcast_to(s[..., None], e.shape[:-1] + (-(-k // 16),)).astype(np.float32))


class FP8Scaled(WeightFormat):
    """FP8 elements with an fp32 scale per tensor (``granularity="per-tensor"``) or per output row."""

    block, header_bytes, elem_bits = 16, 4, 8

    def __init__(self, elem: MiniFloat, code: int, granularity: str = "per-tensor") -> None:
        self.elem = elem
        self.code = code
        self.granularity = granularity
        self.name = f"fp8-{elem.name.removesuffix('fn')}"
        self.source = "OCP OFP8 rev 1.0 elements, fp32 scale amax/max_elem (torchao Float8WeightOnlyConfig)"

    def quantize(self, w):
        w = check_finite(w, self.name)
        if self.granularity == "per-tensor":
            amax = np.full(w.shape[0], np.abs(w).max(), np.float32)
        else:
            amax = np.abs(w).max(axis=1)
        s = (amax / np.float32(self.elem.max)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(s[:, None] > 0, (w / s[:, None]).astype(np.float32), 0)
        codes = self.elem.encode(scaled, saturate=True)
        return self._qtensor(f32_bytes(s), np.zeros((w.shape[0], 0)), codes, w.shape, granularity=self.granularity)

    def operands(self, header, rec, codes, k):
        e = self.elem.decode(codes[..., :k])
        s = f32_field(header[..., :4])
        return MacOperands(e, c1=np.broadcast_to(s[..., None], e.shape[:-1] + (-(-k // 16),)).astype(np.float32))


FP16_W = FP16Format()
INT8 = Int8PerChannel()
FP8_E4M3 = FP8Scaled(E4M3FN, 3)
FP8_E5M2 = FP8Scaled(E5M2, 4)
