"""LLVM IR intrinsics of the simulator's MAC kernels (``nhil.targets.sim.kernels``), written where numba's own
loop code does not reach the machine's arithmetic rate.

Three intrinsics, each usable only inside a numba-compiled function:

* :func:`prefetch` ``(a, i0, i1, i2, i3)``: a cache hint for ``a[i0, i1, i2, i3]``;
* :func:`widen_gb` ``(abuf, gbs, c, e0, n, nv)``: a channel's bf16 activations of every vector to fp32 bits;
* :func:`mac_rows16` ``(mem_t, c, s, e0, n, abuf, astride, xs, nv)``: the core of ``MAC_ABV`` on one channel of
  16 banks (``docs/isa.md`` "Prefill extension", arithmetic of ``docs/numerics.md`` "MAC").

Why IR for ``mac_rows16``: for every burst, the 16 lane vectors of the channel's 16 banks (one ``<16 x float>``
per lane, bank ``b`` in element ``b``) are widened once and then held in registers while every token vector's
16 activations are broadcast against them. Numba's loops reload those 16 vectors from memory for every token
vector (LLVM cannot prove that the accumulator stores do not alias them) and widen the weights with scalar
code: 15 GMAC/s on one Emerald Rapids core, against 25-28 GMAC/s for this code (a microbenchmark of 16 vectors x
36 bursts per channel on L2-resident rows; a C loop with intrinsics reached 32). In SmolLM2's 64-token prefill, same
machine, alternating runs: 10.0-10.6x -> 6.2-7.9x eager (``make bench``'s prefill row).

The arithmetic is the contract's and nothing else: each product is one ``fmul`` of two ``float`` values (bf16
bits ``<< 16``), the 16 products of a burst are summed by ``fadd`` in the fixed pairwise tree
``((p0+p1)+(p2+p3))+...`` and the sum is added to the accumulator, bursts in order. IR ``fmul``/``fadd`` carry
no fast-math flags, so LLVM may neither reassociate nor contract them into FMAs, and IEEE-754 binary32
round-to-nearest-even with subnormals is what every x86-64 (and AArch64) vector unit computes for them: the
bits equal ``nhil.numerics.mac.mac_bursts``' (``tests/test_sim_fast.py``). The vector width is LLVM's to choose
per machine (one zmm with AVX-512, two ymm with AVX2); a lane's arithmetic does not depend on it.

Cache note: numba's on-disk cache of a function that uses these intrinsics is keyed by the source file of
that function only (``kernels.py``), not by this file; ``kernels.py`` therefore holds ``SIMD_STAMP``, the
sha256 of this file, and turns its cache off when the stamp is stale (``tests/test_sim_fast.py`` checks the
stamp, so a commit that edits this file updates the stamp, which edits ``kernels.py`` and so invalidates it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

def source_sha256() -> str:
    """The sha256 (hex) of this file's bytes: what ``kernels.SIMD_STAMP`` must equal for numba's cache to be used."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


_LANES = 16  # bf16 elements per burst = lane vectors per burst
_BANKS = 16  # banks per channel = elements of one lane vector
_PREFETCH_BURSTS = 8  # bursts ahead that mac_rows16 hints into the cache (8 x 512 B = 4 KiB, one page)


def _prefetch_hint(builder, ptr) -> None:
    """Emit ``llvm.prefetch`` (read, keep in all cache levels, data) of ``ptr``, declared once per module as taking an
    ``i8*`` whatever ``ptr`` points to (one declaration serves every caller in a module)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _prefetch_codegen(context, builder, signature, args):  # pragma: no cover - runs inside numba's compiler
    aty = signature.args[0]
    ary = context.make_array(aty)(context, builder, args[0])
    idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
    ptr = cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False, boundscheck=False)
    _prefetch_hint(builder, ptr)
    return context.get_dummy_value()


@intrinsic
def prefetch(typingctx, arr, i0, i1, i2, i3):
    """``prefetch(a, i0, i1, i2, i3)``: a hint that ``a[i0, i1, i2, i3]`` (a 4-d array) will be read soon (LLVM's
    ``llvm.prefetch``: no value, no fault, no effect on any result; an address past the array is only a wasted hint).

    Why: a MAC streams one bank row per channel, 18-32 KiB at a time, from rows that lie ``slots x 32 KiB`` apart; the
    hardware prefetcher starts over at every 4 KiB page, so a single thread read SmolLM2's rows at ~6 GB/s and with
    the hint at ~9-10 GB/s (cold 256 MB microbenchmark, one thread)."""
    if not isinstance(arr, types.Array) or arr.ndim != 4:
        return None
    return types.void(arr, i0, i1, i2, i3), _prefetch_codegen


def _widen_gb_codegen(context, builder, signature, args):  # pragma: no cover - runs inside numba's compiler
    aty, gty = signature.args[0], signature.args[1]
    abuf = context.make_array(aty)(context, builder, args[0])
    gbs = context.make_array(gty)(context, builder, args[1])
    c, e0, n, nv = (context.cast(builder, v, t, types.intp) for v, t in zip(args[2:], signature.args[2:]))
    intp = context.get_value_type(types.intp)
    i16, i32 = ir.IntType(16), ir.IntType(32)
    v16h, v16i = ir.VectorType(i16, _LANES), ir.VectorType(i32, _LANES)
    shift = ir.Constant(v16i, [16] * _LANES)
    astride = builder.extract_value(abuf.shape, 1)
    a0 = builder.bitcast(abuf.data, i32.as_pointer())
    with cgutils.for_range(builder, nv) as vl:
        v = vl.index
        src = cgutils.get_item_pointer(context, builder, gty, gbs, [v, c, e0], wraparound=False, boundscheck=False)
        dst = builder.gep(a0, [builder.mul(v, astride)])
        with cgutils.for_range(builder, n) as jl:
            o = builder.mul(jl.index, ir.Constant(intp, _LANES))
            h = builder.load(builder.bitcast(builder.gep(src, [o]), v16h.as_pointer()), align=2)
            builder.store(builder.shl(builder.zext(h, v16i), shift), builder.bitcast(builder.gep(dst, [o]), v16i.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def widen_gb(typingctx, abuf, gbs, c, e0, n, nv):
    """In place, inside numba code: ``abuf[v, 16 j + i] = gbs[v, c, e0 + 16 j + i] << 16`` for v < nv, j < n, i < 16:
    the bf16 activations of bursts [e0 / 16, e0 / 16 + n) of every vector, as fp32 bits, one 16-lane vector op per
    burst (numba's loop for it ran scalar, ~1 element per cycle).

    Args (unchecked: the caller guarantees them): abuf: uint32 [>= nv, >= 16 n] C-contiguous; gbs: uint16
    [sets >= nv, channels, gb_elems] C-contiguous, e0 + 16 n <= gb_elems; c: channel.
    """
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (abuf, gbs)):
        return None
    if (abuf.ndim, gbs.ndim) != (2, 3) or abuf.dtype != types.uint32 or gbs.dtype != types.uint16:
        return None
    return types.void(abuf, gbs, c, e0, n, nv), _widen_gb_codegen


def _mac_rows16_codegen(context, builder, signature, args):  # pragma: no cover - runs inside numba's compiler
    mty, _, _, _, _, aty, _, xty, _ = signature.args
    mem = context.make_array(mty)(context, builder, args[0])
    c, s, e0, n = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:5], signature.args[1:5]))
    abuf = context.make_array(aty)(context, builder, args[5])
    astride = context.cast(builder, args[6], signature.args[6], types.intp)
    xs = context.make_array(xty)(context, builder, args[7])
    nv = context.cast(builder, args[8], signature.args[8], types.intp)
    intp = context.get_value_type(types.intp)
    f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
    v16f, v16h, v16i = ir.VectorType(f32, _BANKS), ir.VectorType(i16, _BANKS), ir.VectorType(i32, _BANKS)
    zero = ir.Constant(intp, 0)
    # first element of the span: mem_t[c, s, e0, 0]; the span is contiguous (C layout: [cols, banks] rows of a slot)
    row = cgutils.get_item_pointer(context, builder, mty, mem, [c, s, e0, zero], wraparound=False, boundscheck=False)
    a0 = builder.bitcast(abuf.data, f32.as_pointer())  # widened activations: fp32 [sets, astride]
    x0 = builder.bitcast(xs.data, f32.as_pointer())  # accumulators: fp32 [sets, 16], C layout
    shift = ir.Constant(v16i, [16] * _BANKS)
    zeros_mask = ir.Constant(ir.VectorType(i32, _BANKS), [0] * _BANKS)
    undef = ir.Constant(v16f, ir.Undefined)
    with cgutils.for_range(builder, n) as jl:
        j = jl.index
        base = builder.mul(j, ir.Constant(intp, _LANES * _BANKS))
        w = []
        for i in range(_LANES):  # lane i of the burst, all 16 banks: bf16 bits -> fp32 (bits << 16)
            p = builder.gep(row, [builder.add(base, ir.Constant(intp, i * _BANKS))])
            h = builder.load(builder.bitcast(p, v16h.as_pointer()), align=2)
            w.append(builder.bitcast(builder.shl(builder.zext(h, v16i), shift), v16f))
        # hint the burst _PREFETCH_BURSTS ahead into the cache (8 lines of 64 B); past the span's end: a wasted hint
        ahead = builder.add(base, ir.Constant(intp, _PREFETCH_BURSTS * _LANES * _BANKS))
        for line in range(_LANES * _BANKS * 2 // 64):
            p = builder.gep(row, [builder.add(ahead, ir.Constant(intp, line * 32))])
            _prefetch_hint(builder, p)
        off = builder.mul(j, ir.Constant(intp, _LANES))
        with cgutils.for_range(builder, nv) as vl:
            v = vl.index
            ap = builder.gep(a0, [builder.add(builder.mul(v, astride), off)])
            prods = []
            for i in range(_LANES):
                a = builder.load(builder.gep(ap, [ir.Constant(intp, i)]), align=4)
                av = builder.shuffle_vector(builder.insert_element(undef, a, ir.Constant(i32, 0)), undef, zeros_mask)
                prods.append(builder.fmul(w[i], av))
            while len(prods) > 1:  # the fixed pairwise tree: ((p0+p1)+(p2+p3))+... (docs/numerics.md "MAC")
                prods = [builder.fadd(prods[t], prods[t + 1]) for t in range(0, len(prods), 2)]
            xp = builder.bitcast(builder.gep(x0, [builder.mul(v, ir.Constant(intp, _BANKS))]), v16f.as_pointer())
            builder.store(builder.fadd(builder.load(xp, align=4), prods[0]), xp, align=4)
    return context.get_dummy_value()


@intrinsic
def mac_rows16(typingctx, mem_t, c, s, e0, n, abuf, astride, xs, nv):
    """In place, inside numba code: ``xs[v, b] = fp32(xs[v, b] + dot16_j(v, b))`` for bursts j in [0, n) in order, every
    bank b < 16 and token vector v < nv, where ``dot16_j(v, b)`` is the pairwise tree of the 16 products
    ``fp32(bf16(mem_t[c, s, e0 + 16 j + i, b]) * abuf_f32[v, 16 j + i])``.

    Args (unchecked: the caller guarantees them):
        mem_t: uint16 [channels, slots, cols, 16] C-contiguous (bank state, bank-minor); c, s: channel and row slot
            (s >= 0: a written row); e0: first element (16 x first burst); n: bursts, e0 + 16 n <= cols.
        abuf: uint32 [>= nv, astride] C-contiguous, the activations as fp32 bits (bf16 bits << 16), element 16 j + i of
            row v the one burst j lane i meets; astride: its row length in elements.
        xs: float32 [>= nv, 16] C-contiguous accumulators, updated in place (no NaN canonicalisation: the caller's).
        nv: token vectors.
    """
    arrs = (mem_t, abuf, xs)
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrs):
        return None
    if (mem_t.ndim, abuf.ndim, xs.ndim) != (4, 2, 2) or mem_t.dtype != types.uint16 or abuf.dtype != types.uint32 or xs.dtype != types.float32:
        return None
    return types.void(mem_t, c, s, e0, n, abuf, astride, xs, nv), _mac_rows16_codegen
