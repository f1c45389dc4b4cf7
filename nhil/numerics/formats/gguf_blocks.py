"""GGUF block formats (ggml): Q8_0, Q4_0, Q4_1 (quantize + dequantize + MAC), Q4_K, Q6_K (dequantize only).

Definitions follow ggml's reference C (``ggml-quants.c``: ``quantize_row_q*_ref``,
``dequantize_row_q*``) and the GGUF spec (ggml ``docs/gguf.md``); blocks run along the
input dimension (a GGUF tensor's ``ne[0]``), 32 elements each, bytes little-endian:

* Q8_0 (34 B): fp16 ``d``, 32 x int8 ``q``; ``x = d * q``. Quantizer: ``d = amax / 127``
  (fp32), ``q = round_half_away(x * (1/d))`` (``roundf``), then ``d`` stored as fp16.
* Q4_0 (18 B): fp16 ``d``, 16 B nibbles, byte j = element j (low) | element j+16 (high);
  ``x = d * (q - 8)``. Quantizer: ``max`` = the signed value of largest magnitude (first
  one on ties), ``d = max / -8``, ``q = min(15, trunc(x * (1/d) + 8.5))``.
* Q4_1 (20 B): fp16 ``d``, fp16 ``m``, 16 B nibbles (same order); ``x = d * q + m``.
  Quantizer: ``d = (max - min) / 15``, ``q = min(15, trunc((x - min) * (1/d) + 0.5))``,
  ``m = min``.
* Q4_K (144 B per 256): fp16 ``d``, fp16 ``dmin``, 12 B of eight 6-bit scales and mins,
  128 B nibbles; ``x = (d * sc_j) * q - (dmin * m_j)``.
* Q6_K (210 B per 256): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, fp16
  ``d`` last; ``x = (d * sc_j) * (q - 32)``.

All arithmetic is float32 as in ggml (so quantize output equals gguf-py's bytes). MAC
operands (device formats Q8_0/Q4_0/Q4_1): ``e = q`` / ``q - 8`` / ``q``, ``c1 = d``, and
for Q4_1 ``m`` (the MAC adds ``fp32(dot16(a) * m)`` per burst, as llama.cpp's
``vec_dot_q4_1_q8_1`` does with its activation block sums). A bank row holds the GGUF
block bytes unchanged, so a GGUF checkpoint runs bit for bit in its own format.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.base import MacOperands, QTensor, WeightFormat, check_finite, f16_field, per_burst
from nhil.numerics.formats.minifloat import QuantizeError

QK = 32
QK_K = 256


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: nearest integer, halves away from zero (exact for |x| < 2**23)."""
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + (a - f >= 0.5))


class GGUFFormat(WeightFormat):
    block = QK
    ggml_type: int = -1

    def _blocks(self, w: np.ndarray) -> np.ndarray:
        w = check_finite(w, self.name)
        if w.shape[1] % QK:
            raise QuantizeError(f"{self.name}: K={w.shape[1]} is not a multiple of the GGUF block size {QK}")
        return w.reshape(w.shape[0], -1, QK)

    def from_blocks(self, raw: np.ndarray, n: int, k: int) -> QTensor:
        """A QTensor holding GGUF block bytes ``raw`` (uint8 [n, k/32 * blk_bytes]) unchanged."""
        raw = np.asarray(raw, np.uint8).reshape(n, k // QK, self.blk_bytes)
        codes = self.unpack_elems(raw[..., self.rec_bytes :], QK).reshape(n, k)
        return self._qtensor(np.zeros((n, 0)), raw[..., : self.rec_bytes], codes, (n, k), source="gguf")

    def to_blocks(self, qt: QTensor) -> np.ndarray:
        """GGUF bytes uint8 [n, k/32 * blk_bytes] of a QTensor (== ``qt.pack(0, k)``)."""
        return qt.pack(0, qt.shape[1])


class Q8_0Format(GGUFFormat):
    name, code, rec_bytes, elem_bits, ggml_type = "q8_0", 0x30, 2, 8, 8
    source = "ggml Q8_0 (ggml-quants.c quantize_row_q8_0_ref)"

    def quantize(self, w):
        b = self._blocks(w)
        d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = round_half_away((b * idv[..., None]).astype(np.float32)).astype(np.int8)
        rec = d.astype("<f2").view(np.uint8).reshape(d.shape + (2,))
        return self._qtensor(np.zeros((b.shape[0], 0)), rec, q.view(np.uint8).reshape(w.shape), w.shape)

    def operands(self, header, rec, codes, k):
        e = codes[..., :k].astype(np.uint8).view(np.int8).astype(np.float32)
        return MacOperands(e, c1=per_burst(f16_field(rec[..., :2]), QK, k))


class _Q4Base(GGUFFormat):
    elem_bits = 4

    def pack_elems(self, codes):
        c = np.asarray(codes).astype(np.uint8)
        if c.shape[-1] != QK:
            raise QuantizeError(f"{self.name}: blocks hold exactly {QK} elements")
        return (c[..., :16] & 0x0F) | (c[..., 16:] << 4)

    def unpack_elems(self, raw, n):
        raw = np.asarray(raw, np.uint8)[..., :16]
        return np.concatenate([raw & 0x0F, raw >> 4], axis=-1).astype(np.uint16)


class Q4_0Format(_Q4Base):
    name, code, rec_bytes, ggml_type = "q4_0", 0x31, 2, 2
    source = "ggml Q4_0 (ggml-quants.c quantize_row_q4_0_ref)"

    def quantize(self, w):
        b = self._blocks(w)
        imax = np.abs(b).argmax(axis=-1)[..., None]
        mx = np.take_along_axis(b, imax, axis=-1)[..., 0]
        d = (mx / np.float32(-8)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = np.minimum(np.trunc((b * idv[..., None]).astype(np.float32) + np.float32(8.5)), 15).astype(np.uint8)
        rec = d.astype("<f2").view(np.uint8).reshape(d.shape + (2,))
        return self._qtensor(np.zeros((b.shape[0], 0)), rec, q.reshape(w.shape), w.shape)

    def operands(self, header, rec, codes, k):
        return MacOperands(codes[..., :k].astype(np.float32) - 8, c1=per_burst(f16_field(rec[..., :2]), QK, k))


class Q4_1Format(_Q4Base):
    name, code, rec_bytes, ggml_type = "q4_1", 0x32, 4, 3
    source = "ggml Q4_1 (ggml-quants.c quantize_row_q4_1_ref)"

    def quantize(self, w):
        b = self._blocks(w)
        mn = b.min(axis=-1)
        mx = b.max(axis=-1)
        d = ((mx - mn) / np.float32(15)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = np.minimum(np.trunc(((b - mn[..., None]) * idv[..., None]).astype(np.float32) + np.float32(0.5)), 15).astype(np.uint8)
        rec = np.concatenate([d.astype("<f2").view(np.uint8).reshape(d.shape + (2,)), mn.astype("<f2").view(np.uint8).reshape(d.shape + (2,))], axis=-1)
        return self._qtensor(np.zeros((b.shape[0], 0)), rec, q.reshape(w.shape), w.shape)

    def operands(self, header, rec, codes, k):
        return MacOperands(codes[..., :k].astype(np.float32), c1=per_burst(f16_field(rec[..., 0:2]), QK, k), m=per_burst(f16_field(rec[..., 2:4]), QK, k))


Q8_0 = Q8_0Format()
Q4_0 = Q4_0Format()
Q4_1 = Q4_1Format()


# ------------------------------------------------------------------ dequantize-only K-quants
def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K blocks uint8 [nb, 144] -> float32 [nb, 256] (ggml ``dequantize_row_q4_K``)."""
    raw = np.asarray(raw, np.uint8).reshape(-1, 144)
    d = _f16(raw[:, 0:2])  # [nb, 1]
    dmin = _f16(raw[:, 2:4])
    q = raw[:, 4:16].astype(np.uint8)
    sc = np.empty((raw.shape[0], 8), np.uint8)
    mn = np.empty((raw.shape[0], 8), np.uint8)
    for j in range(8):  # get_scale_min_k4
        if j < 4:
            sc[:, j] = q[:, j] & 63
            mn[:, j] = q[:, j + 4] & 63
        else:
            sc[:, j] = (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
            mn[:, j] = (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
    qs = raw[:, 16:144].reshape(-1, 4, 32)
    out = np.empty((raw.shape[0], 8, 32), np.float32)
    d1 = (d * sc.astype(np.float32)).astype(np.float32)  # [nb, 8]
    m1 = (dmin * mn.astype(np.float32)).astype(np.float32)
    for i in range(4):
        for half, nib in ((0, qs[:, i] & 0xF), (1, qs[:, i] >> 4)):
            j = 2 * i + half
            out[:, j] = (d1[:, j : j + 1] * nib.astype(np.float32)).astype(np.float32) - m1[:, j : j + 1]
    return out.reshape(-1, 256)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks uint8 [nb, 210] -> float32 [nb, 256] (ggml ``dequantize_row_q6_K``)."""
    raw = np.asarray(raw, np.uint8).reshape(-1, 210)
    ql, qh = raw[:, 0:128], raw[:, 128:192]
    sc = raw[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(raw[:, 208:210])
    out = np.empty((raw.shape[0], 256), np.float32)
    for n in range(2):
        L, H, S = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32], sc[:, 8 * n : 8 * n + 8]
        for l0 in (0, 16):
            l = slice(l0, l0 + 16)
            is_ = l0 // 16
            q1 = ((L[:, l] & 0xF) | (((H[:, l] >> 0) & 3) << 4)).astype(np.int16) - 32
            q2 = ((L[:, l0 + 32 : l0 + 48] & 0xF) | (((H[:, l] >> 2) & 3) << 4)).astype(np.int16) - 32
            q3 = ((L[:, l] >> 4) | (((H[:, l] >> 4) & 3) << 4)).astype(np.int16) - 32
            q4 = ((L[:, l0 + 32 : l0 + 48] >> 4) | (((H[:, l] >> 6) & 3) << 4)).astype(np.int16) - 32
            base = 128 * n
            for off, qq, si in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                ds = (d[:, 0] * S[:, is_ + si]).astype(np.float32)[:, None]
                out[:, base + off + l0 : base + off + l0 + 16] = (ds * qq.astype(np.float32)).astype(np.float32)
    return out


GGML_TYPES = {8: Q8_0, 2: Q4_0, 3: Q4_1}
