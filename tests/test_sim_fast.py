"""The simulator's fast path (``nhil.targets.sim.fast``) against its per-instruction reference path, bit for bit.

The reference is ``SimTarget(reference=True)``: every instruction through ``PimState.step``
(numpy, ``nhil.numerics.mac.mac_bursts``), the simulator as it was before the fast path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nhil.errors import RunError
from nhil.isa import DEVICE_PRESETS, Instr, Op
from nhil.isa.instr import ALL_CH
from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from nhil.numerics.mac import mac_bursts
from nhil.runtime.executor import Runner
from nhil.targets.base import ResolvedInstr
from nhil.targets.sim import SimTarget, kernels

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed: the fast path falls back to the reference path")


def _bits(u32: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(u32).view(np.uint32)


def _bank_minor(mem: np.ndarray) -> np.ndarray:
    """uint16 ``[channels, banks, slots, cols]`` -> the kernels' storage order ``[channels, slots, cols, banks]``."""
    return np.ascontiguousarray(mem.transpose(0, 2, 3, 1))


def _special_bf16(rng, shape) -> np.ndarray:
    """bf16 bit patterns: normals over the whole exponent range, subnormals, ±0, ±inf, NaNs."""
    x = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)  # every class, uniformly over bit patterns
    pick = rng.random(shape)
    x[pick < 0.05] = 0x8000  # -0
    x[(pick >= 0.05) & (pick < 0.08)] = 0x0001  # smallest subnormal
    x[(pick >= 0.08) & (pick < 0.09)] = 0x7F80  # +inf
    return x


@pytest.mark.parametrize("special", [False, True])
def test_kernel_equals_mac_bursts_on_random_and_special_values(special):
    rng = np.random.default_rng(7 + special)
    C, B, R, cols, K = 3, 4, 2, 128, 2
    if special:
        mem = _special_bf16(rng, (C, B, R, cols))
        gb = _special_bf16(rng, (C, cols))
        acc = bf16_bits_to_f32(_special_bf16(rng, (C, B, K))).copy()
    else:
        mem = f32_to_bf16_bits(rng.standard_normal((C, B, R, cols)).astype(np.float32) * np.float32(2.0) ** rng.integers(-60, 60, (C, B, R, cols)))
        gb = f32_to_bf16_bits(rng.standard_normal((C, cols)).astype(np.float32))
        acc = rng.standard_normal((C, B, K)).astype(np.float32)
    for c0, c1, b0, b1, s, k, col, n in [(0, 3, 0, 4, 1, 0, 0, 8), (1, 2, 2, 3, 0, 1, 3, 5), (0, 3, 0, 4, -1, 1, 2, 1), (0, 2, 1, 4, 1, 1, 1, 6)]:
        want = acc.copy()
        w = np.zeros((c1 - c0, b1 - b0, n * 16), np.float32) if s < 0 else bf16_bits_to_f32(mem[c0:c1, b0:b1, s, col * 16 : (col + n) * 16])
        a = bf16_bits_to_f32(gb[c0:c1, col * 16 : (col + n) * 16])[:, None, :]
        want[c0:c1, b0:b1, k] = mac_bursts(want[c0:c1, b0:b1, k], w, a)
        got = acc.copy()
        kernels.mac_bf16(_bank_minor(mem), gb, got, c0, c1, b0, b1, s, k, col, n)
        assert np.array_equal(_bits(got), _bits(want))
    if special:
        assert np.isnan(got).any() and (_bits(got)[np.isnan(got)] == 0x7FC00000).all()  # the case exercised NaN canonicalisation


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("nv", [1, 5, 16])
def test_multi_vector_kernel_equals_mac_bursts_per_vector(special, nv):
    """MAC_ABV's core (``mac_bf16_vec``: the hand-written IR of ``simd.mac_rows16`` for 16 banks) == ``mac_bursts`` with
    each vector's activations, bit for bit. The special case mixes every bf16 class in weights and activations, so
    products overflow, underflow to subnormals and to zero: an FMA contraction or a flush to zero changes bits here."""
    rng = np.random.default_rng(11 + special + nv)
    C, B, R, cols, K = 3, 16, 2, 128, 2
    if special:
        mem = _special_bf16(rng, (C, B, R, cols))
        gbs = _special_bf16(rng, (nv, C, cols))
        accs = bf16_bits_to_f32(_special_bf16(rng, (nv, C, B, K))).copy()
    else:
        mem = f32_to_bf16_bits(rng.standard_normal((C, B, R, cols)).astype(np.float32) * np.float32(2.0) ** rng.integers(-60, 60, (C, B, R, cols)))
        gbs = f32_to_bf16_bits(rng.standard_normal((nv, C, cols)).astype(np.float32))
        accs = rng.standard_normal((nv, C, B, K)).astype(np.float32)
    for c0, c1, s, k, col, n in [(0, 3, 1, 0, 0, 8), (1, 2, 0, 1, 3, 5), (0, 3, -1, 1, 2, 1)]:
        want = accs.copy()
        w = np.zeros((c1 - c0, B, n * 16), np.float32) if s < 0 else bf16_bits_to_f32(mem[c0:c1, :, s, col * 16 : (col + n) * 16])
        for v in range(nv):
            a = bf16_bits_to_f32(gbs[v, c0:c1, col * 16 : (col + n) * 16])[:, None, :]
            want[v, c0:c1, :, k] = mac_bursts(want[v, c0:c1, :, k], w, a)
        got = accs.copy()
        kernels.mac_bf16_vec(_bank_minor(mem), gbs, got, c0, c1, s, k, col, n, nv)
        assert np.array_equal(_bits(got), _bits(want)), (c0, s, col, n)
        if special:  # the MAC'd accumulators hold NaNs, each the canonical one (the others keep their payloads)
            t = got[:, c0:c1, :, k]
            assert np.isnan(t).any() and (_bits(t)[np.isnan(t)] == 0x7FC00000).all()


def test_simd_stamp_is_the_sha256_of_simd_py():
    """numba caches ``kernels.py``'s functions keyed by that file alone; the IR they compile in lives in ``simd.py``,
    so ``kernels.SIMD_STAMP`` must be that file's sha256 (else an edit of simd.py would run stale cached code)."""
    from nhil.targets.sim import simd

    assert kernels.SIMD_STAMP == simd.source_sha256(), f"set kernels.SIMD_STAMP = {simd.source_sha256()!r}"
    assert kernels._CACHE


def test_kernel_keeps_the_pairwise_order_hand_case():
    """Products [2^24, 1, 1, 1, 0...] sum to 2^24 + 2 with the tree (2^24 left to right): docs/numerics.md."""
    mem = np.zeros((1, 1, 1, 16), np.uint16)
    mem[0, 0, 0, :4] = f32_to_bf16_bits(np.array([2.0**24, 1, 1, 1], np.float32))
    gb = f32_to_bf16_bits(np.ones((1, 16), np.float32))
    acc = np.zeros((1, 1, 1), np.float32)
    kernels.mac_bf16(_bank_minor(mem), gb, acc, 0, 1, 0, 1, 0, 0, 0, 1)
    assert acc[0, 0, 0] == np.float32(2.0**24 + 2)


def _run_both(prog, steps, tokens=None):
    """Teacher-forced steps on the fast and the reference path: logits, outputs, stats, SYNC digests of each."""
    res = []
    for ref in (False, True):
        r = Runner(prog, SimTarget(reference=ref))
        r.reset()
        outs = []
        for pos in range(steps):
            o = r.step(tokens[pos] if tokens else (pos * 37 + 3) % 200, pos)
            outs.append({k: v.copy() for k, v in o.items()})
        res.append((outs, r.t.stats(), r.t.trace()))
    return res


def _assert_identical(fast, ref):
    assert len(fast[0]) == len(ref[0])
    for a, b in zip(fast[0], ref[0]):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(_bits(a[k]), _bits(b[k])), k
    assert fast[1] == ref[1]  # instruction counts, MACs, rows allocated
    assert fast[2] == ref[2]  # per-SYNC sha256 over every readback


def _compile(name, quant=None, max_len=16):
    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.models import get_model

    torch.manual_seed(0)
    b = get_model(name)
    ep, _ = export_decode(b.model, max_len)
    gm = raise_graph(ep, "decode").gm
    plan = None
    if quant:
        from nhil.compiler.quantize import build_plan

        plan = build_plan(quant, gm, model=b.model)
    return lower_decode_graph(gm, DEVICE_PRESETS["aim-like"], model_name=name, quant=plan)


# llama-tiny plus zoo families covering GQA, sliding window + softcap, LayerNorm/bias, and MoE dispatch
@pytest.mark.parametrize("name", ["llama-tiny", "mistral", "gemma2", "gpt2", "qwen2_moe"])
def test_fast_path_equals_reference_bit_for_bit_on_models(name):
    prog = _compile(name)
    fast, ref = _run_both(prog, 12)  # 12 positions: several K rows / V columns of the cache, sliding windows wrap
    _assert_identical(fast, ref)
    assert fast[1]["instructions"]["MAC_AB"] > 0 and fast[1]["instructions"]["WR_SBK"] > 0


def test_fast_path_equals_reference_with_quantized_weights():
    """Quantized rows go through PimState's decoded-row cache; bf16 attention MACs through the kernel, in one program."""
    prog = _compile("llama-tiny", quant="q4_1:lm_head=bf16,*.down_proj.*=mxfp6")
    fast, ref = _run_both(prog, 6)
    _assert_identical(fast, ref)


def test_fast_path_detects_a_changed_sum_order():
    """The model comparison is sensitive: a kernel that sums the bursts in reverse gives different logits."""
    prog = _compile("llama-tiny")
    good = _run_both(prog, 3)[1]
    orig = kernels.mac_bf16

    def reversed_bursts(mem, gb, acc, c0, c1, b0, b1, s, k, col, n):
        for j in reversed(range(n)):
            orig(mem, gb, acc, c0, c1, b0, b1, s, k, col + j, 1)

    kernels.mac_bf16 = reversed_bursts
    try:
        r = Runner(prog, SimTarget())
        r.reset()
        bad = [r.step((pos * 37 + 3) % 200, pos)["logits"].copy() for pos in range(3)]
    finally:
        kernels.mac_bf16 = orig
    assert not all(np.array_equal(_bits(a["logits"]), _bits(b)) for a, b in zip(good[0], bad))


DEV = DEVICE_PRESETS["rtl-tiny"]


def _loaded(ref):
    from nhil.compiler.builder import ProgramBuilder

    t = SimTarget(device=DEV, reference=ref)
    t.load(ProgramBuilder(DEV).finish({"inputs": {}, "outputs": {}}, {}))
    return t


@pytest.mark.parametrize("ins, msg", [
    (Instr(Op.MAC_AB, ALL_CH, row=256, n=1), "row 256"),
    (Instr(Op.MAC_AB, 0, ch=3, row=0, n=1), "channel 3"),
    (Instr(Op.MAC_SB, ALL_CH, bank=16, row=0, n=1), "bank 16"),
    (Instr(Op.MAC_AB, ALL_CH, row=0, col=7, n=2), "outside the row"),
    (Instr(Op.MAC_AB, ALL_CH, row=0, k=4, n=1), "accumulator 4"),
])
def test_fast_path_bounds_errors_name_the_instruction_as_the_reference(ins, msg):
    for ref in (False, True):
        t = _loaded(ref)
        with pytest.raises(RunError, match=f"instruction 1 \\(MAC_.B\\): .*{msg}"):
            t.execute([ResolvedInstr(0, Instr(Op.NOP), None), ResolvedInstr(1, ins, None)])


def test_wr_sbk_runs_overlapping_and_masked_equal_the_reference():
    """Runs of WR_SBK: distinct targets (one scatter), a repeated target (last write wins: sequential fallback), lane masks."""
    rng = np.random.default_rng(3)
    L = DEV.lanes
    items = [(Instr(Op.WR_SBK, 0, bank=b, row=5, col=c, imm=int(m)), f32_to_bf16_bits(rng.standard_normal(L).astype(np.float32)))
             for b, c, m in [(0, 0, 0xFFFF), (1, 0, 0x00F0), (2, 3, 1), (1, 0, 0x0FF0), (15, 7, 0x8001)]]
    items.append((Instr(Op.MAC_AB, ALL_CH, row=5, n=8), None))
    items.append((Instr(Op.RD_ACC, ALL_CH, n=16), None))
    for split in (len(items) - 2, 3):  # the whole run (with a repeated target) and a run of distinct targets
        outs = []
        for ref in (False, True):
            t = _loaded(ref)
            block = [ResolvedInstr(i, ins, p) for i, (ins, p) in enumerate(items[:split])]
            t.execute(block)
            outs.append((t.execute([ResolvedInstr(i + split, ins, p) for i, (ins, p) in enumerate(items[split:])]), t.read_row(0, 1, 5), t.stats()))
        assert np.array_equal(outs[0][1], outs[1][1]) and outs[0][2] == outs[1][2]
        assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(outs[0][0], outs[1][0]))


def test_wr_sbk_scatter_refuses_only_lanes_written_twice():
    """The scatter's check works per burst: disjoint lane masks on one burst are one scatter (both written), one lane
    written twice refuses the whole run and writes nothing (``step`` then runs it in order). Hand case."""
    from nhil.targets.sim import wr_sbk

    mem = np.zeros((2, 3, 64, 16), np.uint16)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    pay = np.arange(1, 49, dtype=np.uint16).reshape(3, 16)
    # bursts: (ch 1, slot 2, bank 5, burst 1) twice with masks 0x00FF / 0xFF00, and (ch 0, slot 2, bank 5, burst 1) once
    assert wr_sbk.scatter_sbk(mem, i64(2, 2, 2), i64(1, 1, 0), i64(5, 5, 5), i64(1, 1, 1), i64(0x00FF, 0xFF00, 0x0001), pay)
    assert mem[1, 2, 16:24, 5].tolist() == list(range(1, 9)) and mem[1, 2, 24:32, 5].tolist() == list(range(25, 33))
    assert mem[0, 2, 16, 5] == 33 and np.count_nonzero(mem) == 17
    fresh = np.zeros_like(mem)  # lane 8 of the first burst in both masks: refused, nothing written
    assert not wr_sbk.scatter_sbk(fresh, i64(2, 2, 2), i64(1, 0, 1), i64(5, 5, 5), i64(1, 1, 1), i64(0x01FF, 0x0001, 0xFF00), pay)
    assert not fresh.any()


def test_wr_sbk_scatter_equals_element_by_element_writes_on_random_runs():
    """Random runs over a small space of bursts (so that bursts repeat and lanes collide) and long runs of distinct
    bursts (the collision table's probing): the scatter writes exactly what writing each lane in turn writes, and
    refuses (writing nothing) exactly when some element is written twice. Reference: numpy, element by element."""
    from nhil.targets.sim import wr_sbk

    rng = np.random.default_rng(11)
    outcomes = set()
    for trial in range(300):
        small = trial < 250  # short runs over 2 channels x 3 slots x 4 bursts: repeats and collisions
        m = int(rng.integers(1, 40)) if small else int(rng.integers(2000, 5000))
        channels, bursts = (2, 4) if small else (64, 64)
        ch, slot, col = rng.integers(0, channels, m), rng.integers(0, 3, m), rng.integers(0, bursts, m)
        bank = rng.integers(0, 16, m)
        one_lane = np.left_shift(1, rng.integers(0, 16, m))
        imm = np.where(rng.random(m) < 0.7, one_lane, rng.integers(1, 1 << 16, m)).astype(np.int64)
        pay = rng.integers(1, 1 << 16, (m, 16)).astype(np.uint16)
        mem = np.zeros((channels, 3, bursts * 16, 16), np.uint16)
        want, written, twice = mem.copy(), set(), False
        for t in range(m):
            for ln in range(16):
                if imm[t] >> ln & 1:
                    e = (int(ch[t]), int(slot[t]), int(col[t]) * 16 + ln, int(bank[t]))
                    twice |= e in written
                    written.add(e)
                    want[e] = pay[t, ln]
        got = mem.copy()
        ok = wr_sbk.scatter_sbk(got, slot, ch, bank, col, imm, pay)
        assert ok is (not twice), trial
        assert np.array_equal(got, want if ok else mem), trial
        outcomes.add((small, ok))
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}  # every case met
