"""Element (scalar) floating-point formats defined from their S/E/M/bias spec.

Every value set is *enumerated from the bit layout* (sign, exponent, mantissa, bias, and
which codes are Inf/NaN), never taken from a library, so the tests can cross-check
torch and ml_dtypes against an independent, spec-derived table.

Sources (``docs/numerics.md`` section "Element formats"):

* FP8 E4M3FN and E5M2: OCP 8-bit Floating Point Specification (OFP8) rev 1.0; arXiv:2209.05433.
  E4M3FN has no Inf and one NaN mantissa per sign (``S.1111.111``), max 448; E5M2 is
  IEEE-like (Inf ``S.11111.00``, NaN ``S.11111.{01,10,11}``), max 57344.
* FP6 E3M2 / E2M3 and FP4 E2M1: OCP Microscaling Formats (MX) v1.0 section 5.3 (no Inf, no NaN).
* UE4M3 (NVFP4 block scale): E4M3FN with the sign bit 0.
* FP16: IEEE 754 binary16.

Encoding (fp32 -> code): round to nearest, ties to even (ties go to the code whose
mantissa LSB is 0, i.e. the even code, because positive codes are monotone in value).
Overflow policy ``saturate=True`` clamps to +-max (OCP MX v1.0 section 6.3 rule 2 and
torch 2.13's ``float8_e4m3fn`` cast); ``saturate=False`` rounds to Inf where the format has
one (E5M2, FP16: IEEE) and to NaN where it has none but has a NaN (E4M3FN, as ml_dtypes).
Formats without NaN refuse NaN input (``QuantizeError``); ``-0.0`` encodes to the
negative-zero code.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from nhil.errors import NhilError


class QuantizeError(NhilError, ValueError):
    """A value cannot be encoded in a format under the documented rule (e.g. NaN into FP4)."""

    outcome = "COMPILE_FAIL"


@dataclasses.dataclass(frozen=True)
class MiniFloat:
    """A sign-magnitude binary floating-point element format.

    Attributes:
        name: e.g. ``"e4m3fn"``.
        ebits, mbits, bias: exponent/mantissa widths and exponent bias.
        inf: the format has +-Inf at the all-ones exponent with zero mantissa (IEEE-like).
        nan: ``"ieee"`` (all-ones exponent, nonzero mantissa), ``"fn"`` (only all-ones
            exponent and mantissa), or ``"none"``.
        signed: False for unsigned formats (UE4M3): no sign bit.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    inf: bool = False
    nan: str = "none"
    signed: bool = True

    @property
    def bits(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def emax_pow2(self) -> int:
        """floor(log2(max finite)): the exponent of the largest power of two (OCP MX "emax_elem")."""
        return int(np.floor(np.log2(self.max)))

    def _mag_value(self, mag: int) -> float:
        """Value of a non-negative code (sign bit cleared); NaN/Inf where the spec says so."""
        e, m = mag >> self.mbits, mag & ((1 << self.mbits) - 1)
        eall = (1 << self.ebits) - 1
        if self.nan == "ieee" and e == eall:
            return np.inf if m == 0 else np.nan
        if self.nan == "fn" and e == eall and m == (1 << self.mbits) - 1:
            return np.nan
        if e == 0:
            return m * 2.0 ** (1 - self.bias - self.mbits)
        return (1 + m / (1 << self.mbits)) * 2.0 ** (e - self.bias)

    @functools.cached_property
    def table(self) -> np.ndarray:
        """float64 [2**bits]: the value of every code (spec-derived)."""
        n_mag = 1 << (self.ebits + self.mbits)
        mags = np.array([self._mag_value(c) for c in range(n_mag)], np.float64)
        if not self.signed:
            return mags
        return np.concatenate([mags, -mags])

    @functools.cached_property
    def _finite_pos(self) -> np.ndarray:
        mags = self.table[: 1 << (self.ebits + self.mbits)]
        fin = np.isfinite(mags)
        # positive finite codes are 0..top contiguous for every format here
        top = int(np.flatnonzero(fin)[-1])
        assert fin[: top + 1].all()
        return mags[: top + 1]

    @property
    def max(self) -> float:
        return float(self._finite_pos[-1])

    @property
    def min_subnormal(self) -> float:
        return float(self._finite_pos[1])

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits) if self.signed else 0

    def nan_code(self) -> int:
        if self.nan == "none":
            raise QuantizeError(f"{self.name} has no NaN encoding")
        if self.nan == "fn":
            return (1 << (self.ebits + self.mbits)) - 1
        return (((1 << self.ebits) - 1) << self.mbits) | (1 << (self.mbits - 1))  # quiet NaN

    def inf_code(self) -> int:
        return ((1 << self.ebits) - 1) << self.mbits

    def encode(self, x, saturate: bool = True) -> np.ndarray:
        """fp32/fp64 values -> codes (uint8, or uint16 for fp16), RNE, overflow per ``saturate``.

        Raises:
            QuantizeError: NaN into a format without NaN; a negative value into an unsigned
                format (other than -0.0, which becomes +0).
        """
        x = np.asarray(x, dtype=np.float64)
        pos = self._finite_pos
        a = np.abs(x)
        nan = np.isnan(x)
        if nan.any() and self.nan == "none":
            raise QuantizeError(f"NaN cannot be encoded in {self.name} (no NaN code): fix or clamp the input")
        if not self.signed and (x < 0).any():
            raise QuantizeError(f"negative value {x[x < 0].flat[0]} cannot be encoded in unsigned {self.name}")
        a_clean = np.where(nan, 0.0, a)
        hi = np.searchsorted(pos, a_clean, side="left").clip(0, len(pos) - 1)  # pos[hi] >= a (or last)
        lo = np.maximum(hi - 1, 0)
        dlo = a_clean - pos[lo]
        dhi = pos[hi] - a_clean
        pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
        code = np.where(pick_hi, hi, lo)
        code = np.where(a_clean <= pos[0], 0, code)
        # beyond max: RNE against the next (non-representable) step, i.e. the value max + ulp(max)
        over = a_clean > pos[-1]
        if over.any():
            ulp = pos[-1] - pos[-2]
            top_is_odd = (len(pos) - 1) % 2 == 1  # a tie at max + ulp/2 goes to the even code
            rounds_up = (a_clean > pos[-1] + ulp / 2) | ((a_clean == pos[-1] + ulp / 2) & top_is_odd)
            code = np.where(over, len(pos) - 1, code)
            if not saturate:
                if self.inf:
                    code = np.where(over & rounds_up, self.inf_code(), code)
                elif self.nan != "none":
                    code = np.where(over & rounds_up, self.nan_code(), code)
        if self.signed:
            code = code | np.where(np.signbit(x), self.sign_bit, 0)
        if nan.any():
            code = np.where(nan, self.nan_code(), code)
        return code.astype(np.uint16 if self.bits > 8 else np.uint8)

    def decode(self, codes) -> np.ndarray:
        """codes -> float32 values (exact: every value of these formats is an fp32 value)."""
        return self.table[np.asarray(codes).astype(np.int64)].astype(np.float32)

    def round(self, x, saturate: bool = True) -> np.ndarray:
        """fp32 -> nearest representable value (as float32)."""
        return self.decode(self.encode(x, saturate))


E4M3FN = MiniFloat("e4m3fn", 4, 3, 7, inf=False, nan="fn")
E5M2 = MiniFloat("e5m2", 5, 2, 15, inf=True, nan="ieee")
E3M2 = MiniFloat("e3m2fn", 3, 2, 3)
E2M3 = MiniFloat("e2m3fn", 2, 3, 1)
E2M1 = MiniFloat("e2m1fn", 2, 1, 1)
UE4M3 = MiniFloat("ue4m3", 4, 3, 7, nan="fn", signed=False)
FP16 = MiniFloat("fp16", 5, 10, 15, inf=True, nan="ieee")

ELEMENTS: dict[str, MiniFloat] = {f.name: f for f in (E4M3FN, E5M2, E3M2, E2M3, E2M1, UE4M3, FP16)}


# ------------------------------------------------------------------ E8M0 (MX shared scale)
E8M0_NAN = 0xFF


def e8m0_decode(codes) -> np.ndarray:
    """E8M0 (OCP MX v1.0 section 5.4.1): unsigned biased exponent, value 2**(code-127); 0xFF = NaN; no zero.

    Returns float32 (2**-127 is an fp32 subnormal, exact).
    """
    c = np.asarray(codes).astype(np.int64)
    v = np.ldexp(1.0, c - 127)
    return np.where(c == E8M0_NAN, np.nan, v).astype(np.float32)


def e8m0_encode_exponent(exp) -> np.ndarray:
    """Unbiased exponents (already clamped to [-127, 127]) -> E8M0 codes."""
    e = np.asarray(exp).astype(np.int64)
    if ((e < -127) | (e > 127)).any():
        raise QuantizeError("E8M0 exponent outside [-127, 127]")
    return (e + 127).astype(np.uint8)
