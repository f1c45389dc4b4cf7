"""Timing of the in-device elementwise ops (EWMUL / EWADD / AF; ``docs/isa.md`` "Elementwise ops").

One ``EW`` command per instruction and channel (all banks at once): it takes a command-bus
cycle, waits until both accumulators' MACs are out of the pipeline (``nMACLAT`` after the
last MAC / EW on them) or their WRACC landed (``nCWLREG``), and its result is ready ``nEW``
cycles later (a later RDACC, MAC or EW of the accumulator waits for it). No row, no bus burst.
"""

from __future__ import annotations

from nhil.timing.commands import ALL, EW


def schedule_ew(eng, s, p, idx: int, chans) -> int:
    """Schedule one EW command group ``p`` (``p.k`` written, ``p.col`` read) on channel state ``s``; returns its completion cycle."""
    T = eng.t
    k, j = p.k, p.col
    t0 = max(s.floor, s.acc_mac[k] + T.nMACLAT, s.acc_mac[j] + T.nMACLAT, s.acc_w[k] + T.nCWLREG, s.acc_w[j] + T.nCWLREG, s.acc_r[k] + 1)
    t = eng._slot(s, t0)
    eng._emit(s, t, EW, ALL, -1, j, k, idx, chans)
    s.acc_mac[k] = t + T.nEW - T.nMACLAT  # an RDACC / EW waits nMACLAT after this: the result
    s.acc_w[k] = t + T.nEW - T.nCWLREG  # a MAC accumulating onto k waits for the result
    s.acc_r[j] = max(s.acc_r[j], t)  # a WRACC of the operand waits until it was read
    return t + T.nEW
