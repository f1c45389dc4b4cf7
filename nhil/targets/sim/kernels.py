"""Compiled inner loops of the simulator's fast path (``nhil.targets.sim.fast``).

Two kernels: the bf16 MAC (``MAC_AB``/``MAC_SB`` with CFR ``W_FMT`` = 0, :func:`mac_bf16`) of
``docs/numerics.md`` section "MAC", and the multi-vector MAC of the prefill extension (``MAC_ABV``,
:func:`mac_bf16_vec`: each weight burst read once, MAC'd into every vector's accumulator with the same
arithmetic), written as loops that numba compiles:

* weights are read straight from the bank state in its bank-minor storage (``PimState.mem_t``: uint16
  ``[channels, slots, cols, banks]``), widened in a register (``bits << 16``); no decoded copy of a row is
  kept;
* the banks of a channel are the SIMD axis: for one burst, lane ``i`` of every bank is one contiguous
  vector, so the 16 lane products ``fp32(w_i * a_i)``, the fixed pairwise tree ``((p0+p1)+(p2+p3))+...``
  (4 levels) and ``acc = fp32(acc + dot16)`` (bursts in order) run for all banks at once, each bank's
  arithmetic its own;
* a NaN accumulator is stored as the canonical ``0x7FC00000``.

Every operation is one IEEE-754 binary32 operation with round-to-nearest-even, in the contract's order,
with no ``fastmath`` flag (no reassociation, no FMA contraction, no flush to zero): vectorising across
banks changes no operation of any one bank, so the result is bit-identical to
``nhil.numerics.mac.mac_bursts`` (``tests/test_sim_fast.py`` checks it on random data, special values
and whole models).

:func:`gemv_run` executes a whole run of GEMV instructions (``WR_GB``/``WR_ACC``/MACs/``RD_ACC``) in one call,
a span of channels per call, so that threads can share the channels: a decode GEMV streams every bank row once,
so it is bound by memory bandwidth, which one core does not saturate (SmolLM2 decode step, 2 cores: 96 -> 61 ms
of MAC time with two threads).

``AVAILABLE`` is False when numba is missing; the fast path then runs these MACs through the reference
numpy code (``PimState.step``).
"""

from __future__ import annotations

import math

import numpy as np

try:  # numba is a core dependency (pyproject); a missing one only costs speed
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

AVAILABLE = njit is not None

_LANES = 16  # MAC lanes per bank = bf16 elements per burst (DeviceConfig.lanes of every preset)
_BANKS = 16  # banks per channel of every preset: the SIMD width of the all-bank path


def _canonical_py(x):  # pragma: no cover - compiled by numba
    """``x`` (float32), with any NaN replaced by the canonical quiet NaN ``0x7FC00000``."""
    if x != x:
        return np.uint32(0x7FC00000).view(np.float32)
    return x


_canonical = njit(inline="always")(_canonical_py) if AVAILABLE else None


def _mac_bf16_py(mem_t, gb, acc, c0, c1, b0, b1, s, k, col, n):  # pragma: no cover - compiled by numba
    """In place: ``acc[c, b, k]`` for c in [c0, c1), b in [b0, b1) absorbs bursts [col, col+n) of row slot ``s``.

    Args:
        mem_t: uint16 [channels, row slots, cols, banks] bank state, bank-minor (bf16 bits).
        gb: uint16 [channels, gb_elems] global buffer (bf16 bits).
        acc: float32 [channels, banks, accumulators], updated in place.
        c0, c1, b0, b1: channel and bank ranges; s: row slot (-1: a row never written, reads as zero);
        k: accumulator; col, n: first burst and burst count (16 lanes per burst).
    """
    nb = mem_t.shape[3]
    abuf = np.empty(_LANES * n, np.uint32)
    af = abuf.view(np.float32)
    e0 = col * _LANES
    if b0 == 0 and b1 == _BANKS and nb == _BANKS:
        wbuf = np.zeros(_LANES * _BANKS, np.uint32)  # one burst of every bank, widened: [lane * 16 + bank]
        w = wbuf.view(np.float32)
        x = np.empty(_BANKS, np.float32)
        for c in range(c0, c1):
            for i in range(_LANES * n):
                abuf[i] = np.uint32(gb[c, e0 + i]) << 16
            for b in range(_BANKS):
                x[b] = acc[c, b, k]
            row = mem_t[c, max(s, 0)].ravel()
            for j in range(n):
                if s >= 0:
                    o = (e0 + j * _LANES) * _BANKS
                    wu = row[o : o + _LANES * _BANKS]
                    for t in range(_LANES * _BANKS):
                        wbuf[t] = np.uint32(wu[t]) << 16
                a = af[j * _LANES : j * _LANES + _LANES]
                a0, a1, a2, a3, a4, a5, a6, a7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
                a8, a9, a10, a11, a12, a13, a14, a15 = a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]
                for b in range(_BANKS):
                    p0 = w[b] * a0
                    p1 = w[16 + b] * a1
                    p2 = w[32 + b] * a2
                    p3 = w[48 + b] * a3
                    p4 = w[64 + b] * a4
                    p5 = w[80 + b] * a5
                    p6 = w[96 + b] * a6
                    p7 = w[112 + b] * a7
                    p8 = w[128 + b] * a8
                    p9 = w[144 + b] * a9
                    p10 = w[160 + b] * a10
                    p11 = w[176 + b] * a11
                    p12 = w[192 + b] * a12
                    p13 = w[208 + b] * a13
                    p14 = w[224 + b] * a14
                    p15 = w[240 + b] * a15
                    d = (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15)))
                    x[b] = x[b] + d
            for b in range(_BANKS):
                acc[c, b, k] = _canonical(x[b])
        return
    # any other bank range (MAC_SB, devices of another bank count): one bank at a time, same arithmetic
    wl = np.zeros(_LANES, np.uint32)
    wf = wl.view(np.float32)
    for c in range(c0, c1):
        for i in range(_LANES * n):
            abuf[i] = np.uint32(gb[c, e0 + i]) << 16
        for b in range(b0, b1):
            y = acc[c, b, k]
            for j in range(n):
                q = j * _LANES
                if s >= 0:
                    for i in range(_LANES):
                        wl[i] = np.uint32(mem_t[c, s, e0 + q + i, b]) << 16
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
                y = y + d
            acc[c, b, k] = _canonical(y)


mac_bf16 = njit(cache=True, nogil=True)(_mac_bf16_py) if AVAILABLE else None
_mac_bf16 = mac_bf16  # the compiled kernel that mac_bf16_vec and gemv_run call (a test may replace the module's mac_bf16)


def _mac_bf16_vec_py(mem_t, gbs, accs, c0, c1, s, k, col, n, nv):  # pragma: no cover - compiled by numba
    """In place, MAC_ABV: for c in [c0, c1), every bank b, j < nv: ``accs[j, c, b, k]`` absorbs bursts [col, col+n)
    of row slot ``s`` against the same bursts of global buffer ``gbs[j, c]`` (the arithmetic of :func:`_mac_bf16_py`
    per set): each burst of every bank is widened once and serves every vector.

    Args:
        mem_t: uint16 [channels, row slots, cols, banks] (bank-minor); gbs: uint16 [sets, channels, gb_elems];
        accs: float32 [sets, channels, banks, accumulators], updated in place;
        s: row slot (-1: a row never written, reads as zero); nv: vectors (sets) served.
    """
    nb = mem_t.shape[3]
    if nb != _BANKS:  # a device of another bank count: set by set through the per-bank path
        for v in range(nv):
            _mac_bf16(mem_t, gbs[v], accs[v], c0, c1, 0, nb, s, k, col, n)
        return
    wbuf = np.zeros(_LANES * _BANKS, np.uint32)
    w = wbuf.view(np.float32)
    abuf = np.empty((nv, _LANES * n), np.uint32)
    af = abuf.view(np.float32)
    xs = np.empty((nv, _BANKS), np.float32)
    e0 = col * _LANES
    for c in range(c0, c1):
        for v in range(nv):
            for i in range(_LANES * n):
                abuf[v, i] = np.uint32(gbs[v, c, e0 + i]) << 16
            for b in range(_BANKS):
                xs[v, b] = accs[v, c, b, k]
        row = mem_t[c, max(s, 0)].ravel()
        for j in range(n):
            if s >= 0:
                o = (e0 + j * _LANES) * _BANKS
                wu = row[o : o + _LANES * _BANKS]
                for t in range(_LANES * _BANKS):
                    wbuf[t] = np.uint32(wu[t]) << 16
            for v in range(nv):
                a = af[v, j * _LANES : j * _LANES + _LANES]
                x = xs[v]
                a0, a1, a2, a3, a4, a5, a6, a7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
                a8, a9, a10, a11, a12, a13, a14, a15 = a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]
                for b in range(_BANKS):
                    p0 = w[b] * a0
                    p1 = w[16 + b] * a1
                    p2 = w[32 + b] * a2
                    p3 = w[48 + b] * a3
                    p4 = w[64 + b] * a4
                    p5 = w[80 + b] * a5
                    p6 = w[96 + b] * a6
                    p7 = w[112 + b] * a7
                    p8 = w[128 + b] * a8
                    p9 = w[144 + b] * a9
                    p10 = w[160 + b] * a10
                    p11 = w[176 + b] * a11
                    p12 = w[192 + b] * a12
                    p13 = w[208 + b] * a13
                    p14 = w[224 + b] * a14
                    p15 = w[240 + b] * a15
                    d = (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15)))
                    x[b] = x[b] + d
        for v in range(nv):
            for b in range(_BANKS):
                accs[v, c, b, k] = _canonical(xs[v, b])


mac_bf16_vec = njit(cache=True, nogil=True)(_mac_bf16_vec_py) if AVAILABLE else None
_mac_bf16_vec = mac_bf16_vec  # the compiled kernel gemv_run calls (a test may replace the module's mac_bf16_vec)


def threads() -> int:
    """Threads :func:`gemv_run` shares the channels among: ``NHIL_SIM_THREADS`` if set, else ``OMP_NUM_THREADS``
    if set (the per-process budget a scheduler gives, e.g. Ray's workers or ``nhil landscape``'s rows), else 1 inside
    a pytest-xdist worker (its siblings hold the other cores), else one per core.

    The count changes only the speed: every channel's arithmetic is the same on any thread. (The threads are
    Python threads that block while they wait: numba's OpenMP ``prange`` threads spin instead, and on a 2-core
    machine with any other load that made a SmolLM2 decode step 1.2 s instead of 0.21 s.)

    Raises:
        SetupError: ``NHIL_SIM_THREADS`` is not a positive integer.
    """
    import os

    from nhil.errors import SetupError
    from nhil.util import positive_int_env, sim_threads_setting

    try:
        n = sim_threads_setting()
    except ValueError as e:
        raise SetupError(str(e)) from None
    if n is not None:
        return n
    try:
        n = positive_int_env("OMP_NUM_THREADS", "threads per process")
    except ValueError:
        n = None  # another program's variable: a malformed one is not nhil's to refuse
    if n is not None:
        return n
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return os.cpu_count() or 1


# columns of the GEMV-run table (FastPimState._gemv_table)
G_CODE, G_C0, G_C1, G_B0, G_B1, G_ROW, G_K, G_COL, G_N, G_SET, G_PAY, G_OUT = range(12)
G_WR_GB, G_WR_ACC, G_MAC, G_RD_ACC, G_MAC_V = 0, 1, 2, 3, 4  # G_MAC_V: MAC_ABV, vectors in G_SET


def _zero_row_mac_is_noop_py(gb, acc, c, b0, b1, k, col, n):  # pragma: no cover - compiled by numba
    """True when MACing bursts [col, col+n) of an all-``+0`` row into ``acc[c, b0:b1, k]`` leaves every accumulator's
    bits as they are, so the MAC may be skipped.

    Why (IEEE-754 binary32, RNE): with ``w = +0`` and a finite activation ``a``, ``w * a`` is ``±0``; a sum of signed
    zeros is ``±0``; ``acc + ±0`` is ``acc`` for every ``acc`` other than ``-0`` (``-0 + +0 = +0``) and NaN (which the
    MAC would store as the canonical NaN, changing a non-canonical one). So: every activation of the span finite
    (bf16 exponent not all ones) and no accumulator ``-0`` or NaN. Otherwise the MAC runs (False).

    Args:
        gb: uint16 [channels, gb_elems]; acc: float32 [channels, banks, accumulators]; the rest as :func:`_mac_bf16_py`.
    """
    for i in range(col * _LANES, (col + n) * _LANES):
        if (gb[c, i] & np.uint16(0x7F80)) == np.uint16(0x7F80):
            return False
    for b in range(b0, b1):
        x = acc[c, b, k]
        if x != x or (x == 0.0 and math.copysign(1.0, x) < 0.0):
            return False
    return True


_zero_row_mac_is_noop = njit(inline="always")(_zero_row_mac_is_noop_py) if AVAILABLE else None


def _gemv_run_channel_py(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, bits, values, out, c):  # pragma: no cover - compiled by numba
    """:func:`_gemv_run_py` restricted to channel ``c``: every instruction of the run, in order, on that channel's
    share of it only (a WR_ACC / RD_ACC's elements ``q`` with ``c0 + q // banks == c``). A MAC on a row whose part
    in channel ``c`` is all ``+0`` (``zero_rows[c, slot]``, or a row never written) is skipped where that provably
    changes no bit (:func:`_zero_row_mac_is_noop_py`): the padding rows of a GEMV whose outputs do not fill its last
    tile of channels x banks."""
    nb = accs.shape[2]
    one = np.empty(1, np.float32)
    one_u = one.view(np.uint32)
    for r in range(tab.shape[0]):
        c0 = tab[r, G_C0]
        if c < c0 or c >= tab[r, G_C1]:
            continue
        code = tab[r, G_CODE]
        col = tab[r, G_COL]
        n = tab[r, G_N]
        if code == G_MAC:
            s = row_slot[tab[r, G_ROW]]
            b0 = tab[r, G_B0]
            b1 = tab[r, G_B1]
            k = tab[r, G_K]
            if (s < 0 or zero_rows[c, s]) and _zero_row_mac_is_noop(gbs[0], accs[0], c, b0, b1, k, col, n):
                continue
            _mac_bf16(mem_t, gbs[0], accs[0], c, c + 1, b0, b1, s, k, col, n)
        elif code == G_MAC_V:
            s = row_slot[tab[r, G_ROW]]
            k = tab[r, G_K]
            nv = tab[r, G_SET]
            if s < 0 or zero_rows[c, s]:
                noop = True
                for v in range(nv):
                    if not _zero_row_mac_is_noop(gbs[v], accs[v], c, 0, nb, k, col, n):
                        noop = False
                        break
                if noop:
                    continue
            _mac_bf16_vec(mem_t, gbs, accs, c, c + 1, s, k, col, n, nv)
        elif code == G_WR_GB:
            st = tab[r, G_SET]
            e0 = col * _LANES
            po = tab[r, G_PAY]
            for i in range(n * _LANES):
                gbs[st, c, e0 + i] = bits[po + i]
        else:  # WR_ACC / RD_ACC: elements t with (col + t) // nb == c - c0
            st = tab[r, G_SET]
            k = tab[r, G_K]
            t0 = max(0, (c - c0) * nb - col)
            t1 = min(n, (c - c0 + 1) * nb - col)
            if code == G_WR_ACC:
                po = tab[r, G_PAY]
                for t in range(t0, t1):
                    accs[st, c, (col + t) % nb, k] = values[po + t]
            else:  # G_RD_ACC
                oo = tab[r, G_OUT]
                bf = cfr[c0, 0] == 1
                for t in range(t0, t1):
                    y = accs[st, c, (col + t) % nb, k]
                    if bf:
                        if y != y:
                            one_u[0] = np.uint32(0x7FC00000)
                        else:
                            one[0] = y
                            u = one_u[0]
                            one_u[0] = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)
                        y = one[0]
                    out[oo + t] = y


_gemv_run_channel = njit(cache=True, nogil=True)(_gemv_run_channel_py) if AVAILABLE else None


def _gemv_run_py(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, bits, values, out, c_lo, c_hi):  # pragma: no cover - compiled by numba
    """Execute a run of checked GEMV instructions in order, with ``PimState.step``'s semantics for each.

    Only channels ``[c_lo, c_hi)`` are run, each through the whole run (:func:`_gemv_run_channel_py`): every
    instruction touches only per-channel state (a channel's bank rows, global buffer and accumulators; a readback's
    elements of that channel), so threads that each run a span of channels, each channel in program order, give
    the same bits as one instruction after another over all channels (``tests/test_gemv_runs.py``). The GIL is
    released (``nogil``), so Python threads run spans at once (``FastPimState._gemv_run``).

    Args:
        mem_t: uint16 [channels, slots, cols, banks] bank state; row_slot: int64 [rows] row -> slot (-1: unwritten).
        zero_rows: bool [channels, slots], True where that channel's part of the slot is known to be all ``+0``
            (``FastPimState.zero_rows``; False is always safe: the MAC then runs).
        gbs: uint16 [sets, channels, gb_elems]; accs: float32 [sets, channels, banks, accumulators] (updated in place).
        cfr: int64 [channels, regs]; RD_ACC returns bf16 (RNE, canonical NaN) of the accumulators, as fp32, where
            register 0 of its first channel is 1 (``nhil.numerics.bf16.round_to_bf16``), else fp32.
        tab: int64 [m, 12], one row per instruction (columns ``G_*``): code (``G_WR_GB``, ``G_WR_ACC``,
            ``G_MAC``, ``G_RD_ACC``, ``G_MAC_V`` with the vector count in the set column), channel range, bank range (MAC), row, accumulator k, col, n, set
            (GB / accumulator set), payload offset, readback offset.
        bits: uint16 WR_GB payloads; values: float32 WR_ACC payloads; out: float32 readbacks.
        c_lo, c_hi: the channels to run.
    """
    for c in range(c_lo, c_hi):
        _gemv_run_channel(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, bits, values, out, c)


gemv_run = njit(cache=True, nogil=True)(_gemv_run_py) if AVAILABLE else None


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
