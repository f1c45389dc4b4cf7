"""Weight formats of pre-quantized checkpoints that nhil's RTN formats cannot hold bit for bit.

Shipped checkpoints (compressed-tensors, transformers' ``quant_method: fp8``) carry their own
codes and scales; ``QUANT=native`` keeps them (``nhil.models.prequant``). Three layouts need
formats of their own:

* ``int4-g{32,64,128}[-asym]-f32s`` — compressed-tensors ``pack-quantized`` int4 groups
  (W4A16, GPTQ/AWQ style) whose scales are bf16 or fp32 (the checkpoint's dtype): same as
  ``int4-g<G>[-asym]`` (``intgroup.py``: ``w = s * (u - 8)`` or ``s * (u - z)``, element 2i
  in the low nibble) but the group scale is an fp32 field (4 B little-endian), so a bf16 or
  fp32 scale is kept exactly (bf16 -> fp32 is exact; fp16's range is not bf16's).
  compressed-tensors stores ``q in [-8, 7]`` as the nibble ``q + 8`` (``pack_to_int32``)
  and a signed zero point ``z_ct``; here ``u = q + 8`` and ``z = z_ct + 8`` (u8), so
  ``u - z = q - z_ct`` exactly. MAC: ``e = u - 8`` / ``u - z``, ``c1 = s``.
* ``fp8-e4m3-b{16,32,64,128}`` — FP8 E4M3FN weights with 2-D block scales (DeepSeek-V3 /
  Qwen3 FP8 ``weight_scale_inv`` with ``weight_block_size [bn, bk]``; compressed-tensors
  ``float-quantized`` strategy ``block``): ``w[r, k] = e4m3(q[r, k]) * S[r // bn, k // bk]``.
  A bank row holds one output row, so the record of block ``b`` of row ``r`` is the fp32
  scale ``S[r // bn, b]`` (4 B), then the ``bk`` E4M3FN codes; the ``bn`` rows of a block
  row repeat its scale. MAC: ``e = e4m3(q)``, ``c1 = S``; the dequantized weight
  ``fp32(e * S)`` equals transformers' ``Fp8Dequantize`` (fp32 multiply) bit for bit.
* ``nvfp4-gs`` — compressed-tensors NVFP4 (``nvfp4-pack-quantized``): E2M1 nibbles, an E4M3
  scale ``s_b`` per 16 elements and a per-tensor ``weight_global_scale g`` that *divides*:
  compressed-tensors ``_dequantize`` computes ``scale = fp32(s_b / g)``, then
  ``w = fp32(e2m1(q) * scale)``. The ``nvfp4`` format multiplies by a tensor scale instead
  (``1/g`` is not exact in fp32), so this one stores ``g`` (fp32 header, 4 B) and the device
  forms ``c1 = fp32(ue4m3(s_b) / g)`` (one IEEE fp32 division per block) before the burst:
  burst adds ``fp32(dot16(e * a) * c1)``. Record: 1 B ``s_b`` (E4M3 with sign 0 = UE4M3;
  compressed-tensors' float8_e4m3fn byte), then 8 B of nibbles (element 2i low).

These formats are implemented by the simulator and the quantized reference; the RTL does not
decode them (``nhil.targets.rtl.target.RTL_FORMATS``), so rtl/fpga runs of such programs are
refused at load and reported SKIPPED with the format named.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, WeightFormat, blocks_of, check_finite, f32_bytes, f32_field, per_burst, rne_int
from nhil.numerics.formats.intgroup import Int4Group
from nhil.numerics.formats.minifloat import E2M1, E4M3FN, UE4M3


class Int4GroupF32Scale(Int4Group):
    """int4 groups with an fp32 group scale (compressed-tensors ``pack-quantized`` with bf16/fp32 scales)."""

    def __init__(self, group: int, asym: bool, code: int) -> None:
        super().__init__(group, asym, code)
        self.rec_bytes = 5 if asym else 4
        self.name += "-f32s"
        self.source = "compressed-tensors pack-quantized int4 (pack_to_int32, offset 8), GPTQ/AWQ groups, fp32 scale field"

    def quantize(self, w):
        """RTN min-max like ``int4-g<G>`` but the scale kept in fp32 (compressed-tensors ``calculate_qparams``:
        ``s = amax / 7.5`` symmetric — its range is [-8, 7] — asymmetric ``s = (hi - lo) / 15``)."""
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        blocks, k = blocks_of(w, self.block)
        n = blocks.shape[0]
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.asym:
                lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
                s = ((hi - lo) / np.float32(15)).astype(np.float32)
                z = np.where(s > 0, np.clip(rne_int(-lo / s), 0, 15), 0)
                u = np.where(s[..., None] > 0, np.clip(rne_int(blocks / s[..., None]) + z[..., None], 0, 15), 0)
                rec = np.concatenate([f32_bytes(s), z.astype(np.uint8)[..., None]], axis=-1)
            else:
                s = (np.abs(blocks).max(-1) / np.float32(7.5)).astype(np.float32)
                u = np.where(s[..., None] > 0, np.clip(rne_int(blocks / s[..., None]) + 8, 0, 15), 8)
                rec = f32_bytes(s)
        return self._qtensor(np.zeros((n, 0)), rec, u.reshape(n, -1)[:, :k].astype(np.uint8), w.shape)

    def operands(self, header, rec, codes, k):
        s = f32_field(rec[..., :4])
        u = codes[..., :k].astype(np.float32)
        if self.asym:
            e = u - np.repeat(rec[..., 4].astype(np.float32), self.block, axis=-1)[..., :k]
        else:
            e = u - 8
        return MacOperands(e.astype(np.float32), c1=per_burst(s, self.block, k))

    def from_fields(self, u: np.ndarray, scale: np.ndarray, zero: np.ndarray | None = None):
        """QTensor from nibble values ``u`` uint8 [N, K] in [0, 15], scales float32 [N, K/G] and zero points
        ``z`` uint8 [N, K/G] (asymmetric only)."""
        rec = f32_bytes(np.asarray(scale, np.float32))
        if self.asym:
            rec = np.concatenate([rec, np.asarray(zero, np.uint8)[..., None]], axis=-1)
        return self._qtensor(np.zeros((u.shape[0], 0)), rec, np.asarray(u, np.uint8), u.shape)


class FP8Block(WeightFormat):
    """FP8 E4M3FN elements with 2-D block scales (``weight_block_size [bn, bk]``, bk = this format's block)."""

    header_bytes, rec_bytes, elem_bits = 0, 4, 8

    def __init__(self, bk: int, code: int) -> None:
        self.block = bk
        self.code = code
        self.name = f"fp8-e4m3-b{bk}"
        self.source = ("DeepSeek-V3 FP8 (arXiv:2412.19437 §3.3: 128x128 weight blocks, weight_scale_inv), transformers "
                       "FineGrainedFP8 / compressed-tensors block strategy; OCP OFP8 rev 1.0 E4M3FN elements")

    def quantize(self, w, bn: int | None = None):
        """DeepSeek's block quantizer over ``[bn, bk]`` blocks (default square): ``S = amax / 448``,
        ``q = e4m3(w / S)`` RNE saturating; an all-zero block gets ``S = 0``, ``q = 0``."""
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        bn = bn or self.block
        n, k = w.shape
        nr, nc = -(-n // bn), -(-k // self.block)
        pad = np.pad(w, ((0, nr * bn - n), (0, nc * self.block - k)))
        amax = np.abs(pad.reshape(nr, bn, nc, self.block)).max(axis=(1, 3))
        s = (amax / np.float32(E4M3FN.max)).astype(np.float32)
        full = np.repeat(np.repeat(s, bn, 0), self.block, 1)[:n, :k]
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(full > 0, (w / full).astype(np.float32), 0)
        return self.from_fields(E4M3FN.encode(scaled, saturate=True), s, bn)

    def from_fields(self, codes: np.ndarray, scale: np.ndarray, bn: int):
        """QTensor from E4M3FN codes uint8 [N, K] and block scales float32 [ceil(N/bn), ceil(K/bk)]."""
        codes = np.asarray(codes, np.uint8)
        n = codes.shape[0]
        per_row = np.asarray(scale, np.float32)[np.arange(n) // bn]  # [N, nblocks]
        return self._qtensor(np.zeros((n, 0)), f32_bytes(per_row), codes, codes.shape, block_rows=bn)

    def operands(self, header, rec, codes, k):
        return MacOperands(E4M3FN.decode(codes[..., :k]), c1=per_burst(f32_field(rec[..., :4]), self.block, k))


class NVFP4GlobalScale(WeightFormat):
    """compressed-tensors NVFP4: E2M1, E4M3 block scale per 16, fp32 global scale that divides the block scale."""

    name, code, block, header_bytes, rec_bytes, elem_bits = "nvfp4-gs", 0x49, 16, 4, 1, 4
    source = "compressed-tensors nvfp4-pack-quantized (NVFP4, arXiv:2509.25149): scale = s_b / weight_global_scale"

    def quantize(self, w):
        """compressed-tensors' NVFP4 qparams: ``g = 448 * 6 / amax_T``, ``s_b = e4m3(g * amax_b / 6)``,
        ``q = e2m1(w / fp32(s_b / g))`` RNE saturating (a zero block stores zeros)."""
        w = check_finite(w, self.name)
        self.check_k(w.shape[1])
        n = w.shape[0]
        amax = np.float32(np.abs(w).max())
        g = np.float32(np.float32(448 * 6) / amax) if amax > 0 else np.float32(1)
        blocks, k = blocks_of(w, self.block)
        sb = UE4M3.encode((g * (np.abs(blocks).max(-1) / np.float32(6))).astype(np.float32), saturate=True)
        return self.from_fields(self._encode(blocks, sb, g, n, k), sb, g)

    @staticmethod
    def _encode(blocks, sb, g, n, k):
        with np.errstate(divide="ignore", invalid="ignore"):
            c1 = (UE4M3.decode(sb) / np.float32(g)).astype(np.float32)
            scaled = np.where(c1[..., None] > 0, (blocks / c1[..., None]).astype(np.float32), 0)
        return E2M1.encode(scaled, saturate=True).reshape(n, -1)[:, :k]

    def from_fields(self, codes: np.ndarray, sb: np.ndarray, g: float):
        """QTensor from E2M1 codes uint8 [N, K], UE4M3 block-scale codes uint8 [N, K/16] and the global scale."""
        codes = np.asarray(codes, np.uint8)
        n = codes.shape[0]
        return self._qtensor(f32_bytes(np.full(n, g, np.float32)), np.asarray(sb, np.uint8)[..., None], codes, codes.shape)

    def operands(self, header, rec, codes, k):
        g = f32_field(header[..., :4])
        with np.errstate(divide="ignore", invalid="ignore"):
            c1 = (UE4M3.decode(rec[..., 0]) / g[..., None]).astype(np.float32)
        return MacOperands(E2M1.decode(codes[..., :k]), c1=per_burst(c1, self.block, k))


INT4_F32S = {(g, a): Int4GroupF32Scale(g, a, 0x40 + i) for i, (g, a) in enumerate((g, a) for a in (False, True) for g in (32, 64, 128))}
FP8_BLOCK = {bk: FP8Block(bk, 0x46 + i) for i, bk in enumerate((32, 64, 128))}
FP8_BLOCK[16] = FP8Block(16, 0x4A)  # the fp8 KV cache's K rows of 16-element heads (nhil.numerics.kv_fp8)
NVFP4_GS = NVFP4GlobalScale()
PREQUANT_FORMATS: list[WeightFormat] = [*INT4_F32S.values(), *FP8_BLOCK.values(), NVFP4_GS]
