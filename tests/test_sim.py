"""Each simulator instruction against a plain numpy/torch computation of its documented semantics."""

import numpy as np
import pytest
import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import RunError
from nhil.isa import DEVICE_PRESETS, Instr, Op
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT
from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from nhil.numerics.mac import reference_gemv
from nhil.runtime.executor import Runner
from nhil.targets.base import ResolvedInstr
from nhil.targets.sim import SimTarget

DEV = DEVICE_PRESETS["rtl-tiny"]  # 1 channel x 16 banks x 256 rows x 128 cols
L = DEV.lanes


def _target():
    t = SimTarget(device=DEV)
    b = ProgramBuilder(DEV)
    t.load(b.finish({"inputs": {}, "outputs": {}}, {}))
    return t


def _bf(x):
    return f32_to_bf16_bits(np.asarray(x, np.float32))


def run(t, *items):
    return t.execute([ResolvedInstr(i, ins, p) for i, (ins, p) in enumerate(items)])


def test_wr_gb_and_copy_gb_bk_and_rd_sbk():
    t = _target()
    rng = np.random.default_rng(0)
    data = _bf(rng.normal(size=2 * L))
    (rb,) = run(
        t,
        (Instr(Op.WR_GB, ALL_CH, col=3, n=2), data),
        (Instr(Op.COPY_GB_BK, 0, bank=5, row=7, col=3, n=2), None),
        (Instr(Op.RD_SBK, 0, bank=5, row=7, col=3, n=2), None),
    )
    np.testing.assert_array_equal(rb, data)
    row = t.read_row(0, 5, 7)
    assert (row[: 3 * L] == 0).all() and (row[5 * L :] == 0).all()


def test_wr_sbk_lane_mask_writes_only_masked_lanes():
    t = _target()
    t.write_row(0, 2, 9, np.full(DEV.cols, 0x1111, np.uint16))
    payload = np.arange(L, dtype=np.uint16) + 0x4000
    run(t, (Instr(Op.WR_SBK, 0, bank=2, row=9, col=1, imm=0b1000_0000_0000_0101), payload))
    row = t.read_row(0, 2, 9)
    seg = row[L : 2 * L]
    expect = np.full(L, 0x1111, np.uint16)
    for lane in (0, 2, 15):
        expect[lane] = payload[lane]
    np.testing.assert_array_equal(seg, expect)
    assert (row[:L] == 0x1111).all() and (row[2 * L :] == 0x1111).all()


def test_wr_abk_writes_every_bank():
    t = _target()
    payload = _bf(np.linspace(-1, 1, L))
    run(t, (Instr(Op.WR_ABK, ALL_CH, row=4, col=0, n=1), payload))
    for bank in range(DEV.banks):
        np.testing.assert_array_equal(t.read_row(0, bank, 4)[:L], payload)


def test_mac_ab_matches_reference_gemv_and_torch():
    t = _target()
    rng = np.random.default_rng(1)
    n = 5
    w = rng.normal(size=(DEV.banks, n * L)).astype(np.float32)
    x = rng.normal(size=n * L).astype(np.float32)
    for bank in range(DEV.banks):
        row = np.zeros(DEV.cols, np.uint16)
        row[: n * L] = _bf(w[bank])
        t.write_row(0, bank, 11, row)
    (acc,) = run(
        t,
        (Instr(Op.WR_ACC, ALL_CH, k=2, n=DEV.banks), np.zeros(DEV.banks, np.float32)),
        (Instr(Op.WR_GB, ALL_CH, col=0, n=n), _bf(x)),
        (Instr(Op.MAC_AB, ALL_CH, row=11, col=0, n=n, k=2), None),
        (Instr(Op.RD_ACC, ALL_CH, k=2, n=DEV.banks), None),
    )
    np.testing.assert_array_equal(acc, reference_gemv(_bf(w), _bf(x)))
    ref = torch.nn.functional.linear(torch.from_numpy(bf16_bits_to_f32(_bf(x))).double(), torch.from_numpy(bf16_bits_to_f32(_bf(w))).double()).numpy()
    np.testing.assert_allclose(acc, ref, rtol=1e-5, atol=1e-5)


def test_mac_sb_touches_one_bank_and_accumulates_on_top():
    t = _target()
    row = np.zeros(DEV.cols, np.uint16)
    row[:L] = _bf(np.ones(L))
    for bank in range(DEV.banks):
        t.write_row(0, bank, 3, row)
    acc0 = np.arange(DEV.banks, dtype=np.float32)
    (acc,) = run(
        t,
        (Instr(Op.WR_ACC, ALL_CH, k=0, n=DEV.banks), acc0),
        (Instr(Op.WR_GB, ALL_CH, col=0, n=1), _bf(np.full(L, 2.0))),
        (Instr(Op.MAC_SB, 0, bank=6, row=3, col=0, n=1, k=0), None),
        (Instr(Op.RD_ACC, ALL_CH, k=0, n=DEV.banks), None),
    )
    expect = acc0.copy()
    expect[6] += 32.0
    np.testing.assert_array_equal(acc, expect)


def test_rd_acc_bf16_mode_rounds_like_torch():
    t = _target()
    vals = np.random.default_rng(2).normal(size=DEV.banks).astype(np.float32) * 1000
    (acc,) = run(
        t,
        (Instr(Op.WR_ACC, ALL_CH, k=1, n=DEV.banks), vals),
        (Instr(Op.SET_CFR, ALL_CH, k=CFR_ACC_RD_FMT, imm=1), None),
        (Instr(Op.RD_ACC, ALL_CH, k=1, n=DEV.banks), None),
    )
    np.testing.assert_array_equal(acc, torch.from_numpy(vals).to(torch.bfloat16).float().numpy())


def test_unwritten_row_reads_zero_and_allocates_nothing():
    t = _target()
    (rb,) = run(t, (Instr(Op.RD_SBK, 0, bank=0, row=200, col=0, n=1), None))
    assert (rb == 0).all() and t.stats()["rows_allocated"] == 0


@pytest.mark.parametrize(
    "ins, payload, msg",
    [
        (Instr(Op.MAC_AB, ALL_CH, row=256, n=1), None, "row 256"),
        (Instr(Op.WR_GB, ALL_CH, col=7, n=2), np.zeros(2 * L, np.uint16), "outside the global buffer"),
        (Instr(Op.RD_ACC, ALL_CH, k=9, n=1), None, "accumulator 9"),
        (Instr(Op.WR_SBK, 0, bank=16, row=0), np.zeros(L, np.uint16), "bank 16"),
        (Instr(Op.MAC_AB, 0, ch=3, row=0, n=1), None, "channel 3"),
        (Instr(Op.WR_GB, ALL_CH, col=0, n=1), np.zeros(3, np.uint16), "payload must be"),
    ],
)
def test_out_of_range_is_a_run_error_naming_the_instruction(ins, payload, msg):
    t = _target()
    with pytest.raises(RunError, match=msg):
        run(t, (ins, payload))


def test_builder_gemv_through_runner_equals_contract_multi_chunk_multi_group():
    """A GEMV larger than one row (K > cols) and than one row-group (N > slots), end to end."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(4)
    n_out, n_in = 3 * DEV.slots + 5, 2 * DEV.cols + 24
    w = rng.normal(size=(n_out, n_in)).astype(np.float32)
    b.buffer("x", n_in)
    b.buffer("y", n_out)
    b.host_image("x0", rng.normal(size=n_in).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", w), "x", "y")
    prog = b.finish({"inputs": {}, "outputs": {"y": "y"}}, {})
    t = SimTarget()
    r = Runner(prog, t)
    r.reset()
    y = r.step(0, 0)["y"]
    x = prog.host_images["x0"] * 2
    np.testing.assert_array_equal(y, reference_gemv(f32_to_bf16_bits(w), f32_to_bf16_bits(x)))


def test_readback_fed_back_to_the_device_gets_a_sync_and_fresh_data():
    """GEMV -> GEMV with no host op between: the second WR_GB must send the first GEMV's readback."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(6)
    w1 = rng.normal(size=(20, 32)).astype(np.float32)
    w2 = rng.normal(size=(8, 20)).astype(np.float32)
    b.buffer("x", 32)
    b.buffer("h", 20)
    b.buffer("y", 8)
    b.host_image("x0", rng.normal(size=32).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w1", w1), "x", "h")
    b.gemv(b.place_matrix("w2", w2), "h", "y")
    prog = b.finish({"inputs": {}, "outputs": {"h": "h", "y": "y"}}, {})
    syncs = [i for i, ins in enumerate(prog.instrs) if ins.op is Op.SYNC]
    first_wr_h = next(i for i, ins in enumerate(prog.instrs) if ins.op is Op.WR_GB and prog.operands[ins.operand].buffer == "h")
    assert any(s < first_wr_h for s in syncs[1:]) or syncs[0] < first_wr_h
    r = Runner(prog, SimTarget())
    r.reset()
    out = r.step(0, 0)
    h = reference_gemv(f32_to_bf16_bits(w1), f32_to_bf16_bits(prog.host_images["x0"] * 2))
    np.testing.assert_array_equal(out["h"], h)
    np.testing.assert_array_equal(out["y"], reference_gemv(f32_to_bf16_bits(w2), f32_to_bf16_bits(h)))
