"""The device's MAC arithmetic written in PyTorch, for the device-numerics reference (``nhil.golden.quant_reference``).

``docs/numerics.md`` "MAC" and "MAC with quantized weights": activations rounded to bf16
(RNE), per 16-lane burst the products summed by the fixed pairwise tree in fp32
(:func:`burst_tree`), per-burst scales and offsets, then the bursts accumulated in order
from +0 (:func:`accumulate_bursts`); a NaN result is the canonical ``0x7FC00000``. Only
elementwise fp32 ``*`` and ``+`` (IEEE binary32, RNE on CPU) are used, never
``torch.sum``/``matmul`` (they reorder), so this is a second implementation of
``nhil.numerics.mac``, not a call to it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

LANES = 16  # MAC burst width (docs/numerics.md)
_NAN_BITS = 0x7FC00000


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (RNE, torch's cast) -> fp32; float32 tensor of the same shape."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(x)
    if bool(nan.any()):
        x = x.clone()
        x.view(torch.int32)[nan] = _NAN_BITS
    return x


def burst_tree(p: torch.Tensor) -> torch.Tensor:
    """Fixed pairwise tree over 16-lane bursts: float32 [..., n*16] -> [..., n].

    Level 1 adds lanes (0,1), (2,3), ..., level 2 pairs of those, 4 levels in all
    (``docs/numerics.md`` "MAC", step 2); each addition is an fp32 RNE add.
    """
    p = p.reshape(p.shape[:-1] + (-1, LANES))
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def accumulate_bursts(s: torch.Tensor) -> torch.Tensor:
    """``acc = +0; acc = fp32(acc + s[..., j])`` for j in order: float32 [..., n] -> [...]."""
    acc = torch.zeros(s.shape[:-1], dtype=torch.float32)
    for j in range(s.shape[-1]):
        acc = acc + s[..., j]
    return acc


def _pad_lanes(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.shape[-1]) % LANES
    return F.pad(x, (0, pad)) if pad else x


class MacWeight:
    """A linear weight as the MAC reads it: element values ``e`` [N, Kp] and per-burst
    ``c1``/``c2``/``m`` [N, Kp/16] (None when the format has none), Kp = K padded to 16;
    ``deq`` [N, K] is the dequantized fp32 weight (``docs/numerics.md``). Both are built on
    first use (a SmolLM2-size model holds one of them, not both).

    Built from a :class:`~nhil.numerics.formats.QTensor` (its ``operands()``) or, for
    bf16 (``qt=None``), from the fp32 weight [N, K] rounded to bf16.
    """

    def __init__(self, weight: torch.Tensor, qt=None) -> None:
        self.weight, self.qt = weight.detach(), qt
        self.fmt = qt.fmt.name if qt is not None else "bf16"
        self.n_out, self.n_in = int(weight.shape[0]), int(weight.shape[1])
        self._ops = None
        self._deq = None

    def _operands(self):
        if self._ops is None:
            if self.qt is None:
                self._ops = (_pad_lanes(round_bf16(self.weight)), None, None, None)
            else:
                ops = self.qt.operands()
                t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
                self._ops = (_pad_lanes(t(ops.e)), t(ops.c1), t(ops.c2), t(ops.m))
        return self._ops

    @property
    def e(self) -> torch.Tensor:
        return self._operands()[0]

    @property
    def deq(self) -> torch.Tensor:
        if self._deq is None:
            self._deq = round_bf16(self.weight) if self.qt is None else torch.from_numpy(np.ascontiguousarray(self.qt.dequantize(), dtype=np.float32))
        return self._deq

    @property
    def act(self) -> str | None:
        """W8A8 activation mode (``nhil.numerics.act_quant``) of this weight, None for bf16 activations."""
        return None if self.qt is None else self.qt.meta.get("act")

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Device GEMV: float32 [K] activations (rounded to bf16 here) -> float32 [N]; W8A8: per-token quantized
        activations in the MAC, the result times their scale."""
        if self.act:
            q, sc = act_quant_torch(x, self.act)
            return self._mac(q) * sc
        return self._mac(x)

    def _mac(self, x: torch.Tensor) -> torch.Tensor:
        e, c1, c2, m = self._operands()
        a = _pad_lanes(round_bf16(x.reshape(-1)))
        s = burst_tree(e * a)
        if c1 is not None:
            s = s * c1
        if c2 is not None:
            s = s * c2
        if m is not None:
            s = s + burst_tree(a) * m
        return _canonical_nan(accumulate_bursts(s))


def act_quant_torch(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic 8-bit activation (``nhil.numerics.act_quant``, written again in torch): (q [K], s)."""
    x = x.reshape(-1).to(torch.float32)
    s = x.abs().max() / (127.0 if mode == "int8" else 448.0)
    if not bool(s > 0):
        return torch.zeros_like(x), s if bool(torch.isnan(s)) else torch.zeros(())
    y = x / s
    q = torch.round(y).clamp(-128, 127) if mode == "int8" else y.to(torch.float8_e4m3fn).to(torch.float32)
    return q, s


def bf16_mac_rows(rows: torch.Tensor, x: torch.Tensor, c1: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 MAC of each row of ``rows`` [..., R, K] with ``x`` [..., K] (both rounded to bf16): [..., R].
    ``c1`` (broadcastable to the bursts [..., R, K/16]): a per-burst scale, ``fp32(dot16 * c1)`` (fp8 KV rows,
    whose E4M3 values are exact in bf16)."""
    a = _pad_lanes(round_bf16(x)).unsqueeze(-2)
    s = burst_tree(_pad_lanes(round_bf16(rows)) * a)
    return _canonical_nan(accumulate_bursts(s if c1 is None else s * c1))


def _fp8_values(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3FN value of ``fp32(x / s_h)`` (RNE, saturating), [hkv, hd] with scales [hkv]: what the fp8 cache holds."""
    return (x.to(torch.float32) / scale[:, None]).to(torch.float8_e4m3fn).to(torch.float32)


def _lanes_up(n: int) -> int:
    return -(-n // LANES) * LANES
