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
    """
    m = ch.size
    nb = mem_t.shape[3]
    ns = mem_t.shape[1]
    cols = mem_t.shape[2]
    keys = np.empty(m * _LANES, np.int64)
    n = 0
    for t in range(m):
        for ln in range(_LANES):
            if (imm[t] >> ln) & 1:
                keys[n] = ((ch[t] * nb + bank[t]) * ns + slots[t]) * cols + col[t] * _LANES + ln
                n += 1
    ks = np.sort(keys[:n])
    for i in range(1, n):
        if ks[i] == ks[i - 1]:
            return False
    for t in range(m):
        for ln in range(_LANES):
            if (imm[t] >> ln) & 1:
                mem_t[ch[t], slots[t], col[t] * _LANES + ln, bank[t]] = pay[t, ln]
    return True


scatter_sbk = njit(cache=True, nogil=True)(_scatter_sbk_py) if AVAILABLE else None
