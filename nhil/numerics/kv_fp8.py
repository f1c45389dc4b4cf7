"""FP8 KV cache contract (``--kv-cache fp8``, issue 20 item 3; ``docs/numerics.md`` "FP8 KV cache").

K and V are stored in the banks as OCP OFP8 E4M3FN codes with a static fp32 scale per KV head
(per-tensor = every head the same), as serving engines do (vLLM ``kv_cache_dtype=fp8``:
``k_scale`` / ``v_scale``, 1.0 when the checkpoint ships none). Element ``x`` of head ``h`` is
stored as ``q = e4m3(fp32(x / s_h))`` (RNE, saturating at ±448, NaN stays NaN) and read as
``e4m3(q) * s_h`` inside the MAC (the burst adds ``fp32(dot16(e4m3(q) * a) * s_h)``):

* **K** row of position ``t`` (slot ``t % S``, row ``K_base + t // S``, as bf16): the format
  ``fp8-e4m3-b<hd>`` — per KV head a record of the fp32 scale ``s_k[h]`` (4 B little-endian)
  then the ``hd`` codes; the host packs the whole row (:func:`k_row_words`) and WR_SBK writes
  it as raw 16-bit words (``program.info["raw_buffers"]``: the words are not bf16 values).
* **Vᵀ** row of slot ``u = h*hd + d``: the format ``fp8-e4m3`` — fp32 scale ``s_v[h]`` (4 B),
  then one code per position: position ``t`` at byte ``4 + t % P`` of row ``t // P`` of its
  group, ``P = cols`` positions per row (:func:`v_positions_per_row`; the same rows as bf16,
  half the bytes written and read per position). The
  append writes that one byte: WR_SBK with ``k = 1`` (low byte of each masked word lane) or
  ``k = 2`` (high byte), the other byte unchanged (a DRAM byte write mask); the lowering emits
  ``k = 3`` with ``POS_COL`` and the runtime binds the byte from the position
  (``docs/isa.md`` "Position-relative instructions").
"""

from __future__ import annotations

import numpy as np

from nhil.numerics.formats.minifloat import E4M3FN

V_HEADER = 4  # bytes: the fp32 scale at the start of every Vᵀ row


def v_positions_per_row(cols: int, lanes: int) -> int:
    """Cache positions one fp8 Vᵀ row holds: ``cols``, as a bf16 row (a MAC addresses at most ``cols`` elements
    of a row in any format, so the fp8 row fills ``4 + cols`` of its ``2 * cols`` bytes)."""
    return cols


def quantize_kv(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [hkv, hd] values and [hkv] scales -> E4M3FN codes uint8 [hkv, hd] (``fp32(x / s)``, RNE, saturating)."""
    with np.errstate(all="ignore"):
        y = (np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]).astype(np.float32)
    return E4M3FN.encode(y, saturate=True).astype(np.uint8)


def k_row_words(k: np.ndarray, scale: np.ndarray, head_dim: int) -> np.ndarray:
    """K row image as uint16 words: per head ``[fp32 s_k[h]][hd E4M3 codes]``, little-endian bytes."""
    hkv = scale.shape[0]
    codes = quantize_kv(np.asarray(k, np.float32).reshape(hkv, head_dim), scale)
    sb = np.ascontiguousarray(np.asarray(scale, "<f4")).view(np.uint8).reshape(hkv, 4)
    return np.ascontiguousarray(np.concatenate([sb, codes], axis=1)).view("<u2").reshape(-1)


def bind_v_byte(pos: int, cols: int, lanes: int) -> tuple[int, int, int, int]:
    """Position -> (row offset, burst col, lane, byte half k in {1, 2}) of an fp8 Vᵀ append."""
    p = v_positions_per_row(cols, lanes)
    j = V_HEADER + pos % p
    word = j // 2
    return pos // p, word // lanes, word % lanes, 1 + j % 2
