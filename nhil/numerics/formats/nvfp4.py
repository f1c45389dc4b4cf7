"""NVFP4 (NVIDIA): E2M1 elements, a UE4M3 scale per 16 elements, and one fp32 scale per tensor.

Value: ``x = e2m1(q) * ue4m3(s_b) * s_t`` (NVIDIA, "Introducing NVFP4 ..."; arXiv:2509.25149;
torchao ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...)``). Quantizer:

* ``s_t = amax_tensor / (6 * 448)`` (fp32), so the largest block scale lands at 448;
* per block of 16: ``s_b = ue4m3(fp32(fp32(amax_b / 6) / s_t))`` RNE, saturating at 448;
* ``q = e2m1(fp32(x / fp32(ue4m3(s_b) * s_t)))`` RNE, saturating at 6; a block whose
  scale rounds to 0 (or an all-zero tensor) stores zeros.

UE4M3 ``0x7F`` is NaN here (E4M3FN's NaN with sign 0: the block is NaN); gguf-py's
NVFP4 type decodes it as 0 instead (recorded in the tests). The quantizer never
produces it. Row layout: fp32 ``s_t`` header (4 B, repeated in every bank row), then
per block 1 byte UE4M3 + 8 bytes of nibbles (element 2i low, 2i+1 high). (GGUF's NVFP4
type groups four 16-blocks into a 36-byte super-block with a different nibble order.)
MAC operands: ``e = e2m1(q)``, ``c1 = ue4m3(s_b)``, ``c2 = s_t`` (block scale applied
first, then the tensor scale).
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, WeightFormat, blocks_of, check_finite, f32_bytes, f32_field, per_burst
from nhil.numerics.formats.minifloat import E2M1, UE4M3


class NVFP4Format(WeightFormat):
    name, code, block, header_bytes, rec_bytes, elem_bits = "nvfp4", 0x28, 16, 4, 1, 4
    source = "NVIDIA NVFP4 (blog 2025, arXiv:2509.25149), torchao NVFP4Tensor"

    def quantize(self, w):
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        n = w.shape[0]
        st = np.float32(np.abs(w).max()) / np.float32(6 * 448)
        st = np.float32(st)
        blocks, k = blocks_of(w, self.block)
        amax_b = np.abs(blocks).max(axis=-1)
        if st > 0:
            sb_code = UE4M3.encode((amax_b / np.float32(6)).astype(np.float32) / st, saturate=True)
        else:
            sb_code = np.zeros(amax_b.shape, np.uint8)
        total = (UE4M3.decode(sb_code) * st).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(total[..., None] > 0, (blocks / total[..., None]).astype(np.float32), 0)
        codes = E2M1.encode(scaled, saturate=True)
        header = f32_bytes(np.full(n, st, np.float32))
        return self._qtensor(header, sb_code[..., None], codes.reshape(n, -1)[:, :k], w.shape)

    def operands(self, header, rec, codes, k):
        sb = UE4M3.decode(rec[..., 0])
        st = f32_field(header[..., :4])
        c1 = per_burst(sb, self.block, k)
        return MacOperands(E2M1.decode(codes[..., :k]), c1=c1, c2=np.broadcast_to(st[..., None], c1.shape).astype(np.float32))


NVFP4 = NVFP4Format()
