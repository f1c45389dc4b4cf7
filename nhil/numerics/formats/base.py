"""Common machinery of the weight formats: quantized tensors, row packing, MAC operands, the MAC.

A weight matrix ``W[N, K]`` (N outputs, K inputs) in a block format is cut along the
input dimension K into blocks of ``block`` elements (the last block of a row may be
shorter when ``block`` does not divide K; it must still hold whole 16-lane bursts).
A :class:`QTensor` holds, per output row:

* ``header``: uint8 [N, H] bytes stored once at the start of every bank row that holds a
  piece of this output row (e.g. an fp32 per-channel or per-tensor scale);
* ``rec``: uint8 [N, nblocks, F] per-block header bytes (e.g. an fp16 scale, an E8M0
  exponent, a Q4_1 ``d`` and ``m``);
* ``codes``: [N, K] element codes (unsigned integers, one per weight).

**Row layout** (what a bank row holds for one output row and one input chunk
``[k0, k1)``, ``k0`` a multiple of ``block``): ``header`` then, per block, its ``F``
header bytes followed by its packed element codes (``pack_elems``). Elements of a
block always sit in element order at fixed offsets (except GGUF's own nibble order,
whose blocks are never short), so a device can decode a row knowing only the format.

**MAC operands** (``docs/numerics.md`` "MAC with quantized weights"): a format maps its
fields to ``e`` (float32 [.., K]: element values, exactly representable and with at most
11 significant bits, so ``e * a`` with a bf16 activation ``a`` is exact in fp32) and, per
16-lane burst, up to two scales ``c1``, ``c2`` and an offset ``m`` (float32 [.., K/16]).
Burst j of a MAC computes::

    s = dot16(e * a)             # fixed pairwise tree, fp32 RNE (nhil.numerics.mac)
    t = fp32(s * c1)             # if the format has c1
    t = fp32(t * c2)             # if the format has c2
    t = fp32(t + fp32(dot16(a) * m))   # if the format has m (GGUF Q4_1's min)
    acc = fp32(acc + t)

and the dequantized value of one weight (the reference for accuracy, equal to gguf-py's
dequantize for GGUF formats) is ``w = e; w = fp32(w*c1); w = fp32(w*c2); w = fp32(w+m)``.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from nhil.numerics.formats.minifloat import QuantizeError
from nhil.numerics.mac import LANES, burst_dot16, canonicalize_nan


@dataclasses.dataclass
class MacOperands:
    """What the MAC datapath reads: element values and per-burst scale/offset (None = absent)."""

    e: np.ndarray
    c1: np.ndarray | None = None
    c2: np.ndarray | None = None
    m: np.ndarray | None = None

    def bursts(self, b0: int, b1: int) -> "MacOperands":
        """Bursts [b0, b1) along the last axis."""
        cut = lambda x: None if x is None else x[..., b0:b1]  # noqa: E731
        return MacOperands(self.e[..., b0 * LANES : b1 * LANES], cut(self.c1), cut(self.c2), cut(self.m))

    def dequantize(self) -> np.ndarray:
        """float32 [.., K]: ``w = e; w *= c1; w *= c2; w += m`` in that order, each step fp32 RNE."""
        rep = lambda x: np.repeat(x, LANES, axis=-1)[..., : self.e.shape[-1]]  # noqa: E731
        w = self.e.astype(np.float32, copy=True)
        with np.errstate(all="ignore"):
            if self.c1 is not None:
                w = np.multiply(w, rep(self.c1), dtype=np.float32)
            if self.c2 is not None:
                w = np.multiply(w, rep(self.c2), dtype=np.float32)
            if self.m is not None:
                w = np.add(w, rep(self.m), dtype=np.float32)
        return w


def mac_bursts_q(acc: np.ndarray, ops: MacOperands, a: np.ndarray) -> np.ndarray:
    """Quantized-weight MAC of ``docs/numerics.md``: bursts in order into ``acc`` (fp32).

    Args:
        acc: float32 [...] accumulators.
        ops: operands with ``e`` [..., n*16] and per-burst [..., n] scales (broadcastable).
        a: float32 [..., n*16] bf16 activation values (broadcastable to ``ops.e``).
    Returns:
        float32 [...] new accumulators, NaN canonical.
    """
    s = burst_dot16(ops.e, a)
    with np.errstate(all="ignore"):
        if ops.c1 is not None:
            s = np.multiply(s, ops.c1, dtype=np.float32)
        if ops.c2 is not None:
            s = np.multiply(s, ops.c2, dtype=np.float32)
        if ops.m is not None:
            sa = burst_dot16(np.ones_like(ops.e), a)  # dot16 of the activations alone (1 * a is exact)
            s = np.add(s, np.multiply(sa, ops.m, dtype=np.float32), dtype=np.float32)
        out = np.array(np.broadcast_to(acc, s.shape[:-1]), dtype=np.float32, copy=True)
        for j in range(s.shape[-1]):
            np.add(out, s[..., j], out=out)
    return canonicalize_nan(out)


def reference_qgemv(ops: MacOperands, x_bf16: np.ndarray) -> np.ndarray:
    """Contract-exact GEMV of a quantized ``[N, K]`` weight with bf16 activations (K % 16 == 0 or zero-padded).

    Args:
        ops: the weight's MAC operands (``QTensor.operands()``).
        x_bf16: uint16 [K] activation bits.
    """
    from nhil.numerics.bf16 import bf16_bits_to_f32

    n, k = ops.e.shape
    pad = (-k) % LANES
    e = np.pad(ops.e, ((0, 0), (0, pad)))
    x = bf16_bits_to_f32(np.pad(x_bf16, (0, pad)))
    return mac_bursts_q(np.zeros(n, np.float32), MacOperands(e, ops.c1, ops.c2, ops.m), x[None, :])


def per_burst(x: np.ndarray, block: int, k: int) -> np.ndarray:
    """Expand a per-block array [.., nblocks] to per-burst [.., ceil(k/16)] (block % 16 == 0)."""
    return np.repeat(x, block // LANES, axis=-1)[..., : -(-k // LANES)]


def f16_field(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 -> float32 (exact)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def f32_field(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 4] little-endian fp32 -> float32."""
    return np.ascontiguousarray(raw).view("<f4")[..., 0].astype(np.float32)


def f16_bytes(x: np.ndarray) -> np.ndarray:
    """float -> uint8 [..., 2] little-endian fp16 (numpy's RNE cast)."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype("<f2")).view(np.uint8).reshape(np.shape(x) + (2,))


def f32_bytes(x: np.ndarray) -> np.ndarray:
    """float -> uint8 [..., 4] little-endian fp32."""
    return np.ascontiguousarray(np.asarray(x, dtype="<f4")).view(np.uint8).reshape(np.shape(x) + (4,))


# ------------------------------------------------------------------ element packing helpers
def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-wide codes along the last axis LSB-first into bytes (4-bit: element 2i in
    the low nibble, 2i+1 in the high nibble; 6-bit: 4 elements in 3 bytes, element i in bits
    [6i, 6i+6) of the little-endian bit stream; 8/16-bit: little-endian)."""
    c = np.asarray(codes).astype(np.uint32)
    n = c.shape[-1]
    if bits == 8:
        return c.astype(np.uint8)
    if bits == 16:
        return np.ascontiguousarray(c.astype("<u2")).view(np.uint8).reshape(c.shape[:-1] + (2 * n,))
    if (n * bits) % 8:
        raise QuantizeError(f"{n} elements of {bits} bits do not fill whole bytes")
    bitpos = np.arange(bits, dtype=np.uint32)
    stream = ((c[..., :, None] >> bitpos) & 1).reshape(c.shape[:-1] + (n * bits // 8, 8)).astype(np.uint8)
    return (stream << np.arange(8, dtype=np.uint8)).sum(axis=-1, dtype=np.uint32).astype(np.uint8)


def unpack_bits(raw: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: uint8 [..., n*bits/8] -> codes uint16 [..., n]."""
    raw = np.asarray(raw, dtype=np.uint8)
    if bits == 8:
        return raw[..., :n].astype(np.uint16)
    if bits == 16:
        return np.ascontiguousarray(raw[..., : 2 * n]).view("<u2").astype(np.uint16)
    if bits == 4:
        lo, hi = raw & 0x0F, raw >> 4
        return np.stack([lo, hi], axis=-1).reshape(raw.shape[:-1] + (-1,))[..., :n].astype(np.uint16)
    nb = n * bits // 8
    stream = ((raw[..., :nb, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(raw.shape[:-1] + (n, bits))
    return (stream.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=-1, dtype=np.uint16)


@dataclasses.dataclass
class QTensor:
    """A weight ``[N, K]`` in a block format (see the module docstring for the fields)."""

    fmt: "WeightFormat"
    shape: tuple[int, int]
    header: np.ndarray  # uint8 [N, H]
    rec: np.ndarray  # uint8 [N, nblocks, F]
    codes: np.ndarray  # uint16/uint8 [N, K]
    meta: dict = dataclasses.field(default_factory=dict)

    def operands(self) -> MacOperands:
        return self.fmt.operands(self.header, self.rec, self.codes, self.shape[1])

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the value each weight stands for."""
        return self.operands().dequantize()

    def pack(self, k0: int, k1: int) -> np.ndarray:
        """uint8 [N, nbytes]: the row layout of input elements ``[k0, k1)``."""
        return self.fmt.pack(self, k0, k1)

    @property
    def nbytes(self) -> int:
        """Storage of the whole matrix in this format (one header per output row, every block record)."""
        return int(self.header.size + self.rec.size + self.fmt.elem_bytes(self.shape[1]) * self.shape[0])


class WeightFormat(abc.ABC):
    """A weight storage format the MAC datapath reads (``docs/numerics.md``).

    Attributes:
        name: format name as recorded in ``program.info["weight_formats"]``.
        code: value of CFR register ``W_FMT`` selecting it (``docs/isa.md``).
        block: elements per block along K (0 = one block per row: per-channel formats).
        header_bytes: bytes stored at the start of every bank row holding this format.
        rec_bytes: header bytes per block.
        elem_bits: bits per element code.
        source: where the definition comes from.
    """

    name: str = "?"
    code: int = -1
    block: int = 16
    header_bytes: int = 0
    rec_bytes: int = 0
    elem_bits: int = 8
    source: str = ""

    # ---------------------------------------------------------------- definition
    @abc.abstractmethod
    def quantize(self, w: np.ndarray) -> QTensor:
        """fp32 [N, K] -> QTensor (rounding/saturation per the format's source).

        Raises:
            QuantizeError: non-finite weights, or K incompatible with the block size.
        """

    @abc.abstractmethod
    def operands(self, header: np.ndarray, rec: np.ndarray, codes: np.ndarray, k: int) -> MacOperands:
        """Fields (any leading dims) -> MAC operands over ``k`` elements."""

    # ---------------------------------------------------------------- packing
    def pack_elems(self, codes: np.ndarray) -> np.ndarray:
        """Codes of one block [..., n] -> bytes (default: LSB-first bit stream)."""
        return pack_bits(codes, self.elem_bits)

    def unpack_elems(self, raw: np.ndarray, n: int) -> np.ndarray:
        return unpack_bits(raw, self.elem_bits, n)

    def elem_bytes(self, k: int) -> int:
        blk = self.block or k
        full, rest = divmod(k, blk)
        return full * (blk * self.elem_bits // 8) + -(-rest * self.elem_bits // 8)

    @property
    def blk_bytes(self) -> int:
        return self.rec_bytes + self.block * self.elem_bits // 8

    def bits_per_weight(self, k: int) -> float:
        """Average stored bits per weight for rows of ``k`` elements (headers included)."""
        nb = -(-k // self.block) if self.block else 1
        return (8 * (self.header_bytes + nb * self.rec_bytes + self.elem_bytes(k))) / k

    def check_k(self, k: int) -> None:
        blk = self.block or k
        last = k % blk or blk
        if last % LANES:
            raise QuantizeError(f"{self.name}: K={k} leaves a last block of {last} elements, not a whole number of {LANES}-lane bursts")

    def pack(self, qt: QTensor, k0: int, k1: int) -> np.ndarray:
        blk = self.block or qt.shape[1]
        if k0 % blk:
            raise QuantizeError(f"{self.name}: a row chunk must start on a block boundary (k0={k0}, block={blk})")
        parts = [qt.header]
        for b in range(k0 // blk, -(-k1 // blk)):
            e0, e1 = b * blk, min(k1, (b + 1) * blk)
            parts.append(qt.rec[:, b, :])
            parts.append(self.pack_elems(qt.codes[:, e0:e1]))
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.uint8)

    def unpack_row(self, raw: np.ndarray, n_elems: int) -> MacOperands:
        """Decode bank-row bytes [..., row_bytes] holding a chunk that starts at a block boundary.

        Every record is parsed as a full block (a short last block is a prefix of one);
        bytes past the end of the row read as zero. Returns operands for ``n_elems``
        (rounded up to whole blocks; callers use the bursts they address).
        """
        raw = np.asarray(raw, dtype=np.uint8)
        blk = self.block or n_elems
        nblk = -(-n_elems // blk)
        need = self.header_bytes + nblk * self.blk_bytes
        if raw.shape[-1] < need:
            raw = np.concatenate([raw, np.zeros(raw.shape[:-1] + (need - raw.shape[-1],), np.uint8)], axis=-1)
        header = raw[..., : self.header_bytes]
        recs = raw[..., self.header_bytes : need].reshape(raw.shape[:-1] + (nblk, self.blk_bytes))
        rec = recs[..., : self.rec_bytes]
        codes = self.unpack_elems(recs[..., self.rec_bytes :], blk).reshape(raw.shape[:-1] + (nblk * blk,))
        return self.operands(header, rec, codes, nblk * blk)

    def _qtensor(self, header, rec, codes, shape, **meta) -> QTensor:
        n = shape[0]
        header = np.asarray(header, np.uint8).reshape(n, self.header_bytes)
        blk = self.block or shape[1]
        rec = np.asarray(rec, np.uint8).reshape(n, -(-shape[1] // blk), self.rec_bytes)
        return QTensor(self, tuple(int(s) for s in shape), header, rec, np.ascontiguousarray(codes), meta)

    def describe(self) -> dict:
        return {"name": self.name, "code": self.code, "block": self.block, "header_bytes": self.header_bytes, "rec_bytes": self.rec_bytes, "elem_bits": self.elem_bits, "source": self.source}


def check_finite(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantizeError(f"{fmt}: weights must be 2-D [N, K], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise QuantizeError(f"{fmt}: the weight holds NaN or Inf; quantizers refuse non-finite weights (broken checkpoint?)")
    return w


def blocks_of(w: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """Zero-pad K to whole blocks and reshape [N, K] -> [N, nblocks, block]; returns (blocks, K)."""
    n, k = w.shape
    pad = (-k) % block
    return np.pad(w, ((0, 0), (0, pad))).reshape(n, -1, block), k


def rne_int(x: np.ndarray) -> np.ndarray:
    """Round half to even (numpy's ``rint``), as ``torch.round``."""
    return np.rint(x)
