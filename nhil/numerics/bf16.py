"""bfloat16 <-> float32 conversions, bit-exact, in numpy.

bfloat16 is the upper 16 bits of an IEEE-754 binary32 (1 sign, 8 exponent, 7 mantissa
bits). Conversion from fp32 rounds to nearest, ties to even (RNE), with overflow to
infinity as IEEE specifies; every NaN becomes the canonical quiet NaN ``0x7FC0``
(sign cleared). This matches ``torch.Tensor.to(torch.bfloat16)`` on finite values and
infinities (checked in ``tests/test_numerics.py`` against torch and ml_dtypes).
Subnormals are kept (no flush to zero).
"""

from __future__ import annotations

import numpy as np

BF16_CANONICAL_NAN = np.uint16(0x7FC0)


def _round_bits_py(u, out):  # pragma: no cover - compiled by numba
    """``out[i]`` = bf16 bits of the fp32 bit pattern ``u[i]``: RNE, every NaN to the canonical ``0x7FC0``
    (``(u & 0x7FFFFFFF) > 0x7F800000`` is exactly "u is a NaN")."""
    for i in range(u.size):
        x = u[i]
        if (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16(0x7FC0)
        else:
            out[i] = np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


try:  # numba is a core dependency; the numpy expression below gives the same bits (tests/test_numerics.py)
    from numba import njit

    _round_bits = njit(cache=True, nogil=True)(_round_bits_py)
except ImportError:  # pragma: no cover - exercised only without numba
    _round_bits = None


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 values to bf16 (RNE), returning the raw bits.

    One compiled loop over the elements when numba is present (a decode step converts ~240 host vectors: 23 -> 5
    µs each), else :func:`f32_to_bf16_bits_np`; the two give the same bits.

    Args:
        x: array of any shape, converted to float32 first.
    Returns:
        uint16 array of the same shape (bf16 bit patterns).
    """
    if _round_bits is None:
        return f32_to_bf16_bits_np(x)
    f = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(f.shape, np.uint16)
    _round_bits(f.reshape(-1).view(np.uint32), out.reshape(-1))
    return out


def f32_to_bf16_bits_np(x: np.ndarray) -> np.ndarray:
    """:func:`f32_to_bf16_bits` as numpy array expressions: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on the fp32
    bits ``u``, then the canonical NaN where ``x`` is a NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounding = ((u >> 16) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = BF16_CANONICAL_NAN
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32 exactly (bits placed in the upper half)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (RNE) -> fp32: the value a bf16 register holds, as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))
