"""The compiled scatter of a run of ``WR_SBK`` (KV-cache appends) into the bank state (``FastPimState._scatter_sbk``):
each lane an element of one bank row, written where the lane mask says, refused whole when two lanes of the run
write the same element (the caller then runs them one by one, in order, as ``PimState.step``).
"""

from __future__ import annotations

import numpy as np

from nhil.targets.sim.kernels import AVAILABLE, njit

_LANES = 16  # bf16 elements per burst (DeviceConfig.lanes of every preset)

def _scatter_sbk_py(mem_t, slots, ch, bank, col, imm, pay):  # pragma: no cover - compiled by numba
    """WR_SBK of ``m`` single-channel bursts: ``mem_t[ch, slot, col*16 + lane, bank] = pay[t, lane]`` for every lane
    set in ``imm[t]``; returns False, having written nothing, when two of them write the same element.

    Args:
        mem_t: uint16 [channels, slots, cols, banks]; slots, ch, bank, col, imm: int64 [m] (row slot, channel, bank,
            burst, lane mask); pay: uint16 [m, 16].

    The check ORs the lane masks of each burst in an open-addressing table keyed by (channel, bank, row slot, burst):
    O(m). (A KV append of a 64-token prompt: ~13 k bursts per layer, one per K burst and one per Vᵀ element; sorting
    their keys took ~0.7 ms of each layer's 0.9 ms append, sorting every element's key, 16x as many, ~2 ms.)
    """
    m = ch.size
    nb = mem_t.shape[3]
    ns = mem_t.shape[1]
    bursts = mem_t.shape[2] // _LANES
    bits = 6
    while (1 << bits) < 2 * m:  # at most half full
        bits += 1
    size = 1 << bits
    table = np.full(size, -1, np.int64)  # burst key, or -1: empty
    seen = np.zeros(size, np.int64)  # lanes of that burst written so far
    for t in range(m):
        key = ((ch[t] * nb + bank[t]) * ns + slots[t]) * bursts + col[t]
        h = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits))  # Fibonacci hashing
        while table[h] != -1 and table[h] != key:
            h = (h + 1) & (size - 1)
        msk = imm[t] & ((1 << _LANES) - 1)
        if table[h] == -1:
            table[h] = key
        elif seen[h] & msk:
            return False
        seen[h] |= msk
    for t in range(m):
        for ln in range(_LANES):
            if (imm[t] >> ln) & 1:
                mem_t[ch[t], slots[t], col[t] * _LANES + ln, bank[t]] = pay[t, ln]
    return True


scatter_sbk = njit(cache=True, nogil=True)(_scatter_sbk_py) if AVAILABLE else None
