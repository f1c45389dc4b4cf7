"""Compiled inner loops of the simulator's fast path (``nhil.targets.sim.fast``).

Two kernels: the multi-vector MAC of the prefill extension (``MAC_ABV``, :func:`mac_bf16_vec`: each weight
burst read once, MAC'd into every vector's accumulator with the same arithmetic), and the bf16 MAC (``MAC_AB``/``MAC_SB`` with CFR ``W_FMT`` = 0) of
``docs/numerics.md`` section "MAC", written as a loop that numba compiles:

* weights are read straight from the bank state (uint16 bf16 bits, widened in a register:
  ``bits << 16``), so no decoded copy of a row is materialised per MAC;
* per slot and burst: the 16 lane products ``fp32(w_i * a_i)``, the fixed pairwise tree
  ``((p0+p1)+(p2+p3))+...`` (4 levels), then ``acc = fp32(acc + dot16)`` bursts in order;
* a NaN accumulator is stored as the canonical ``0x7FC00000``.

Every operation is one IEEE-754 binary32 operation with round-to-nearest-even, in the
contract's order, with no ``fastmath`` flag (no reassociation, no FMA contraction, no
flush to zero), so the result is bit-identical to ``nhil.numerics.mac.mac_bursts``
(``tests/test_sim_fast.py`` checks it on random data, special values and whole models).

``AVAILABLE`` is False when numba is missing; the fast path then runs these MACs through
the reference numpy code (``PimState.step``).
"""

from __future__ import annotations

import numpy as np

try:  # numba is a core dependency (pyproject); a missing one only costs speed
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

AVAILABLE = njit is not None


def _mac_bf16_py(mem, gb, acc, c0, c1, b0, b1, s, k, col, n):  # pragma: no cover - compiled by numba
    """In place: ``acc[c, b, k]`` for c in [c0, c1), b in [b0, b1) absorbs bursts [col, col+n) of row slot ``s``.

    Args:
        mem: uint16 [channels, banks, row slots, cols] bank state (bf16 bits).
        gb: uint16 [channels, gb_elems] global buffer (bf16 bits).
        acc: float32 [channels, banks, accumulators], updated in place.
        c0, c1, b0, b1: channel and bank ranges; s: row slot (-1: a row never written, reads as zero);
        k: accumulator; col, n: first burst and burst count (16 lanes per burst).
    """
    wbuf = np.empty(16, np.uint32)
    wf = wbuf.view(np.float32)
    abuf = np.empty(16 * n, np.uint32)
    af = abuf.view(np.float32)
    nanbuf = np.empty(1, np.uint32)
    nanbuf[0] = 0x7FC00000
    cnan = nanbuf.view(np.float32)[0]
    e0 = col * 16
    for c in range(c0, c1):
        for i in range(16 * n):
            abuf[i] = np.uint32(gb[c, e0 + i]) << 16
        for b in range(b0, b1):
            x = acc[c, b, k]
            for j in range(n):
                o = e0 + j * 16
                if s >= 0:
                    for i in range(16):
                        wbuf[i] = np.uint32(mem[c, b, s, o + i]) << 16
                else:
                    for i in range(16):
                        wbuf[i] = 0
                q = j * 16
                p0 = wf[0] * af[q]
                p1 = wf[1] * af[q + 1]
                p2 = wf[2] * af[q + 2]
                p3 = wf[3] * af[q + 3]
                p4 = wf[4] * af[q + 4]
                p5 = wf[5] * af[q + 5]
                p6 = wf[6] * af[q + 6]
                p7 = wf[7] * af[q + 7]
                p8 = wf[8] * af[q + 8]
                p9 = wf[9] * af[q + 9]
                p10 = wf[10] * af[q + 10]
                p11 = wf[11] * af[q + 11]
                p12 = wf[12] * af[q + 12]
                p13 = wf[13] * af[q + 13]
                p14 = wf[14] * af[q + 14]
                p15 = wf[15] * af[q + 15]
                d = (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15)))
                x = x + d
            if x != x:
                x = cnan
            acc[c, b, k] = x


mac_bf16 = njit(cache=True, nogil=True)(_mac_bf16_py) if AVAILABLE else None


def _mac_bf16_vec_py(mem, gbs, accs, c0, c1, s, k, col, n, nv):  # pragma: no cover - compiled by numba
    """In place, MAC_ABV: for c in [c0, c1), every bank b, j < nv: ``accs[j, c, b, k]`` absorbs bursts [col, col+n)
    of row slot ``s`` against the same bursts of global buffer ``gbs[j, c]`` (the arithmetic of :func:`_mac_bf16_py` per set).

    The activations are laid out lane-major (``a[(burst*16 + lane)*nv + vector]``) so the innermost loop runs
    over the vectors with unit stride: each vector's products and tree are its own (the same IEEE operations
    in the same order), so LLVM may run several vectors per SIMD instruction without changing a bit.

    Args:
        mem: uint16 [channels, banks, row slots, cols]; gbs: uint16 [sets, channels, gb_elems];
        accs: float32 [sets, channels, banks, accumulators], updated in place;
        s: row slot (-1: a row never written, reads as zero); nv: vectors (sets) served.
    """
    nb = mem.shape[1]
    wbuf = np.empty(16, np.uint32)
    wf = wbuf.view(np.float32)
    abuf = np.empty(16 * n * nv, np.uint32)
    af = abuf.view(np.float32)
    xs = np.empty(nv, np.float32)
    nanbuf = np.empty(1, np.uint32)
    nanbuf[0] = 0x7FC00000
    cnan = nanbuf.view(np.float32)[0]
    e0 = col * 16
    for c in range(c0, c1):
        for v in range(nv):
            for i in range(16 * n):
                abuf[i * nv + v] = np.uint32(gbs[v, c, e0 + i]) << 16
        for b in range(nb):
            for v in range(nv):
                xs[v] = accs[v, c, b, k]
            for j in range(n):
                o = e0 + j * 16
                if s >= 0:
                    for i in range(16):
                        wbuf[i] = np.uint32(mem[c, b, s, o + i]) << 16
                else:
                    for i in range(16):
                        wbuf[i] = 0
                w0, w1, w2, w3, w4, w5, w6, w7 = wf[0], wf[1], wf[2], wf[3], wf[4], wf[5], wf[6], wf[7]
                w8, w9, w10, w11, w12, w13, w14, w15 = wf[8], wf[9], wf[10], wf[11], wf[12], wf[13], wf[14], wf[15]
                q = j * 16 * nv
                for v in range(nv):
                    r = q + v
                    p0 = w0 * af[r]
                    p1 = w1 * af[r + nv]
                    p2 = w2 * af[r + 2 * nv]
                    p3 = w3 * af[r + 3 * nv]
                    p4 = w4 * af[r + 4 * nv]
                    p5 = w5 * af[r + 5 * nv]
                    p6 = w6 * af[r + 6 * nv]
                    p7 = w7 * af[r + 7 * nv]
                    p8 = w8 * af[r + 8 * nv]
                    p9 = w9 * af[r + 9 * nv]
                    p10 = w10 * af[r + 10 * nv]
                    p11 = w11 * af[r + 11 * nv]
                    p12 = w12 * af[r + 12 * nv]
                    p13 = w13 * af[r + 13 * nv]
                    p14 = w14 * af[r + 14 * nv]
                    p15 = w15 * af[r + 15 * nv]
                    d = (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15)))
                    xs[v] = xs[v] + d
            for v in range(nv):
                x = xs[v]
                if x != x:
                    x = cnan
                accs[v, c, b, k] = x


mac_bf16_vec = njit(cache=True, nogil=True)(_mac_bf16_vec_py) if AVAILABLE else None
