"""GEMV runs (``nhil.runtime.bind_runs.GemvRun`` -> ``kernels.gemv_run``) equal their instructions one by one.

Three references: ``Runner._resolve`` for the binding (field for field, payload bit for bit), the
per-instruction reference path ``SimTarget(reference=True)`` for execution (logits, counters and SYNC
digests), and ``PimState.step`` for the error a bad instruction inside a run raises.
"""

from __future__ import annotations

import numpy as np
import pytest

from nhil.errors import RunError
from nhil.isa import DEVICE_PRESETS
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, Instr, Op
from nhil.numerics.bf16 import f32_to_bf16_bits
from nhil.runtime.bind_runs import GemvRun
from nhil.runtime.executor import Runner
from nhil.targets.base import ReadbackDigest, ResolvedGemvRun, ResolvedInstr
from nhil.targets.sim import SimTarget, kernel_threads, kernels
from nhil.targets.sim.device import PimState
from nhil.targets.sim.fast import FastPimState

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed: GEMV runs need its compiled kernel")

DEV = DEVICE_PRESETS["rtl-tiny"]


@pytest.fixture(scope="module")
def prog():
    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.models import get_model

    import torch

    torch.manual_seed(0)
    gm = raise_graph(export_decode(get_model("llama-tiny").model, 16)[0], "decode").gm
    return lower_decode_graph(gm, DEVICE_PRESETS["aim-like"], model_name="llama-tiny")


def _gemv_runs(r):
    return [it for kind, seg in r.segments if kind == "dev" for it in r._segment_plan(seg)[0] if isinstance(it, GemvRun)]


def test_gemv_run_binding_equals_per_instruction_binding(prog):
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    rng = np.random.default_rng(5)
    for name, buf in r.bufs.items():
        buf[:] = rng.integers(0, 1 << 16, buf.size) if name in r.raw else rng.standard_normal(buf.size)
    runs = _gemv_runs(r)
    ops = {Op(int(o)) for run in runs for o in run.fields[:, 0]}
    assert {Op.WR_GB, Op.WR_ACC, Op.MAC_AB, Op.RD_ACC} <= ops  # every kind took part (the comparison is not vacuous)
    bits: dict = {}
    for run in runs:
        got = run.bind(3, lambda b: r._bits(b, bits), r.bufs).instrs()
        want = [r._resolve(int(i), 3, {}) for i in run.index]
        for g, w in zip(got, want, strict=True):
            assert g.index == w.index and g.instr == w.instr, (g, w)
            if w.payload is None:
                assert g.payload is None
            else:
                assert g.payload.dtype == w.payload.dtype and np.array_equal(g.payload.view(np.uint8), w.payload.view(np.uint8)), g.index


def test_an_all_zero_accumulator_payload_is_shared_only_while_its_buffer_is_all_plus_zero(prog):
    """The accumulator reset (WR_ACC from ZEROS) binds one shared +0 payload; a -0 in the buffer is bound as -0."""
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    runs = [run for run in _gemv_runs(r) if run.acc_buffers == ["zeros"]]
    assert runs  # the programs reset accumulators from ZEROS (the check is not vacuous)
    bits: dict = {}
    first = runs[0].bind(0, lambda b: r._bits(b, bits), r.bufs).values
    assert first.size and not first.view(np.uint32).any()
    assert runs[0].bind(0, lambda b: r._bits(b, bits), r.bufs).values is first  # reused, not gathered again
    r.bufs["zeros"][runs[0].acc_src[0]] = -0.0
    got = runs[0].bind(0, lambda b: r._bits(b, bits), r.bufs).values
    want = r.bufs["zeros"][runs[0].acc_src]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) and got.view(np.uint32)[0] == 0x80000000


def _steps(prog, target, n=5):
    r = Runner(prog, target)
    r.reset()
    out = [r.step((pos * 37 + 3) % 200, pos)["logits"].copy() for pos in range(n)]
    return np.stack(out), target.stats(), target.trace()


def test_a_wrong_gemv_run_kernel_changes_the_logits(prog, monkeypatch):
    """The fast path's GEMV runs carry the model's MACs: a kernel that drops the last burst of one MAC per run is seen."""
    good, stats, _ = _steps(prog, SimTarget())
    ref, ref_stats, _ = _steps(prog, SimTarget(reference=True))
    assert np.array_equal(good.view(np.uint32), ref.view(np.uint32)) and stats == ref_stats
    real = kernels.gemv_run
    used = []

    def mutant(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, rows, ptr, bits, values, out, c_lo, c_hi):
        tab = tab.copy()
        mac = np.flatnonzero((tab[:, kernels.G_CODE] == kernels.G_MAC) & (tab[:, kernels.G_N] > 1))
        if mac.size:
            tab[mac[0], kernels.G_N] -= 1
        used.append(mac.size)
        real(mem_t, row_slot, zero_rows, gbs, accs, cfr, tab, rows, ptr, bits, values, out, c_lo, c_hi)

    monkeypatch.setattr(kernels, "gemv_run", mutant)
    bad, _, _ = _steps(prog, SimTarget())
    assert used and any(used)
    assert not np.array_equal(bad.view(np.uint32), good.view(np.uint32))


def _loaded(ref, dev=DEV):
    from nhil.compiler.builder import ProgramBuilder

    t = SimTarget(device=dev, reference=ref)
    t.load(ProgramBuilder(dev).finish({"inputs": {}, "outputs": {}}, {}))
    return t


class _Plan:
    """Stands for the binding plan a ResolvedGemvRun comes from (the target caches its checks per plan)."""


def _run(items):
    """A ResolvedGemvRun of ``(Instr, payload)`` items (indices from 1)."""
    fields = np.array([tuple(int(x) for x in ins) for ins, _ in items], np.int64)
    offset, bits, values = np.zeros(len(items), np.int64), [], []
    nb = nv = 0
    for j, (ins, p) in enumerate(items):
        if ins.op is Op.WR_GB:
            offset[j] = nb
            bits.append(p)
            nb += p.size
        elif ins.op is Op.WR_ACC:
            offset[j] = nv
            values.append(p)
            nv += p.size
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return ResolvedGemvRun(np.arange(1, len(items) + 1), fields, offset, cat(bits, np.uint16), cat(values, np.float32), _Plan(), DEV.lanes)


# NaN, ±inf, fp32 max (rounds to bf16 inf), ties to even down (0x3F808000) and up (0x3F818000), -0, the smallest
# subnormal, a payload NaN with the sign set (canonical 0x7FC0 in bf16)
SPECIAL = np.array([0x7FC00001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x80000000, 0x00000001, 0xFFC12345],
                   np.uint32).view(np.float32)


def _gemv_items(rng):
    L = DEV.lanes
    w = [(Instr(Op.WR_ABK, 0, row=r, col=0, n=8), f32_to_bf16_bits(rng.standard_normal(8 * L).astype(np.float32))) for r in (2, 3)]
    gemv = [
        (Instr(Op.WR_GB, 0, col=0, n=8), f32_to_bf16_bits(rng.standard_normal(8 * L).astype(np.float32))),
        (Instr(Op.WR_ACC, 0, k=1, col=0, n=16), rng.standard_normal(16).astype(np.float32)),
        (Instr(Op.MAC_AB, 0, row=2, k=1, col=0, n=8), None),
        (Instr(Op.MAC_SB, 0, bank=5, row=3, k=1, col=2, n=3), None),
        (Instr(Op.MAC_AB, 0, row=9, k=2, col=1, n=2), None),  # a row never written reads as zero
        (Instr(Op.RD_ACC, 0, k=1, col=0, n=16), None),
        (Instr(Op.RD_ACC, 0, k=2, col=3, n=5), None),
        (Instr(Op.WR_ACC, 0, k=3, col=2, n=9), SPECIAL),  # read back as written (bf16: RNE ties, overflow, NaN)
        (Instr(Op.RD_ACC, 0, k=3, col=0, n=16), None),
    ]
    return w, gemv


@pytest.mark.parametrize("bf16_readback", [False, True])
def test_a_gemv_run_equals_its_instructions_on_the_reference(bf16_readback):
    """WR_GB, WR_ACC, all-bank and single-bank MACs (one on an unwritten row), RD_ACC in fp32 and bf16 format."""
    rng = np.random.default_rng(11)
    w, gemv = _gemv_items(rng)
    cfr = [ResolvedInstr(0, Instr(Op.SET_CFR, 0, k=CFR_ACC_RD_FMT, imm=int(bf16_readback)), None)]
    got, want = _loaded(False), _loaded(True)
    for t in (got, want):
        t.execute([ResolvedInstr(0, ins, p) for ins, p in w] + cfr)
    a = got.execute([_run(gemv)])
    b = want.execute([ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)])
    assert len(a) == len(b) == 3
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
    if bf16_readback:
        assert all((x.view(np.uint32) & 0xFFFF == 0).all() for x in a)
    assert got.stats() == want.stats() and got.trace() == want.trace()
    assert np.array_equal(got.state.accs.view(np.uint32), want.state.accs.view(np.uint32)) and np.array_equal(got.state.gbs, want.state.gbs)


def test_a_block_mixing_gemv_runs_and_single_readbacks_returns_them_in_program_order():
    """A block of [GEMV run, RD_ACC, GEMV run, SYNC]: the readbacks in instruction order (the first run's readbacks
    come back as one ReadbackRun only while they are the block's only ones), bit for bit the reference's."""
    from nhil.targets.base import ReadbackRun

    rng = np.random.default_rng(3)
    w, gemv = _gemv_items(rng)
    single = Instr(Op.RD_ACC, 0, k=2, col=1, n=7)
    got, want = _loaded(False), _loaded(True)
    for t in (got, want):
        t.execute([ResolvedInstr(0, ins, p) for ins, p in w])
    alone = got.execute([_run(gemv)])
    assert isinstance(alone, ReadbackRun) and len(alone) == 3  # a block of one run: its ReadbackRun as is
    want.execute([ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)])
    a = got.execute([_run(gemv), ResolvedInstr(20, single, None), _run(gemv[:7]), ResolvedInstr(21, Instr(Op.SYNC, 0), None)])
    ref = [ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)] + [ResolvedInstr(20, single, None)]
    ref += [ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv[:7])] + [ResolvedInstr(21, Instr(Op.SYNC, 0), None)]
    b = want.execute(ref)
    assert [x.size for x in a] == [x.size for x in b] == [16, 5, 16, 7, 16, 5]
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b, strict=True))
    # a run then a single readback and no second run: the run's readbacks first
    a = got.execute([_run(gemv), ResolvedInstr(22, single, None)])
    b = want.execute([ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)] + [ResolvedInstr(22, single, None)])
    assert [x.size for x in a] == [16, 5, 16, 7]
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b, strict=True))
    assert got.trace() == want.trace()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_gemv_run_across_channels_equals_its_instructions_on_the_reference(threads, monkeypatch):
    """Threads each run a span of channels through the whole run: all-channel WR_GB (two vector sets), WR_ACC and
    RD_ACC spans that start and end inside a channel, MAC_AB / MAC_ABV over every channel and a single-channel
    MAC_SB, against the per-instruction reference, with 1, 2 and 3 kernel threads (``NHIL_SIM_THREADS``)."""
    import dataclasses

    from nhil.targets.sim import fast

    monkeypatch.setenv("NHIL_SIM_THREADS", str(threads))
    monkeypatch.setattr(fast, "THREADED_MIN_MACS", 0)  # this small run too is split among the threads

    dev = dataclasses.replace(DEV, channels=5, vectors=2)
    rng = np.random.default_rng(5)
    L, nb, nch = dev.lanes, dev.banks, dev.channels
    rnd = lambda n: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    w = [(Instr(Op.WR_ABK, ALL_CH, row=r, col=0, n=8), f32_to_bf16_bits(rnd(8 * L))) for r in (2, 3)]
    gemv = [
        (Instr(Op.WR_GB, ALL_CH, col=0, n=8), f32_to_bf16_bits(rnd(8 * L))),
        (Instr(Op.WR_GB, ALL_CH, bank=1, col=0, n=8), f32_to_bf16_bits(rnd(8 * L))),
        (Instr(Op.WR_ACC, ALL_CH, k=1, col=13, n=2 * nb + 7), rnd(2 * nb + 7)),  # channels 0..3, partly
        (Instr(Op.MAC_AB, ALL_CH, row=2, k=1, col=1, n=6), None),
        (Instr(Op.MAC_SB, 3, bank=7, row=3, k=1, col=0, n=4), None),
        (Instr(Op.MAC_ABV, ALL_CH, row=3, k=2, col=2, n=5, imm=2), None),
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=5, n=nch * nb - 9), None),
        (Instr(Op.RD_ACC, ALL_CH, bank=1, k=2, col=0, n=nch * nb), None),
        (Instr(Op.RD_ACC, 2, k=1, col=3, n=nb - 3), None),
    ]
    got, want = _loaded(False, dev), _loaded(True, dev)
    for t in (got, want):
        t.execute([ResolvedInstr(0, ins, p) for ins, p in w])
    a = got.execute([_run(gemv)])
    b = want.execute([ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)])
    assert len(a) == len(b) == 3
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
    assert got.stats() == want.stats()
    assert np.array_equal(got.state.accs.view(np.uint32), want.state.accs.view(np.uint32)) and np.array_equal(got.state.gbs, want.state.gbs)


def _zero_row_case(dev, rng, acc_special, gb_special):
    """Rows 2 (channel 1 all +0, the rest random) and 3 (channel 0 all +0), loaded as bank images, and a run of
    MAC_AB and MAC_ABV on them after WR_ACC / WR_GB payloads that hold the given special values in channel 0 / 1."""
    import dataclasses

    from nhil.isa.program import BankImage

    L, nb, nch = dev.lanes, dev.banks, dev.channels
    rnd = lambda n: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    imgs = []
    for row, zc in ((2, 1), (3, 0)):
        data = f32_to_bf16_bits(rnd(nch * nb * dev.cols)).reshape(nch, nb, dev.cols)
        data[zc] = 0
        imgs.append(BankImage(row, data))
    acc0 = rnd(nch * nb)
    acc0[: acc_special.size] = acc_special
    acc0[nb : nb + acc_special.size] = acc_special
    gb0 = f32_to_bf16_bits(rnd(8 * L))
    gb0[: gb_special.size] = gb_special
    gemv = [
        (Instr(Op.WR_GB, ALL_CH, col=0, n=8), gb0),
        (Instr(Op.WR_GB, ALL_CH, bank=1, col=0, n=8), gb0[::-1].copy()),
        (Instr(Op.WR_ACC, ALL_CH, k=1, col=0, n=nch * nb), acc0),
        (Instr(Op.WR_ACC, ALL_CH, bank=1, k=2, col=0, n=nch * nb), acc0[::-1].copy()),
        (Instr(Op.MAC_AB, ALL_CH, row=2, k=1, col=0, n=8), None),
        (Instr(Op.MAC_ABV, ALL_CH, row=3, k=2, col=0, n=8, imm=2), None),
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=0, n=nch * nb), None),
        (Instr(Op.RD_ACC, ALL_CH, k=2, col=0, n=nch * nb), None),
        (Instr(Op.RD_ACC, ALL_CH, bank=1, k=2, col=0, n=nch * nb), None),
    ]
    return imgs, gemv


@pytest.mark.parametrize("case", ["finite", "minus-zero-acc", "nan-acc", "inf-activation", "nan-activation", "written-after-load"])
def test_a_mac_on_an_all_zero_row_part_equals_the_reference(case):
    """The fast path skips a GEMV run's MAC where a channel's part of the row is all +0 (the padding of a GEMV whose
    outputs do not fill the last tile) only where that changes no bit: a -0 accumulator becomes +0, a non-canonical
    NaN accumulator the canonical NaN, and an inf or NaN activation makes the accumulator NaN, exactly as the
    reference MAC. After a write into such a row the row is MAC'd again (its zero mark is dropped)."""
    import dataclasses

    dev = dataclasses.replace(DEV, channels=3, vectors=2)
    rng = np.random.default_rng(7)
    f32 = lambda *u: np.array(u, np.uint32).view(np.float32)  # noqa: E731
    acc_special = {"minus-zero-acc": f32(0x80000000, 0x80000000), "nan-acc": f32(0x7FC00001, 0xFFC12345)}.get(case, f32())
    gb_special = {"inf-activation": np.array([0xFF80], np.uint16), "nan-activation": np.array([0x7FC1], np.uint16)}.get(case, np.zeros(0, np.uint16))
    imgs, gemv = _zero_row_case(dev, rng, acc_special, gb_special)
    got, want = _loaded(False, dev), _loaded(True, dev)
    for t in (got, want):
        t.state.load_images(imgs)
    assert got.state.zero_rows[:, got.state.row_slot[[2, 3]]].tolist() == [[False, True], [True, False], [False, False]]
    if case == "written-after-load":  # a nonzero word into channel 1 of row 2 and channel 0 of row 3
        row = f32_to_bf16_bits(rng.standard_normal(dev.cols).astype(np.float32))
        burst = f32_to_bf16_bits(rng.standard_normal(dev.lanes).astype(np.float32))
        for t in (got, want):
            t.write_row(1, 4, 2, row)
            t.execute([ResolvedInstr(0, Instr(Op.WR_SBK, 0, bank=9, row=3, col=2, imm=0xFFFF), burst)])
        assert not got.state.zero_rows[:, got.state.row_slot[[2, 3]]].any()
    a = got.execute([_run(gemv)])
    b = want.execute([ResolvedInstr(i + 1, ins, p) for i, (ins, p) in enumerate(gemv)])
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), (case, x.view(np.uint32)[:20], y.view(np.uint32)[:20])
    assert np.array_equal(got.state.accs.view(np.uint32), want.state.accs.view(np.uint32))
    assert got.stats() == want.stats()


def test_a_bad_thread_count_is_a_setup_error_naming_the_variable(monkeypatch):
    from nhil.errors import SetupError

    monkeypatch.setenv("NHIL_SIM_THREADS", "two")
    with pytest.raises(SetupError, match="NHIL_SIM_THREADS='two'"):
        _loaded(False)  # the simulator state reads it when the program is loaded
    monkeypatch.setenv("NHIL_SIM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert kernel_threads.threads() == 3  # nhil's own variable wins over the scheduler's budget
    monkeypatch.delenv("NHIL_SIM_THREADS")
    assert kernel_threads.threads() == 1


def test_a_bad_instruction_in_a_gemv_run_raises_the_reference_error():
    _, gemv = _gemv_items(np.random.default_rng(2))
    gemv[3] = (Instr(Op.MAC_SB, ALL_CH, bank=DEV.banks, row=3, n=1), None)
    with pytest.raises(RunError) as fast:
        FastPimState(DEV).run_block([_run(gemv)], ReadbackDigest())
    ref = PimState(DEV)
    with pytest.raises(RunError) as want:
        for i, (ins, p) in enumerate(gemv):
            ref.step(i + 1, ins, p)
    assert str(fast.value) == str(want.value) and "instruction 4 (MAC_SB)" in str(want.value)


def test_kernel_spans_cover_every_channel_once_and_a_span_error_is_raised_after_all_finish():
    from nhil.targets.sim.kernel_threads import spans_at_once

    seen = []

    def kernel(tag, c_lo, c_hi):
        seen.append((tag, c_lo, c_hi))
        if tag == "bad" and c_lo > 0:
            raise ValueError(f"span {c_lo}..{c_hi}")

    spans_at_once(kernel, ("ok",), 5, 3)
    assert sorted(seen) == [("ok", 0, 1), ("ok", 1, 3), ("ok", 3, 5)]
    seen.clear()
    with pytest.raises(ValueError, match="span"):
        spans_at_once(kernel, ("bad",), 5, 2)
    assert sorted(seen) == [("bad", 0, 2), ("bad", 2, 5)]
    seen.clear()
    spans_at_once(kernel, ("again",), 4, 2)  # the threads are free again after an error
    assert sorted(seen) == [("again", 0, 2), ("again", 2, 4)]


def test_channel_rows_skip_only_accumulator_rows_without_an_element_of_the_channel():
    """``fast._channel_rows``: a channel visits every WR_GB / MAC row whose channel range holds it, and a WR_ACC / RD_ACC
    row only when one of its elements ``q`` in ``[col, col + n)`` lies in it (channel ``c0 + q // banks``, the kernel's
    mapping). Reference: element by element, on random rows."""
    from nhil.targets.sim import kernels as K
    from nhil.targets.sim.fast import _channel_rows

    rng = np.random.default_rng(5)
    channels, banks = 8, 16
    tab = np.zeros((200, 12), np.int64)
    for r in range(200):
        code = int(rng.choice([K.G_WR_GB, K.G_WR_ACC, K.G_MAC, K.G_RD_ACC, K.G_MAC_V]))
        c0 = int(rng.integers(0, channels))
        c1 = int(rng.integers(c0 + 1, channels + 1))
        col = int(rng.integers(0, (c1 - c0) * banks))
        n = int(rng.integers(0, (c1 - c0) * banks - col + 1))
        tab[r, [K.G_CODE, K.G_C0, K.G_C1, K.G_COL, K.G_N]] = code, c0, c1, col, n
    rows, ptr = _channel_rows(tab, channels, banks)
    for c in range(channels):
        want = []
        for r, (code, c0, c1, col, n) in enumerate(tab[:, [K.G_CODE, K.G_C0, K.G_C1, K.G_COL, K.G_N]].tolist()):
            if code in (K.G_WR_ACC, K.G_RD_ACC):
                if any(c0 + q // banks == c for q in range(col, col + n)):
                    want.append(r)
            elif c0 <= c < c1:
                want.append(r)
        assert rows[ptr[c]:ptr[c + 1]].tolist() == want, c
