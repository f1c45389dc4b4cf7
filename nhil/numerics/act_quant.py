"""8-bit activations for W8A8 (issue 20 item 4): per-token dynamic int8 / FP8 activations in the MAC.

A linear whose plan gives it an activation mode (``act=int8`` / ``act=fp8`` recipe override, or a
pre-quantized checkpoint's ``input_activations`` int8 / fp8 per-token dynamic) runs, for the
activation vector ``x`` (fp32 [K], one token):

1. host: ``amax = max |x|``; ``s = fp32(amax / 127)`` (int8) or ``fp32(amax / 448)`` (fp8);
   ``q = clamp(rne(fp32(x / s)), -128, 127)`` (int8) or ``e4m3_sat(fp32(x / s))`` (fp8, E4M3FN
   value); ``s = 0`` (a zero vector) gives ``q = 0``. This is vLLM's dynamic per-token quantizer
   (``scaled_int8_quant`` / ``scaled_fp8_quant``, ``csrc/quantization``), which serves
   compressed-tensors W8A8 checkpoints;
2. device: the quantized-weight MAC of ``docs/numerics.md`` with ``q`` as the activations: ``q``
   is exact in bf16 (int8: integers up to 128; E4M3: 4 significant bits, exponents inside bf16's
   range), so WR_GB carries it unchanged, and ``dot16(e * q)`` of int8 weights is an exact integer;
3. host: ``y = fp32(acc * s)`` per output.

Both the host kernel (``nhil/runtime/host_act_quant.py``) and the quantized reference
(``nhil/golden/quant_reference.py``, in torch) follow these steps.
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.minifloat import E4M3FN

ACT_MODES = {"int8": 127.0, "fp8": 448.0}  # mode -> the divisor of amax


def quantize_activation(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.float32]:
    """float32 [K] -> (q float32 [K] exact in bf16, scale s fp32) per the module docstring.

    Raises:
        KeyError: unknown mode.
    """
    x = np.asarray(x, np.float32)
    s = np.float32(np.float32(np.abs(x).max(initial=0.0)) / np.float32(ACT_MODES[mode]))
    if not s > 0:
        return np.zeros_like(x), np.float32(0.0) if s == 0 else s
    with np.errstate(all="ignore"):
        y = (x / s).astype(np.float32)
    if mode == "int8":
        return np.clip(np.rint(y), -128, 127).astype(np.float32), s
    return E4M3FN.decode(E4M3FN.encode(y, saturate=True)).astype(np.float32), s
