"""Multi-channel RTL (``rtl_stubs/pim_device.sv``: CHANNELS ``pim_channel`` instances on one command
bus): channel-select decoding and device slots bit-identical to the simulator on hand-made blocks, a
compiled llama-tiny (bf16 and quantized) in lockstep on 2 and 4 channels, and an injected bug in
channel 1 found at that channel's slots. Needs cocotb + Verilator (skipped with the reason otherwise);
each device size is one cached build (~1 min cold for 2 channels, ~2 min for 4)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import RunError, SetupError
from nhil.isa import DEVICE_PRESETS, Instr, Op
from nhil.isa.asm import format_instr
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, CFR_W_FMT
from nhil.numerics.bf16 import f32_to_bf16_bits
from nhil.numerics.formats import FORMATS
from nhil.runtime.executor import Runner
from nhil.targets.base import ResolvedInstr
from nhil.targets.rtl import RtlTarget
from nhil.targets.sim import SimTarget
from test_rtl import Recorder, _same, needs_tools
from test_rtl_formats import _verify_quantized

D2, D4 = DEVICE_PRESETS["rtl-tiny2"], DEVICE_PRESETS["rtl-tiny4"]


@pytest.fixture(scope="module")
def rtl2():
    with RtlTarget(device="rtl-tiny2") as t:
        yield t


def _bf(x):
    return f32_to_bf16_bits(np.asarray(x, np.float32))


def _channel_block(d, rng) -> list[ResolvedInstr]:
    """Per-channel and all-channel forms of every data path: channel c's global buffer, rows and
    accumulators get their own data, so a channel that obeys an instruction meant for another (or
    reads another's slots) changes a readback."""
    L, B, C = d.lanes, d.banks, d.channels
    last = C - 1
    items = [(Instr(Op.WR_ABK, ALL_CH, row=4, col=0, n=2), _bf(rng.normal(size=2 * L)))]
    for c in range(C):  # distinct activations and one distinct row per channel
        items += [(Instr(Op.WR_GB, 0, ch=c, col=0, n=2), _bf(rng.normal(size=2 * L) * (c + 1))),
                  (Instr(Op.WR_SBK, 0, ch=c, bank=(3 * c) % B, row=4, col=1, imm=0xFFFF), _bf(rng.normal(size=L) * 5))]
    items += [
        (Instr(Op.MAC_AB, ALL_CH, row=4, col=0, n=2, k=0), None),  # every channel's banks at once
        (Instr(Op.MAC_AB, 0, ch=last, row=4, col=0, n=2, k=1), None),  # the last channel only
        (Instr(Op.MAC_SB, 0, ch=1, bank=5, row=4, col=1, n=1, k=1), None),
        (Instr(Op.RD_ACC, ALL_CH, k=0, col=0, n=d.slots), None),  # device slots, channel order
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=B - 3, n=B + 1), None),  # straddles channel 0 | 1 in mid-beat
        (Instr(Op.RD_ACC, 0, ch=last, k=1, col=2, n=B - 2), None),  # one channel's own slots
        (Instr(Op.WR_ACC, ALL_CH, k=2, col=B - 5, n=9), rng.normal(size=9).astype(np.float32)),
        (Instr(Op.WR_ACC, 0, ch=1, k=3, col=1, n=7), rng.normal(size=7).astype(np.float32)),
        (Instr(Op.RD_ACC, ALL_CH, k=2, col=0, n=d.slots), None),
        (Instr(Op.RD_ACC, ALL_CH, k=3, col=0, n=d.slots), None),
        (Instr(Op.COPY_BK_GB, 0, ch=1, bank=3, row=4, col=0, n=2), None),  # channel 1's GB only
        (Instr(Op.COPY_GB_BK, ALL_CH, bank=9, row=6, col=0, n=2), None),
        (Instr(Op.SYNC), None),
    ]
    items += [(Instr(Op.RD_SBK, 0, ch=c, bank=9, row=6, col=0, n=2), None) for c in range(C)]
    items += [(Instr(Op.RD_SBK, 0, ch=c, bank=(3 * c) % B, row=4, col=0, n=2), None) for c in range(C)]
    items += [
        (Instr(Op.SET_CFR, 0, ch=1, k=CFR_ACC_RD_FMT, imm=1), None),  # bf16 readback on channel 1 only
        (Instr(Op.RD_ACC, 0, ch=1, k=0, col=0, n=B), None),
        (Instr(Op.RD_ACC, 0, ch=0, k=0, col=0, n=B), None),
        (Instr(Op.SET_CFR, ALL_CH, k=CFR_ACC_RD_FMT, imm=1), None),
        (Instr(Op.RD_ACC, ALL_CH, k=0, col=0, n=d.slots), None),
        (Instr(Op.SET_CFR, ALL_CH, k=CFR_ACC_RD_FMT, imm=0), None),
        (Instr(Op.SYNC), None),
        (Instr(Op.EOC), None),
    ]
    return [ResolvedInstr(i, ins, p) for i, (ins, p) in enumerate(items)]


def _check_block(d, rtl):
    block = _channel_block(d, np.random.default_rng(d.channels))
    prog = ProgramBuilder(d).finish({"inputs": {}, "outputs": {}}, {})
    sim = SimTarget(device=d)
    sim.load(prog)
    rtl.load(prog)
    a, b = sim.execute(block), rtl.execute(block)
    outs = [r for r in block if r.instr.op in (Op.RD_ACC, Op.RD_SBK)]
    assert len(a) == len(b) == len(outs)
    for r, x, y in zip(outs, a, b):
        assert _same(x, y), f"instruction {r.index} ({format_instr(r.instr)}): sim {x!r} rtl {y!r}"
    assert sim.trace() == rtl.trace()
    # the data really differs per channel (else the check above could not see a wrong channel)
    full = a[[r.instr for r in outs].index(block[[r.instr.op for r in block].index(Op.RD_ACC)].instr)]
    assert len({full[c * d.banks : (c + 1) * d.banks].tobytes() for c in range(d.channels)}) == d.channels
    assert rtl.stats()["macs"] == sim.stats()["macs"]
    # rows written and read back per channel through the command port
    data = np.arange(d.cols, dtype=np.uint16) * 7
    for t in (sim, rtl):
        t.write_row(d.channels - 1, 2, 100, data)
    assert _same(rtl.read_row(d.channels - 1, 2, 100), data) and _same(rtl.read_row(0, 2, 100), sim.read_row(0, 2, 100))


@pytest.mark.rtl
@needs_tools
def test_channel_select_and_device_slots_on_two_channels_match_the_simulator(rtl2):
    _check_block(D2, rtl2)


@pytest.mark.rtl
@pytest.mark.slow
@needs_tools
def test_channel_select_and_device_slots_on_four_channels_match_the_simulator():
    with RtlTarget(device="rtl-tiny4") as t:
        _check_block(D4, t)


@pytest.mark.rtl
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("iverilog") is None, reason="Icarus Verilog not installed (apt-get install -y iverilog)")
@needs_tools
def test_icarus_runs_the_two_channel_device_bit_identically():
    with RtlTarget(device="rtl-tiny2", simulator="icarus") as t:
        _check_block(D2, t)


@pytest.mark.rtl
@needs_tools
def test_channels_that_disagree_on_a_cfr_are_refused_like_the_simulator(rtl2):
    """MAC over channels with different W_FMT: the simulator's run error; ALL_CH RD_ACC of channels whose
    ACC_RD_FMT differs from channel 0's (the simulator rounds by channel 0's): refused, naming the channels."""
    rtl2.load(ProgramBuilder(D2).finish({"inputs": {}, "outputs": {}}, {}))
    q8 = FORMATS["q8_0"].code
    mac = [ResolvedInstr(0, Instr(Op.SET_CFR, 0, ch=1, k=CFR_W_FMT, imm=q8)), ResolvedInstr(1, Instr(Op.MAC_AB, ALL_CH, row=0, n=1))]
    sim = SimTarget(device=D2)
    sim.load(ProgramBuilder(D2).finish({"inputs": {}, "outputs": {}}, {}))
    with pytest.raises(RunError, match=r"instruction 1 \(MAC_AB\): the addressed channels have different CFR W_FMT values") as e_sim:
        sim.execute(mac)
    with pytest.raises(RunError) as e_rtl:
        rtl2.execute(mac)
    assert str(e_rtl.value) == str(e_sim.value)
    rtl2.load(ProgramBuilder(D2).finish({"inputs": {}, "outputs": {}}, {}))
    rd = [ResolvedInstr(0, Instr(Op.SET_CFR, 0, ch=1, k=CFR_ACC_RD_FMT, imm=1)), ResolvedInstr(1, Instr(Op.RD_ACC, ALL_CH, col=10, n=12))]
    with pytest.raises(RunError, match=r"instruction 1 \(RD_ACC\): ALL_CH RD_ACC of channels 0\.\.1: their CFR ACC_RD_FMT \[0, 1\] differ from channel 0's 0"):
        rtl2.execute(rd)
    ok = rtl2.execute([ResolvedInstr(0, Instr(Op.RD_ACC, ALL_CH, col=0, n=D2.banks))])  # channel 0's slots only: fine
    assert _same(ok[0], np.zeros(D2.banks, np.float32))


def test_device_presets_and_channel_limits():
    assert [DEVICE_PRESETS[n].channels for n in ("rtl-tiny2", "rtl-tiny4", "rtl-aim2", "rtl-aim4")] == [2, 4, 2, 4]
    aim1, aim2, aim4 = (DEVICE_PRESETS[n] for n in ("rtl-aim1", "rtl-aim2", "rtl-aim4"))
    assert aim2.rows * aim2.channels == aim4.rows * aim4.channels == aim1.rows and aim2.rows < aim1.rows  # same DRAM, fewer rows per channel
    assert RtlTarget(device="rtl-aim4").capabilities().device == aim4
    with pytest.raises(SetupError, match=r"channels=32 \(pim_device builds 1 to 8 channels\)"):
        RtlTarget(device="aim-like")


def _verify(tmp_path, device: str, quant: str = "bf16") -> dict:
    return _verify_quantized(tmp_path, "rtl", quant, device)


@pytest.mark.rtl
@needs_tools
def test_llama_tiny_on_two_channels_is_bit_identical_at_every_sync(tmp_path):
    """The compiled program spreads its slots (and KV-cache appends) over both channels: lockstep at every SYNC."""
    _verify(tmp_path, "rtl-tiny2")


@pytest.mark.rtl
@needs_tools
def test_quantized_llama_tiny_on_two_channels_is_bit_identical_at_every_sync(tmp_path):
    _verify(tmp_path, "rtl-tiny2", quant="q4_1:lm_head=mxfp4")


@pytest.mark.rtl
@pytest.mark.slow
@needs_tools
def test_llama_tiny_on_four_channels_is_bit_identical_at_every_sync(tmp_path):
    _verify(tmp_path, "rtl-tiny4")
    _verify(tmp_path, "rtl-tiny4", quant="int8")


def _slot_gemv(d):
    b = ProgramBuilder(d)
    rng = np.random.default_rng(8)
    b.buffer("x", 40)
    b.buffer("y", d.slots)
    b.host_image("x0", rng.normal(size=40).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", rng.normal(size=(d.slots, 40)).astype(np.float32)), "x", "y")
    return b.finish({"inputs": {}, "outputs": {"y": "y"}}, {})


@pytest.mark.rtl
@pytest.mark.slow
@needs_tools
def test_injected_bug_in_channel_1_is_caught_at_that_channels_slots():
    """INJECT_CHANNEL_BUG: channel 1's MAC_AB leaves bank 3's accumulator unchanged. The first differing
    readback is the GEMV's RD_ACC, and the only differing slot is 16 + 3 (channel 1, bank 3)."""
    prog = _slot_gemv(D2)
    with RtlTarget(device="rtl-tiny2", inject_bug="channel1") as bad:
        logs = []
        for t in (SimTarget(device=D2), bad):
            rec = Recorder(t)
            r = Runner(prog, rec)
            r.reset()
            r.step(0, 0)
            logs.append(rec.log)
    diffs = []
    for (blk, ra), (_, rb) in zip(*logs):
        outs = [r for r in blk if r.instr.op is Op.RD_ACC]
        for r, x, y in zip(outs, ra, rb):
            slots = [int(s) for s in np.flatnonzero(x.view(np.uint32) != y.view(np.uint32))]
            if slots:
                diffs.append((r.index, r.instr, [(r.instr.col + s) // D2.banks for s in slots], [(r.instr.col + s) % D2.banks for s in slots]))
    assert diffs, "the injected channel bug went unnoticed"
    idx, ins, chans, banks = diffs[0]
    assert ins.op is Op.RD_ACC and ins.flags & ALL_CH and set(chans) == {1} and set(banks) == {3}, diffs[0]
