"""Device numerics of the in-device elementwise ops for the device-numerics reference (``docs/isa.md`` "Elementwise ops").

Written in torch, independently of the simulator's ``nhil.numerics.ew`` (which builds the AF table by
round-to-odd at fp32 precision, then fp32 -> bf16): here a float64 value is rounded to bf16 directly,
to 8 significant bits with ``torch.round`` (half to even) at the bf16 quantum of its binade
(``2^(e-8)`` for ``|y|`` in ``[2^(e-1), 2^e)``, at least ``2^-133``, the subnormal quantum), a result
above bf16's largest finite value becomes +-inf.

:func:`ew_silu_mul` is what the ``ew-swiglu`` pass (``nhil.compiler.ew_lower``) makes the device compute
for ``silu_mul(g, u)``: ``AF silu`` on the gate accumulator, then ``EWMUL`` by the up accumulator:
``fp32(LUT_silu[bf16(g)] * u)``, a NaN result canonical.
"""

from __future__ import annotations

import torch

_BF16_MAX = (2.0 - 2.0**-7) * 2.0**127
_NAN_BITS = 0x7FC00000


def f64_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest bf16 value (RNE, overflow to +-inf, NaN stays NaN), as float64."""
    y = y.to(torch.float64)
    _, e = torch.frexp(y)  # |y| = m * 2^e, m in [0.5, 1)
    qe = torch.clamp(e.to(torch.float64) - 8.0, min=-133.0)
    q = torch.round(y * torch.pow(2.0, -qe)) * torch.pow(2.0, qe)
    q = torch.where(torch.abs(q) > _BF16_MAX, torch.copysign(torch.full_like(q, float("inf")), y), q)
    q = torch.where(torch.isfinite(y), q, y)
    return torch.where(y == 0, y, q)  # keeps the sign of zero


def silu_table_value(x: torch.Tensor) -> torch.Tensor:
    """``LUT_silu`` at bf16 values ``x`` (float32 tensor of bf16 values): ``RNE_bf16(x / (1 + exp(-x)))`` in float64, as float32."""
    d = x.to(torch.float64)
    y = d / (1.0 + torch.exp(-d))
    y = torch.where(d == float("-inf"), torch.full_like(d, -0.0), y)
    y = torch.where(d == float("inf"), d, y)
    return f64_to_bf16(y).to(torch.float32)


def ew_silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``fp32(LUT_silu[bf16(g)] * u)`` (float32 in and out, same shape); a NaN result is ``0x7FC00000``."""
    gb = g.to(torch.float32).to(torch.bfloat16).to(torch.float32)
    r = silu_table_value(gb) * u.to(torch.float32)
    nan = torch.isnan(r)
    if bool(nan.any()):
        r = r.clone()
        r.view(torch.int32)[nan] = _NAN_BITS
    return r
