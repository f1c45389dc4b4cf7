"""Host kernels of the FP8 KV cache (``nhil.numerics.kv_fp8``): quantize k / v before their WR_SBK appends."""

from __future__ import annotations

import numpy as np

from nhil.numerics.kv_fp8 import k_row_words, quantize_kv
from nhil.runtime.host_kernels import kernel


@kernel("kv_fp8_k", 2, 1)
def kv_fp8_k(ins, outs, ctx, head_dim: int = 0) -> None:
    """``k`` [hkv*hd] fp32, scales [hkv] -> the K row's raw 16-bit words as exact fp32 integers [hkv*(hd+4)/2]."""
    words = k_row_words(ins[0], np.asarray(ins[1], np.float32), int(head_dim))
    outs[0][: words.size] = words.astype(np.float32)


@kernel("kv_fp8_v", 2, 1)
def kv_fp8_v(ins, outs, ctx, head_dim: int = 0) -> None:
    """``v`` [hkv*hd] fp32, scales [hkv] -> E4M3 codes as exact fp32 integers [hkv*hd] (the byte each append writes)."""
    s = np.asarray(ins[1], np.float32)
    outs[0][: s.size * int(head_dim)] = quantize_kv(np.asarray(ins[0], np.float32).reshape(s.size, -1), s).reshape(-1).astype(np.float32)
