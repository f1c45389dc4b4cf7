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

    The check sorts the m burst keys and ORs the lane masks of equal ones (a KV append of a 64-token prompt: ~1.5 k
    bursts per layer; sorting every element's key instead, 16x as many, took ~2 ms of each layer's append).
    """
    m = ch.size
    nb = mem_t.shape[3]
    ns = mem_t.shape[1]
    bursts = mem_t.shape[2] // _LANES
    keys = np.empty(m, np.int64)  # one key per burst: two writes can meet only in the same burst of the same row
    for t in range(m):
        keys[t] = ((ch[t] * nb + bank[t]) * ns + slots[t]) * bursts + col[t]
    order = np.argsort(keys)
    seen = np.int64(0)  # lanes of the current burst written so far
    for i in range(m):
        t = order[i]
        if i == 0 or keys[t] != keys[order[i - 1]]:
            seen = 0
        msk = imm[t] & ((1 << _LANES) - 1)
        if seen & msk:
            return False
        seen |= msk
    for t in range(m):
        for ln in range(_LANES):
            if (imm[t] >> ln) & 1:
                mem_t[ch[t], slots[t], col[t] * _LANES + ln, bank[t]] = pay[t, ln]
    return True


scatter_sbk = njit(cache=True, nogil=True)(_scatter_sbk_py) if AVAILABLE else None
