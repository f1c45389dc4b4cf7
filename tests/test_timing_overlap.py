"""Host/device overlap in the timing model (nhil.timing.overlap) and the host-overlap pass, against hand-computed cycles.

Table: aim-like with host_op_ns = 100, host_gbs = 1 (1 byte/ns), host_latency_ns = 500 (1000 cycles). One channel.
Single-instruction costs (tests/test_timing.py checks them against the table formulas): RD_ACC of 16 fp32 = 4 cycles;
a WR_SBK to a closed bank = ACT + nRCDWR (28) + nCWL (6) + nBL (2) = 36; a 1-burst WR_GB = nCWLGB (1) after its WRGB.
HOST add(y, y) -> z of 16 elements moves 4 * 16 * (1 + 2) = 192 bytes: 100 + 192 ns = 584 cycles.
"""

from __future__ import annotations

import pytest

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, Instr, Op
from nhil.isa.program import HostOp, Operand, Program
from nhil.timing import TimingEngine
from nhil.timing.overlap import HostOverlapEngine, engine_for
from nhil.timing.table import TIMING_PRESETS

D1 = DeviceConfig(name="aim-like", channels=1, banks=16, rows=4096)
T = TIMING_PRESETS["aim-like"].replace(host_latency_ns=500.0, host_op_ns=100.0, host_gbs=1.0)
LAT, HOST = 1000, 584
RD = Instr(Op.RD_ACC, ALL_CH, col=0, n=16, operand=0)  # -> y
SBK = Instr(Op.WR_SBK, 0, ch=0, bank=0, row=5, col=0, operand=1, imm=1)  # x -> bank row (independent of the host)
GB = Instr(Op.WR_GB, ALL_CH, col=0, n=1, operand=2)  # z -> GB (needs the host kernel)
HOSTI = Instr(Op.HOST, imm=0)
SYNC, EOC = Instr(Op.SYNC), Instr(Op.EOC)


def prog(body, passes=()):
    ops = [Operand("y", 0, 16), Operand("x", 0, 16), Operand("z", 0, 16)]
    return Program(D1, list(body), ops, [HostOp("add", ("y", "y"), ("z",), {})], {"y": 16, "x": 16, "z": 16}, [], {}, {"outputs": {}}, {"passes": list(passes)})


def cycles(p, overlap):
    e = (HostOverlapEngine if overlap else TimingEngine)(D1, T, program=p)
    return e.run_program(), e


def test_serial_chain_costs_the_same_with_and_without_overlap():
    # RD 4 | SYNC +1000 | HOST +584 | WR_GB +1 | SYNC +1000
    p = prog([RD, SYNC, HOSTI, GB, SYNC, EOC])
    want = 4 + LAT + HOST + 1 + LAT
    assert cycles(p, False)[0].cycles == want == 2589
    assert cycles(p, True)[0].cycles == want


def test_independent_device_work_overlaps_the_host_kernel():
    # base: the WR_SBK runs after the host kernel (36 cycles, the WR_GB's WRGB hides under it)
    p = prog([RD, SYNC, HOSTI, SBK, GB, SYNC, EOC])
    st, _ = cycles(p, False)
    assert st.cycles == 4 + LAT + HOST + 36 + LAT == 2624
    # overlap: the WR_SBK (x is a host constant) runs at cycle 4 while the host waits and computes; the WR_GB waits for z
    st, e = cycles(p, True)
    assert st.cycles == 4 + LAT + HOST + 1 + LAT == 2589
    assert st.exposed_by_kind["HOST.add"] == HOST and st.exposed_by_kind["SYNC"] == 2 * LAT and st.exposed_by_kind["WR_SBK"] == 0
    assert sum(st.exposed_by_kind.values()) == st.cycles


def test_dependent_instruction_first_blocks_the_independent_one_until_the_pass_moves_it():
    from nhil.compiler.host_overlap import host_overlap

    p = prog([RD, SYNC, HOSTI, GB, SBK, SYNC, EOC])
    # WR_SBK queued behind the WR_GB that waits for z; its ACT takes the command-bus cycle after the WRGB
    assert cycles(p, True)[0].cycles == cycles(p, False)[0].cycles == 4 + LAT + HOST + 1 + 36 + LAT
    q = host_overlap(p)
    assert [i.op for i in q.instrs] == [Op.RD_ACC, Op.SYNC, Op.HOST, Op.WR_SBK, Op.WR_GB, Op.SYNC, Op.EOC]
    assert cycles(q, True)[0].cycles == 2589


def test_readback_into_a_buffer_the_host_still_reads_waits_for_the_kernel():
    # RD_ACC into y after HOST add(y, y): the readback may not overwrite y before the kernel is done (cycle 4 + 1000 + 584)
    p = prog([RD, SYNC, HOSTI, RD, SYNC, EOC])
    assert cycles(p, True)[0].cycles == 4 + LAT + HOST + 4 + LAT


def test_engine_for_follows_the_program_passes():
    assert type(engine_for(prog([EOC]))) is TimingEngine
    assert type(engine_for(prog([EOC], passes=["host-overlap"]))) is HostOverlapEngine
    assert type(engine_for(prog([EOC]), overlap=True)) is HostOverlapEngine


def test_pass_keeps_conflicting_order():
    """A WR_SBK to the row a dependent instruction writes stays behind it (write-write on the same bank row)."""
    from nhil.compiler.host_overlap import host_overlap

    dep = Instr(Op.WR_SBK, 0, ch=0, bank=0, row=5, col=0, operand=2, imm=1)  # z -> row 5 (needs the host)
    p = prog([RD, SYNC, HOSTI, dep, SBK, SYNC, EOC])
    assert host_overlap(p).instrs == p.instrs


GB_Y = Instr(Op.WR_GB, ALL_CH, col=0, n=1, operand=0)  # y -> GB: a pure gather, no host kernel between


def test_forward_what_if_skips_the_hand_off_only_for_a_buffer_no_host_kernel_reads():
    # no host op reads y: RD 4 | SYNC (y forwarded: +fwd) | WR_GB +1 | SYNC +1000 (the last hand-off stays)
    bare = Program(D1, [RD, SYNC, GB_Y, SYNC, EOC], [Operand("y", 0, 16)], [], {"y": 16}, [], {}, {"outputs": {}}, {"passes": []})
    run = lambda p, tab: HostOverlapEngine(D1, tab, program=p).run_program().cycles  # noqa: E731
    assert run(bare, T) == 4 + LAT + 1 + LAT == 2005
    assert run(bare, T.replace(forward_latency_ns=0.0)) == 4 + 0 + 1 + LAT == 1005
    assert run(bare, T.replace(forward_latency_ns=10.0)) == 4 + 20 + 1 + LAT == 1025
    # the host kernel reads y: the forward path does not apply, the chain costs what it did
    p = prog([RD, SYNC, HOSTI, GB, SYNC, EOC])
    assert run(p, T.replace(forward_latency_ns=0.0)) == 2589
    with pytest.raises(ValueError, match="forward_latency_ns"):  # the base engine would ignore it silently
        TimingEngine(D1, T.replace(forward_latency_ns=0.0), program=bare)


def test_host_share_study_on_smollm2_shape():
    """The bench's study (nhil.timing.host_share): the EW passes remove 3 host calls per layer (silu_mul, two adds;
    30 layers), the overlap never costs cycles, and with no hand-off latency no SYNC time is left."""
    from nhil.timing.host_share import host_share_study

    rows = {r["variant"]: r for r in host_share_study()["rows"]}
    before, ov, ew, after = (rows[v] for v in ("default pipeline (before)", "+ host-overlap", "+ ew-swiglu + ew-residual", "+ all three (after)"))
    assert before["host_calls"] - ew["host_calls"] == 3 * 30 and after["host_calls"] == ew["host_calls"]
    assert before["syncs"] == after["syncs"] == 6 * 30 + 1  # every remaining hand-off is a gather the next GEMV needs
    assert after["cycles_per_token"] < ew["cycles_per_token"] < before["cycles_per_token"] and ov["cycles_per_token"] < before["cycles_per_token"]
    assert before["sync_cycles"] == 181 * LAT  # 500 ns each, fully exposed without overlap
    zero = rows["after, hand-off 0 ns (assumed 500)"]
    assert zero["sync_cycles"] == 0 and zero["cycles_per_token"] < after["cycles_per_token"]
    fwd = rows["after, pure-gather SYNCs forwarded on the device (what-if), hand-off 500 ns"]
    assert zero["cycles_per_token"] < fwd["cycles_per_token"] < after["cycles_per_token"]
    for r in rows.values():
        assert r["of_bound"] == pytest.approx(r["tokens_per_s"] / r["table_bound_tokens_per_s"])


def test_overlap_stream_of_llama_tiny_with_every_opt_in_pass_is_legal():
    """llama-tiny with ew-swiglu, ew-residual and host-overlap: the recorded command stream (EW commands included) passes
    the legality checker, channel-state sharing changes no cycle, exposed cycles add up, and overlap never costs cycles."""
    from nhil.compile import compile_model
    from nhil.compiler.pipeline import DEFAULT_PASSES
    from nhil.timing import check_stream, timing_for

    p = compile_model("llama-tiny", passes=list(DEFAULT_PASSES) + ["ew-swiglu", "ew-residual", "host-overlap"])
    T = timing_for(p.device)
    rec = engine_for(p, record=True)
    assert isinstance(rec, HostOverlapEngine)
    st_rec = rec.run_program(pos=5)
    assert any(c.kind == "EW" for c in rec.commands())
    check_stream(rec.commands(), p.device, T)
    st = engine_for(p).run_program(pos=5)
    assert st.cycles == st_rec.cycles and sum(st.exposed_by_kind.values()) == st.cycles == sum(st.exposed_by_layer.values())
    assert set(st.exposed_by_layer) >= {"embed", "L0", "L1", "head"}  # layer ends found from the read-back residual sums
    assert st.cycles <= TimingEngine(p.device, T, program=p).run_program(pos=5).cycles
