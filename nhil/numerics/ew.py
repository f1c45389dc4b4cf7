"""Numerics of the in-device elementwise ops EWMUL / EWADD / AF (``docs/isa.md`` "Elementwise ops").

All three act on the fp32 accumulators of every bank of the addressed channels:

* ``EWMUL``: ``ACC[k] = fp32(ACC[k] * ACC[j])``; ``EWADD``: ``ACC[k] = fp32(ACC[k] + ACC[j])``: one IEEE-754
  binary32 operation, round to nearest even, subnormals kept, a NaN result is the canonical
  ``0x7FC00000``;
* ``AF f``: ``ACC[k] = widen(LUT_f[bf16_bits(RNE_bf16(ACC[k]))])``: the accumulator rounded to bf16 (RNE,
  NaN -> ``0x7FC0``) indexes a 65,536-entry table of bf16 values, widened exactly to fp32. The table is
  defined by ``LUT_f[h] = RNE_bf16(f(x))`` with ``x`` the bf16 value of bits ``h`` and ``f`` evaluated in
  float64 (then rounded once, float64 -> bf16, RNE; a float64 result beyond bf16's range is +-inf):

  ======  ========  =================================================  =====================
  id      name      f(x), float64                                      special values
  ======  ========  =================================================  =====================
  0       silu      ``x / (1 + exp(-x))``                              f(-inf) = -0, f(+inf) = +inf
  1       gelu      ``x * (1 + erf(x / sqrt(2))) / 2``                 f(-inf) = -0, f(+inf) = +inf
  ======  ========  =================================================  =====================

  and ``LUT_f[NaN] = 0x7FC0``. (float64 evaluation then one rounding to bf16 equals the correctly
  rounded bf16 of the real function except where the float64 error straddles a bf16 rounding
  boundary; the table, not the real function, is the contract.)

The simulator (``nhil.targets.sim.device``) uses these functions; the device-numerics reference
(``nhil.golden.quant_ew``) computes the same values independently in torch.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

AF_FUNCS: dict[int, str] = {0: "silu", 1: "gelu"}  # AF imm -> function
AF_IDS: dict[str, int] = {v: k for k, v in AF_FUNCS.items()}
_F32_NAN = np.uint32(0x7FC00000)


def _f64_to_bf16_bits(y: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits, one rounding (RNE), overflow to +-inf, NaN -> 0x7FC0.

    Exact: round float64 to the nearest float32 with the bits below bf16 precision kept as a
    sticky bit (round to odd at float32 precision), then fp32 -> bf16 RNE; round-to-odd at a
    precision more than 2 bits finer makes the double rounding equal to one rounding.
    """
    y = np.asarray(y, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = y.astype(np.float32)  # RNE to fp32
    back = f.astype(np.float64)
    bits = f.view(np.uint32).copy()
    inexact = np.isfinite(y) & np.isfinite(back) & (back != y)
    # round to odd: when fp32 rounding was inexact, take the fp32 neighbour toward zero and set its last bit
    toward0 = np.where(np.abs(back) > np.abs(y), bits - np.uint32(1), bits)
    bits = np.where(inexact, toward0 | np.uint32(1), bits).astype(np.uint32)
    big = np.isfinite(y) & ~np.isfinite(back)  # beyond fp32: beyond bf16 too (same exponent range) -> inf
    out = f32_to_bf16_bits(bits.view(np.float32))
    out = np.where(big, np.where(y > 0, np.uint16(0x7F80), np.uint16(0xFF80)), out).astype(np.uint16)
    out[np.isnan(y)] = np.uint16(0x7FC0)
    return out


def _f64(name: str, x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if name == "silu":
            y = x / (1.0 + np.exp(-x))
        elif name == "gelu":
            erf = np.vectorize(math.erf, otypes=[np.float64])
            y = x * (1.0 + erf(x / math.sqrt(2.0))) / 2.0
        else:
            raise KeyError(name)
    y = np.where(x == -np.inf, -0.0, y)
    y = np.where(x == np.inf, np.inf, y)
    return y


@functools.lru_cache(maxsize=None)
def af_lut(func: int) -> np.ndarray:
    """The AF table of function id ``func``: uint16 [65536] bf16 bits, ``LUT[h]`` for input bits ``h`` (module docstring).

    Raises:
        KeyError: unknown function id (known: :data:`AF_FUNCS`).
    """
    name = AF_FUNCS[int(func)]
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # signalling-NaN patterns widen with a warning
        x = bf16_bits_to_f32(h).astype(np.float64)
    lut = _f64_to_bf16_bits(_f64(name, x))
    lut[np.isnan(x)] = np.uint16(0x7FC0)
    lut.setflags(write=False)
    return lut


def _canon(r: np.ndarray) -> np.ndarray:
    r = np.asarray(r, np.float32)
    nan = np.isnan(r)
    if nan.any():
        r = r.copy()
        r.view(np.uint32)[nan] = _F32_NAN
    return r


def ew_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``EWMUL``: fp32 ``a * b`` elementwise (RNE, canonical NaN); same shapes, float32."""
    with np.errstate(all="ignore"):
        return _canon(np.multiply(np.asarray(a, np.float32), np.asarray(b, np.float32), dtype=np.float32))


def ew_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``EWADD``: fp32 ``a + b`` elementwise (RNE, canonical NaN); same shapes, float32."""
    with np.errstate(all="ignore"):
        return _canon(np.add(np.asarray(a, np.float32), np.asarray(b, np.float32), dtype=np.float32))


def af_apply(a: np.ndarray, func: int) -> np.ndarray:
    """``AF``: ``widen(LUT_func[RNE_bf16(a)])`` elementwise; float32 in, float32 out (every value a bf16)."""
    return bf16_bits_to_f32(af_lut(func)[f32_to_bf16_bits(a)])
