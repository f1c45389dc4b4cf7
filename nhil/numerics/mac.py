"""The MAC datapath contract: bf16 x bf16 products summed in a fixed order in fp32.

This is the single numerics definition that the simulator, the RTL model and the
golden quantized reference follow (``docs/numerics.md`` section "MAC"):

1. A burst is 16 lanes. Lane ``i`` product ``p_i = fp32(w_i * a_i)`` where ``w_i`` and
   ``a_i`` are bf16 values widened to fp32. A product of two 8-bit significands has at
   most 16 significant bits, so it is exact in fp32 unless it overflows (-> inf, RNE)
   or underflows (-> subnormal/zero, RNE).
2. ``dot16`` = fixed pairwise tree over the 16 products, every addition an IEEE-754
   binary32 addition with round-to-nearest-even (subnormals kept):
   level 1 adds lanes (0,1),(2,3),...,(14,15); level 2 adds those pairs in order, and so
   on to one value (4 levels, 15 additions).
3. An accumulator absorbs bursts strictly in instruction order:
   ``acc = fp32(acc + dot16(burst_j))`` for j = 0, 1, ..., n-1.
4. Any NaN produced anywhere is stored in the accumulator as the canonical quiet NaN
   ``0x7FC00000``; infinities and signed zeros follow IEEE-754 (``-0 + -0 = -0``,
   ``-0 + +0 = +0``, ``inf + -inf = NaN``).

numpy's float32 elementwise ``*`` and ``+`` are IEEE binary32 operations with RNE, so
writing the tree with explicit slicing (never ``np.sum``, which reorders) gives the
contract's bits.
"""

from __future__ import annotations

import numpy as np

CANONICAL_NAN_F32 = np.uint32(0x7FC00000)
LANES = 16


def burst_dot16(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Per-burst dot products with the fixed pairwise tree.

    Args:
        w: float32 [..., n*16] weights (bf16 values widened to fp32).
        a: float32 [..., n*16] activations (bf16 values widened), broadcastable to ``w``.
    Returns:
        float32 [..., n]: ``dot16`` of each 16-lane burst (NaN not yet canonicalised).
    """
    with np.errstate(all="ignore"):  # overflow/invalid are defined results (IEEE), not errors
        p = np.multiply(w, a, dtype=np.float32)
        p = p.reshape(p.shape[:-1] + (-1, LANES))
        while p.shape[-1] > 1:
            p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def canonicalize_nan(x: np.ndarray) -> np.ndarray:
    """Replace every NaN in a float32 array by the canonical quiet NaN (in place); returns ``x``."""
    nan = np.isnan(x)
    if nan.any():
        x.view(np.uint32)[nan] = CANONICAL_NAN_F32
    return x


def mac_bursts(acc: np.ndarray, w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Accumulate bursts into ``acc`` in order: ``acc = fp32(acc + dot16(burst_j))``.

    Args:
        acc: float32 [...] current accumulator values.
        w: float32 [..., n*16] weight lanes.
        a: float32 [..., n*16] activation lanes (broadcastable to ``w``).
    Returns:
        float32 [...] new accumulator values, NaN canonicalised.
    """
    s = burst_dot16(w, a)
    out = np.array(np.broadcast_to(acc, s.shape[:-1]), dtype=np.float32, copy=True)
    with np.errstate(all="ignore"):
        for j in range(s.shape[-1]):
            np.add(out, s[..., j], out=out)
    return canonicalize_nan(out)


def reference_gemv(w_bf16: np.ndarray, x_bf16: np.ndarray) -> np.ndarray:
    """Contract-exact GEMV for testing and golden quantized references.

    Args:
        w_bf16: uint16 [N, K] bf16 weight bits.
        x_bf16: uint16 [K] bf16 activation bits.
    Returns:
        float32 [N]: ``y[o]`` accumulated from zero over bursts of 16 (K zero-padded to a
        multiple of 16) per the contract above.
    """
    from nhil.numerics.bf16 import bf16_bits_to_f32

    n, k = w_bf16.shape
    pad = (-k) % LANES
    w = bf16_bits_to_f32(np.pad(w_bf16, ((0, 0), (0, pad))))
    x = bf16_bits_to_f32(np.pad(x_bf16, (0, pad)))
    return mac_bursts(np.zeros(n, np.float32), w, x[None, :])
