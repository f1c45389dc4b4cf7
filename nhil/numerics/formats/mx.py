"""OCP Microscaling (MX) v1.0 formats: MXFP8 (E4M3, E5M2), MXFP6 (E3M2, E2M3), MXFP4 (E2M1), MXINT8.

Blocks of k = 32 consecutive input elements share one E8M0 scale ``X = 2**(E - 127)``
(OCP MX v1.0 section 5.2 Table 1, 5.4.1; ``0xFF`` = NaN makes the whole block NaN).
Element ``i`` stands for ``v_i = X * P_i``.

Quantization (section 6.3), per block with ``amax = max |V_i|``:

* ``FLOOR`` (the spec's rule, default): ``E = floor(log2(amax)) - emax_elem`` where
  ``emax_elem`` is the exponent of the largest power of two of the element format
  (E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2, INT8 0). A block whose largest magnitude has
  a mantissa above the element max's may clip that element to the max (spec's choice).
* ``RCEIL`` (option; cuBLAS / torchao ``MXDynamicActivationMXWeightConfig``):
  ``E = ceil(log2(amax / max_elem))`` (never clips).
* ``E`` is clamped to [-127, 127]; an all-zero block gets ``E = -127`` (code 0), as gguf-py.
* ``P_i = element(V_i / X)``: round to nearest, ties to even, clamped to +-max ("normal
  numbers that exceed the max normal ... clamped to the max normal, preserving the sign").
  ``V_i / X`` is a power-of-two scaling, computed exactly in float64.
* MXINT8 elements are two's complement ``k`` with value ``k / 64`` (implicit scale 2^-6),
  ``k = clamp(round_half_even(64 * V_i / X), -127, 127)`` (-128 unused, as the MX
  reference library).

Record per block: 1 byte E8M0, then the element codes: FP8/INT8 one byte each, FP6 four
elements in three bytes (element i in bits [6i, 6i+6) of the little-endian bit stream),
FP4 element 2i in the low and 2i+1 in the high nibble of byte i (OCP/torchao/gpt-oss
pairing; GGUF's own MXFP4 type pairs j with j+16 instead). MAC operands: ``e = P_i``
(INT8: ``k * 2^-6``), ``c1 = X``.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, WeightFormat, blocks_of, check_finite, per_burst, rne_int
from nhil.numerics.formats.minifloat import E2M1, E2M3, E3M2, E4M3FN, E5M2, MiniFloat, QuantizeError, e8m0_decode

MX_BLOCK = 32


def shared_exponent(amax: np.ndarray, emax_elem: int, max_elem: float, rule: str = "floor") -> np.ndarray:
    """Unbiased shared exponent per block (int64), clamped to [-127, 127]; all-zero blocks -> -127."""
    amax = np.asarray(amax, np.float64)
    nz = amax > 0
    safe = np.where(nz, amax, 1.0)
    if rule == "floor":
        m, ex = np.frexp(safe)  # safe = m * 2**ex, m in [0.5, 1)
        e = ex - 1 - emax_elem
    elif rule == "rceil":
        r = safe / max_elem
        m, ex = np.frexp(r)
        e = np.where(m == 0.5, ex - 1, ex)  # ceil(log2(r))
    else:
        raise QuantizeError(f"unknown MX scale rule {rule!r} (floor or rceil)")
    return np.where(nz, np.clip(e, -127, 127), -127).astype(np.int64)


class MXFormat(WeightFormat):
    block = MX_BLOCK
    rec_bytes = 1

    def __init__(self, name: str, elem: MiniFloat | None, code: int, rule: str = "floor") -> None:
        self.name = name if rule == "floor" else f"{name}-rceil"
        self.elem = elem
        self.code = code
        self.rule = rule
        self.elem_bits = elem.bits if elem is not None else 8
        self.emax_elem = elem.emax_pow2 if elem is not None else 0
        self.max_elem = elem.max if elem is not None else 127 / 64
        self.source = "OCP Microscaling Formats (MX) v1.0 (2023), sections 5 and 6.3; arXiv:2310.10537"

    def quantize(self, w):
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        blocks, k = blocks_of(w, self.block)
        n = blocks.shape[0]
        e = shared_exponent(np.abs(blocks).max(axis=-1), self.emax_elem, self.max_elem, self.rule)
        scaled = np.ldexp(blocks.astype(np.float64), -e[..., None])
        if self.elem is None:
            codes = np.clip(rne_int(scaled * 64), -127, 127).astype(np.int8).view(np.uint8)
        else:
            codes = self.elem.encode(scaled, saturate=True)
        rec = (e + 127).astype(np.uint8)[..., None]
        return self._qtensor(np.zeros((n, 0)), rec, codes.reshape(n, -1)[:, :k], w.shape, rule=self.rule)

    def element_values(self, codes: np.ndarray) -> np.ndarray:
        if self.elem is None:
            return codes.astype(np.uint8).view(np.int8).astype(np.float32) * np.float32(2.0**-6)
        return self.elem.decode(codes)

    def operands(self, header, rec, codes, k):
        x = e8m0_decode(rec[..., 0])
        return MacOperands(self.element_values(codes[..., :k]), c1=per_burst(x, self.block, k))


MXFP8_E4M3 = MXFormat("mxfp8-e4m3", E4M3FN, 0x20)
MXFP8_E5M2 = MXFormat("mxfp8-e5m2", E5M2, 0x21)
MXFP6_E3M2 = MXFormat("mxfp6-e3m2", E3M2, 0x22)
MXFP6_E2M3 = MXFormat("mxfp6-e2m3", E2M3, 0x23)
MXFP4 = MXFormat("mxfp4", E2M1, 0x24)
MXINT8 = MXFormat("mxint8", None, 0x25)
MXFP4_RCEIL = MXFormat("mxfp4", E2M1, 0x26, rule="rceil")
MXFP8_E4M3_RCEIL = MXFormat("mxfp8-e4m3", E4M3FN, 0x27, rule="rceil")
