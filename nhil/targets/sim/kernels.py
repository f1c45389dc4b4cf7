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

Inside a run, each channel visits only its own rows of the table (``fast._channel_rows``, built once per plan), the
MAC cores take scratch allocated once per call (no allocation per MAC), the single-vector core widens each
weight in a register as it multiplies (no stored copy of the burst), and a WR_ACC / RD_ACC addresses its bank without
an integer modulo per element. Element loops run over slices from index 0 (:func:`_copy_py`: numba's negative-index
fix-up of ``a[e0 + i]`` kept them scalar), and the single-vector core prefetches the bursts it reads next, across the
4 KiB pages where the hardware prefetcher stops (``simd.prefetch``). SmolLM2 decode, same process: the GEMV runs
40 -> 25 ms per token; 64-token prefill 1.31 -> 0.79 s. The multi-vector core's bursts run in LLVM IR written by hand
(``simd.mac_rows16``: each burst of the 16 banks widened once and held in registers for every vector; 15 -> 25 GMAC/s
per core on L2-resident rows, same bits), its activations widened by ``simd.widen_gb`` (numba's loop for it ran scalar).

Tried for that core and not kept (Emerald Rapids, one thread, 16 banks x 36 bursts x 64 vectors; each bit-identical to
this core on random normal bf16 data, not checked on special values): the first tree level as
``fma(w0, a0, w1 * a1)`` (equal to ``(w0 * a0) + (w1 * a1)`` whenever the bf16 x bf16 product is exact, i.e. no
overflow and no subnormal product): 26.2 vs 26.3 GMAC/s; the first level as
``VDPBF16PS`` on an accumulator of ``-0`` (equal in the range where it neither flushes subnormals nor overflows):
17.3 vs 23.3 GMAC/s (it issued at a quarter of ``vaddps``'s rate there: 1.33 vs 5.66 G/s).
The core issues its 32 FP operations per burst and vector at ~58% of the machine's measured ``vaddps`` rate (3.3 of
5.7 G/s), and a quarter fewer of them bought nothing, so their count is not what bounds it.

Why one file: numba's on-disk cache (``cache=True``) is keyed by the source file of the cached function only, and
:func:`gemv_run` compiles the MAC cores into itself; were the cores in another module, an edit there would leave
``gemv_run``'s cached machine code stale. The IR intrinsics of ``simd`` are the one exception, guarded by
``SIMD_STAMP`` (that file's sha256, checked by a test; a stale stamp turns the cache off). Everything else of the fast path's kernels lives outside (threads:
``kernel_threads``; the WR_SBK scatter: ``wr_sbk``; the per-channel table rows: ``fast``).

``AVAILABLE`` is False when numba is missing; the fast path then runs these MACs through the reference
numpy code (``PimState.step``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

try:  # numba is a core dependency (pyproject); a missing one only costs speed
    from numba import njit
except ImportError:  # pragma: no cover - exercised only without numba
    njit = None

AVAILABLE = njit is not None

# sha256 of simd.py, whose IR the cached kernels below compile in: numba keys their cache by this file only, so an
# edit of simd.py must change this line (tests/test_sim_fast.py checks it); a stale stamp turns the cache off.
SIMD_STAMP = "9a87041ff73687bf0c92cb1fd7975d0326177db8ed504e4bb6a23b883ad00e67"
_CACHE = False  # numba's on-disk cache for the kernels of this file: on while SIMD_STAMP is current
if AVAILABLE:
    from nhil.targets.sim import simd

    _prefetch, _mac_rows16, _widen_gb = simd.prefetch, simd.mac_rows16, simd.widen_gb
    _CACHE = simd.source_sha256() == SIMD_STAMP
    if not _CACHE:
        warnings.warn(f"nhil.targets.sim.kernels: SIMD_STAMP is not the sha256 of {simd.__file__}; the MAC kernels compile "
                      f"without numba's disk cache until it is set to {simd.source_sha256()!r}", stacklevel=1)

_LANES = 16  # MAC lanes per bank = bf16 elements per burst (DeviceConfig.lanes of every preset)
_BANKS = 16  # banks per channel of every preset: the SIMD width of the all-bank path


def _canonical_py(x):  # pragma: no cover - compiled by numba
    """``x`` (float32), with any NaN replaced by the canonical quiet NaN ``0x7FC00000``."""
    if x != x:
        return np.uint32(0x7FC00000).view(np.float32)
    return x


_canonical = njit(inline="always")(_canonical_py) if AVAILABLE else None


def _bf16_py(u):  # pragma: no cover - compiled by numba
    """The fp32 value of bf16 bits ``u`` (uint16): the bits widened in a register (``u << 16``), reinterpreted."""
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)


_bf16 = njit(inline="always")(_bf16_py) if AVAILABLE else None


def _dot16_py(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15):  # pragma: no cover - compiled by numba
    """The fixed pairwise tree of a burst's 16 lane products (``docs/numerics.md`` "MAC"): 4 levels of fp32 adds,
    ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))`` and so on, each one IEEE-754 binary32 RNE add, in this order."""
    return (((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))) + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15)))


_dot16 = njit(inline="always")(_dot16_py) if AVAILABLE else None


def _copy_py(dst, src):  # pragma: no cover - compiled by numba
    """``dst[:] = src`` (1-d, same length), as a loop over slices: indices that start at 0 need no negative-index
    fix-up, so LLVM vectorises it (``a[e0 + i]`` with an ``e0`` of unknown sign kept it scalar: ~1.2 ns/element)."""
    for i in range(dst.size):
        dst[i] = src[i]


_copy = njit(inline="always")(_copy_py) if AVAILABLE else None


def _widen_py(dst, src):  # pragma: no cover - compiled by numba
    """``dst[i] = src[i] << 16``: bf16 bits (uint16, 1-d) to fp32 bits (uint32, 1-d, same length); see :func:`_copy_py`."""
    for i in range(dst.size):
        dst[i] = np.uint32(src[i]) << np.uint32(16)


_widen = njit(inline="always")(_widen_py) if AVAILABLE else None

_PREFETCH_BURSTS = 8  # bursts ahead of the MAC that the single-vector core asks the cache for (8 x 512 B = 4 KiB: one page)
_LINE_ELEMS = 32  # uint16 elements of mem_t per 64-byte cache line (a burst of 16 banks: 8 lines)


def _mac_all_banks_py(mem_t, gb, acc, c, s, k, col, n, x, s2, col2):  # pragma: no cover - compiled by numba
    """In place: ``acc[c, b, k]`` for every bank b of channel ``c`` absorbs bursts [col, col+n) of row slot ``s``.

    The single-vector MAC of every bank at once (banks are the SIMD axis): each weight is read from the bank
    state and widened in a register as it is multiplied (no widened copy of the row is stored), each activation
    once per burst.

    Args:
        mem_t: uint16 [channels, row slots, cols, 16 banks]; gb: uint16 [channels, gb_elems]; acc: float32
            [channels, 16 banks, accumulators]; s: row slot (-1: a row never written, reads as +0);
        x: float32 [16] scratch (the channel's 16 accumulators while they absorb the bursts);
        s2, col2: the row slot and first burst of the channel's next MAC (s2 -1: none), whose first bursts are
            prefetched while this MAC's last ones run (a hint only: it changes no result).
    """
    e0 = col * _LANES
    ss = max(s, 0)
    z = np.float32(0.0)
    for b in range(_BANKS):
        x[b] = acc[c, b, k]
    for j in range(n):
        q = e0 + j * _LANES
        a0, a1, a2, a3 = _bf16(gb[c, q]), _bf16(gb[c, q + 1]), _bf16(gb[c, q + 2]), _bf16(gb[c, q + 3])
        a4, a5, a6, a7 = _bf16(gb[c, q + 4]), _bf16(gb[c, q + 5]), _bf16(gb[c, q + 6]), _bf16(gb[c, q + 7])
        a8, a9, a10, a11 = _bf16(gb[c, q + 8]), _bf16(gb[c, q + 9]), _bf16(gb[c, q + 10]), _bf16(gb[c, q + 11])
        a12, a13, a14, a15 = _bf16(gb[c, q + 12]), _bf16(gb[c, q + 13]), _bf16(gb[c, q + 14]), _bf16(gb[c, q + 15])
        if s >= 0 and j + _PREFETCH_BURSTS < n:  # the burst _PREFETCH_BURSTS ahead, within this MAC's bursts only
            for line in range(_LANES * _BANKS // _LINE_ELEMS):
                _prefetch(mem_t, c, ss, q + _PREFETCH_BURSTS * _LANES + line * (_LINE_ELEMS // _BANKS), 0)
        elif s2 >= 0:  # else the next MAC's burst as far ahead (it may lie past that MAC's bursts: a wasted hint)
            q2 = (col2 + j + _PREFETCH_BURSTS - n) * _LANES
            for line in range(_LANES * _BANKS // _LINE_ELEMS):
                _prefetch(mem_t, c, s2, q2 + line * (_LINE_ELEMS // _BANKS), 0)
        if s < 0:  # a row never written: every weight +0 (0 * a is still computed: inf or NaN activations give NaN)
            for b in range(_BANKS):
                d = _dot16(z * a0, z * a1, z * a2, z * a3, z * a4, z * a5, z * a6, z * a7,
                           z * a8, z * a9, z * a10, z * a11, z * a12, z * a13, z * a14, z * a15)
                x[b] = x[b] + d
            continue
        for b in range(_BANKS):
            d = _dot16(
                _bf16(mem_t[c, ss, q, b]) * a0, _bf16(mem_t[c, ss, q + 1, b]) * a1, _bf16(mem_t[c, ss, q + 2, b]) * a2, _bf16(mem_t[c, ss, q + 3, b]) * a3,
                _bf16(mem_t[c, ss, q + 4, b]) * a4, _bf16(mem_t[c, ss, q + 5, b]) * a5, _bf16(mem_t[c, ss, q + 6, b]) * a6, _bf16(mem_t[c, ss, q + 7, b]) * a7,
                _bf16(mem_t[c, ss, q + 8, b]) * a8, _bf16(mem_t[c, ss, q + 9, b]) * a9, _bf16(mem_t[c, ss, q + 10, b]) * a10, _bf16(mem_t[c, ss, q + 11, b]) * a11,
                _bf16(mem_t[c, ss, q + 12, b]) * a12, _bf16(mem_t[c, ss, q + 13, b]) * a13, _bf16(mem_t[c, ss, q + 14, b]) * a14, _bf16(mem_t[c, ss, q + 15, b]) * a15,
            )
            x[b] = x[b] + d
    for b in range(_BANKS):
        acc[c, b, k] = _canonical(x[b])


_mac_all_banks = njit(nogil=True)(_mac_all_banks_py) if AVAILABLE else None


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
    if b0 == 0 and b1 == _BANKS and nb == _BANKS:  # MAC_AB: every bank of each channel at once
        x = np.empty(_BANKS, np.float32)
        for c in range(c0, c1):
            _mac_all_banks(mem_t, gb, acc, c, s, k, col, n, x, -1, 0)
        return
    # any other bank range (MAC_SB, devices of another bank count): one bank at a time, same arithmetic
    abuf = np.empty(_LANES * n, np.uint32)
    af = abuf.view(np.float32)
    e0 = col * _LANES
    wl = np.zeros(_LANES, np.uint32)
    wf = wl.view(np.float32)
    for c in range(c0, c1):
        _widen(abuf, gb[c, e0 : e0 + _LANES * n])
        for b in range(b0, b1):
            y = acc[c, b, k]
            for j in range(n):
                q = j * _LANES
                if s >= 0:
                    for i in range(_LANES):
                        wl[i] = np.uint32(mem_t[c, s, e0 + q + i, b]) << 16
                d = _dot16(
                    wf[0] * af[q], wf[1] * af[q + 1], wf[2] * af[q + 2], wf[3] * af[q + 3],
                    wf[4] * af[q + 4], wf[5] * af[q + 5], wf[6] * af[q + 6], wf[7] * af[q + 7],
                    wf[8] * af[q + 8], wf[9] * af[q + 9], wf[10] * af[q + 10], wf[11] * af[q + 11],
                    wf[12] * af[q + 12], wf[13] * af[q + 13], wf[14] * af[q + 14], wf[15] * af[q + 15],
                )
                y = y + d
            acc[c, b, k] = _canonical(y)


mac_bf16 = njit(cache=_CACHE, nogil=True)(_mac_bf16_py) if AVAILABLE else None
_mac_bf16 = mac_bf16  # the compiled kernel that mac_bf16_vec and gemv_run call (a test may replace the module's mac_bf16)


def _mac_vec_channel_py(mem_t, gbs, accs, c, s, k, col, n, nv, abuf, xs):  # pragma: no cover - compiled by numba
    """In place, MAC_ABV on channel ``c`` (16 banks): ``accs[j, c, b, k]`` for j < nv absorbs bursts [col, col+n) of row
    slot ``s`` against the same bursts of ``gbs[j, c]``. Each vector's activations are widened once per call (into
    ``abuf``); the bursts run in :func:`simd.mac_rows16 <nhil.targets.sim.simd.mac_rows16>`, which widens each burst
    of the 16 banks once and holds it in registers for every vector.

    Args:
        mem_t: uint16 [channels, row slots, cols, 16 banks] (C layout); gbs: uint16 [sets, channels, gb_elems]; accs:
            float32 [sets, channels, 16 banks, accumulators]; s: row slot (-1: a row never written, reads as +0);
        abuf: uint32 [>= nv, >= 16 n] and xs: float32 [>= nv, 16] scratch, both C layout.
    """
    af = abuf.view(np.float32)
    e0 = col * _LANES
    _widen_gb(abuf, gbs, c, e0, n, nv)
    for v in range(nv):
        for b in range(_BANKS):
            xs[v, b] = accs[v, c, b, k]
    if s >= 0:
        _mac_rows16(mem_t, c, s, e0, n, abuf, abuf.shape[1], xs, nv)
    else:  # a row never written: every weight +0 (0 * a is still computed: inf or NaN activations give NaN)
        z = np.float32(0.0)
        for j in range(n):
            o = j * _LANES
            for v in range(nv):
                d = _dot16(z * af[v, o], z * af[v, o + 1], z * af[v, o + 2], z * af[v, o + 3],
                           z * af[v, o + 4], z * af[v, o + 5], z * af[v, o + 6], z * af[v, o + 7],
                           z * af[v, o + 8], z * af[v, o + 9], z * af[v, o + 10], z * af[v, o + 11],
                           z * af[v, o + 12], z * af[v, o + 13], z * af[v, o + 14], z * af[v, o + 15])
                for b in range(_BANKS):
                    xs[v, b] = xs[v, b] + d
    for v in range(nv):
        for b in range(_BANKS):
            accs[v, c, b, k] = _canonical(xs[v, b])


_mac_vec_channel = njit(nogil=True)(_mac_vec_channel_py) if AVAILABLE else None


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
    abuf = np.empty((nv, _LANES * n), np.uint32)
    xs = np.empty((nv, _BANKS), np.float32)
    for c in range(c0, c1):
        _mac_vec_channel(mem_t, gbs, accs, c, s, k, col, n, nv, abuf, xs)


mac_bf16_vec = njit(cache=_CACHE, nogil=True)(_mac_bf16_vec_py) if AVAILABLE else None
_mac_bf16_vec = mac_bf16_vec  # the compiled kernel gemv_run calls (a test may replace the module's mac_bf16_vec)




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


def _gemv_run_channel_py(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, rows, ptr, bits, values, out, c, x, abuf, xs):  # pragma: no cover - compiled by numba
    """:func:`_gemv_run_py` restricted to channel ``c``: every instruction of the run, in order, on that channel's
    share of it only (a WR_ACC / RD_ACC's elements ``q`` with ``c0 + q // banks == c``). A MAC on a row whose part
    in channel ``c`` is all ``+0`` (``zero_rows[c, slot]``, or a row never written) is skipped where that provably
    changes no bit (:func:`_zero_row_mac_is_noop_py`): the padding rows of a GEMV whose outputs do not fill its last
    tile of channels x banks. ``x``, ``abuf``, ``xs``: the MAC cores' scratch (:func:`_gemv_run_py`)."""
    nb = accs.shape[2]
    all_banks = nb == _BANKS and mem_t.shape[3] == _BANKS
    nxt = ptr[c]  # the channel's next all-bank MAC after ri (whose first bursts a MAC prefetches)
    for ri in range(ptr[c], ptr[c + 1]):
        r = rows[ri]
        c0 = tab[r, G_C0]
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
            if all_banks and b0 == 0 and b1 == _BANKS:
                if nxt <= ri:
                    nxt = ri + 1
                    while nxt < ptr[c + 1] and not (tab[rows[nxt], G_CODE] == G_MAC and tab[rows[nxt], G_B1] - tab[rows[nxt], G_B0] == _BANKS):
                        nxt += 1
                s2, col2 = -1, 0
                if nxt < ptr[c + 1]:
                    s2, col2 = row_slot[tab[rows[nxt], G_ROW]], tab[rows[nxt], G_COL]
                _mac_all_banks(mem_t, gbs[0], accs[0], c, s, k, col, n, x, s2, col2)
            else:
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
            if all_banks:
                _mac_vec_channel(mem_t, gbs, accs, c, s, k, col, n, nv, abuf, xs)
            else:
                _mac_bf16_vec(mem_t, gbs, accs, c, c + 1, s, k, col, n, nv)
        elif code == G_WR_GB:
            st = tab[r, G_SET]
            e0 = col * _LANES
            po = tab[r, G_PAY]
            _copy(gbs[st, c, e0 : e0 + n * _LANES], bits[po : po + n * _LANES])
        else:  # WR_ACC / RD_ACC: elements t with (col + t) // nb == c - c0, in bank col + t - (c - c0) * nb
            st = tab[r, G_SET]
            k = tab[r, G_K]
            bo = col - (c - c0) * nb
            t0 = max(0, -bo)
            t1 = min(n, nb - bo)
            if code == G_WR_ACC:
                po = tab[r, G_PAY]
                for t in range(t0, t1):
                    accs[st, c, t + bo, k] = values[po + t]
            else:  # G_RD_ACC
                oo = tab[r, G_OUT]
                if cfr[c0, 0] == 1:  # bf16 readback: RNE, canonical NaN (nhil.numerics.bf16.round_to_bf16)
                    for t in range(t0, t1):
                        y = accs[st, c, t + bo, k]
                        if y != y:
                            u = np.uint32(0x7FC00000)
                        else:
                            u = np.float32(y).view(np.uint32)
                            u = np.uint32(((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16))
                        out[oo + t] = np.uint32(u).view(np.float32)
                else:
                    for t in range(t0, t1):
                        out[oo + t] = accs[st, c, t + bo, k]



_gemv_run_channel = njit(cache=_CACHE, nogil=True)(_gemv_run_channel_py) if AVAILABLE else None


def _gemv_run_py(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, rows, ptr, bits, values, out, c_lo, c_hi):  # pragma: no cover - compiled by numba
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
        rows, ptr: int64, the table rows of each channel in order (``fast._channel_rows``): channel ``c`` runs
            ``tab[rows[ptr[c]:ptr[c + 1]]]``.
        bits: uint16 WR_GB payloads; values: float32 WR_ACC payloads; out: float32 readbacks.
        c_lo, c_hi: the channels to run.
    """
    x = np.empty(_BANKS, np.float32)  # scratch of the MAC cores, allocated once per call (per thread)
    abuf = np.empty((gbs.shape[0], gbs.shape[2]), np.uint32)
    xs = np.empty((gbs.shape[0], _BANKS), np.float32)
    for c in range(c_lo, c_hi):
        _gemv_run_channel(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, rows, ptr, bits, values, out, c, x, abuf, xs)


gemv_run = njit(cache=_CACHE, nogil=True)(_gemv_run_py) if AVAILABLE else None
