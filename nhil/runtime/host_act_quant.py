"""Host kernels of the W8A8 MAC mode (``nhil.numerics.act_quant``): quantize a linear's input, rescale its output."""

from __future__ import annotations

import numpy as np

from nhil.numerics.act_quant import quantize_activation
from nhil.runtime.host_kernels import kernel


@kernel("act_quant", 1, 2)
def act_quant(ins, outs, ctx, mode: str = "int8", offset: int = 0, count: int = 0) -> None:
    """``x[offset:offset+count]`` -> outputs ``q`` [count] (values exact in bf16) and ``s`` [1]."""
    q, s = quantize_activation(np.asarray(ins[0], np.float32)[int(offset) : int(offset) + int(count)], mode)
    outs[0][: q.size] = q
    outs[1][0] = s


@kernel("act_rescale", 2, 1)
def act_rescale(ins, outs, ctx, offset: int = 0, count: int = 0) -> None:
    """``y[offset:offset+count] = fp32(acc * s)`` (inputs ``acc`` [count], ``s`` [1])."""
    acc = np.asarray(ins[0], np.float32)[: int(count)]
    with np.errstate(all="ignore"):
        outs[0][int(offset) : int(offset) + int(count)] = (acc * np.float32(ins[1][0])).astype(np.float32)
