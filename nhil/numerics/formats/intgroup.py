"""int4 group-wise formats (GPTQ / AWQ style), groups of G = 32, 64 or 128 input elements.

Groups run along the input dimension K, per output row (the last group is shorter when
G does not divide K). Per group: an fp16 scale ``s`` (both) and, asymmetric only, an
integer zero point ``z``. Elements are unsigned nibbles ``u in [0, 15]``.

* symmetric (``int4-g<G>``): ``w = s * (u - 8)``; quantizer ``s = fp16(amax / 7)``,
  ``u = clamp(round_half_even(w / s) + 8, 0, 15)`` so ``u - 8 in [-7, 7]`` (code 0 = -8
  decodes but is never produced). The fixed offset 8 is GPTQ's symmetric zero point in
  the *v2* convention (``checkpoint_format: gptq_v2``); GPTQ *v1* checkpoints store
  ``z - 1`` = 7, so a loader must add 1 (vLLM PRs #26092, #38966).
* asymmetric (``int4-g<G>-asym``): ``w = s * (u - z)``, ``z in [0, 15]`` stored as the
  zero point itself (GPTQ v2 / AWQ convention, *not* v1's z-1). Quantizer (GPTQ/AWQ
  min-max RTN): ``lo = min(min(w), 0)``, ``hi = max(max(w), 0)``, ``s = fp16((hi - lo) / 15)``,
  ``z = clamp(round_half_even(-lo / s), 0, 15)``, ``u = clamp(round_half_even(w / s) + z, 0, 15)``.
  An all-zero group gets ``s = 0``, ``z = 0``, ``u = 0``.

The scale used to round is the fp16-rounded one, so quantize and dequantize agree.
Record per group: fp16 scale (2 B, little-endian), [zero point (1 B, asym)], then the
nibbles, element 2i in the low nibble and 2i+1 in the high nibble of byte i (the
OCP/torchao ``pack_uint4`` pairing; AWQ's interleaved GEMM order is a checkpoint
layout, converted on load). MAC operands: ``e = u - 8`` or ``u - z`` (exact integers),
``c1 = s``.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, WeightFormat, blocks_of, check_finite, f16_bytes, f16_field, per_burst, rne_int


class Int4Group(WeightFormat):
    elem_bits = 4

    def __init__(self, group: int, asym: bool, code: int) -> None:
        self.block = group
        self.asym = asym
        self.code = code
        self.rec_bytes = 3 if asym else 2
        self.name = f"int4-g{group}" + ("-asym" if asym else "")
        self.source = "GPTQ arXiv:2210.17323 / AWQ arXiv:2306.00978 group-wise int4, v2 zero-point convention"

    def quantize(self, w):
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        blocks, k = blocks_of(w, self.block)
        n, nb, _ = blocks.shape
        if self.asym:
            lo = np.minimum(blocks.min(axis=-1), 0)
            hi = np.maximum(blocks.max(axis=-1), 0)
            s = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                z = np.where(s > 0, np.clip(rne_int(-lo / s), 0, 15), 0)
                u = np.where(s[..., None] > 0, np.clip(rne_int(blocks / s[..., None]) + z[..., None], 0, 15), 0)
            rec = np.concatenate([f16_bytes(s), z.astype(np.uint8)[..., None]], axis=-1)
        else:
            amax = np.abs(blocks).max(axis=-1)
            s = (amax / np.float32(7)).astype(np.float16).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                u = np.where(s[..., None] > 0, np.clip(rne_int(blocks / s[..., None]) + 8, 0, 15), 8)
            rec = f16_bytes(s)
        codes = u.reshape(n, -1)[:, :k].astype(np.uint8)
        return self._qtensor(np.zeros((n, 0)), rec, codes, w.shape)

    def operands(self, header, rec, codes, k):
        s = f16_field(rec[..., :2])
        u = codes[..., :k].astype(np.float32)
        if self.asym:
            z = rec[..., 2].astype(np.float32)
            zz = np.repeat(z, self.block, axis=-1)[..., :k]
            e = u - zz
        else:
            e = u - 8
        return MacOperands(e.astype(np.float32), c1=per_burst(s, self.block, k))


INT4 = {(g, a): Int4Group(g, a, 0x10 + i) for i, (g, a) in enumerate((g, a) for a in (False, True) for g in (32, 64, 128))}
