"""RTL weight formats (issue 16): the quantized MAC datapath against nhil.numerics, quantized
programs bit-identical to the simulator, the injected decode bug caught at the right lane and
instruction, and the claims of rtl / fpga following what the RTL implements.

Needs cocotb + Verilator (skipped with the reason otherwise, as tests/test_rtl.py). Builds:
the ``rtl-tiny`` channel (shared with tests/test_rtl.py) and one ``INJECT_DECODE_BUG`` build."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

from nhil.compiler.builder import ProgramBuilder
from nhil.isa import DEVICE_PRESETS, Op
from nhil.numerics.formats import DEVICE_FORMATS, FORMATS, PREQUANT
from nhil.runtime.executor import Runner
from nhil.targets.rtl import RtlTarget
from nhil.targets.sim import SimTarget
from tests.test_rtl import Recorder, _same, first_difference, needs_tools

DEV = DEVICE_PRESETS["rtl-tiny"]
E2M1_FORMATS = {"mxfp4", "mxfp4-rceil", "nvfp4"}  # the formats whose elements are E2M1 (INJECT_DECODE_BUG)


def _lane_and_formats(log: str) -> tuple[set[str], set[int], set[str]]:
    """(keys, lanes, formats) named in the tb_formats mismatch summaries of a cocotb log."""
    keys = set(re.findall(r"\[([a-z0-9_.-]+ (?:lane \d+|c1|c2|m|dot|t|y))\]", log))
    lanes = {int(k.split()[-1]) for k in keys if " lane " in k}
    return keys, lanes, {k.split()[0] for k in keys}


@pytest.mark.rtl
@needs_tools
def test_quantized_datapath_matches_the_contract_for_every_format():
    """tb_formats on the real build: every element code of every format, scale edges, random rows, fp32 mul."""
    from nhil.targets.rtl.unit import run_datapath_tests

    r = run_datapath_tests(vectors=int(os.environ.get("NHIL_DP_VECTORS", "6000")), seed=11, modules=("nhil.targets.rtl.tb_formats",))
    msgs = re.findall(r"AssertionError: .{0,800}", r["log"])
    assert r["tests"] == 4 and r["failed"] == 0, f"{r['failed']} of {r['tests']} failed (run {r['run_dir']}): " + "\n".join(msgs)


@pytest.mark.rtl
@needs_tools
def test_injected_decode_bug_is_caught_at_lane_5_of_the_e2m1_formats_only():
    """INJECT_DECODE_BUG (lane 5 reads E2M1 code 0x1 as 1.0): the unit tests fail exactly there."""
    from nhil.targets.rtl.unit import run_datapath_tests

    r = run_datapath_tests(vectors=3000, seed=7, inject_bug="decode", modules=("nhil.targets.rtl.tb_formats",))
    assert r["tests"] == 4 and r["failed"] >= 1, r["log"][-2000:]
    keys, lanes, fmts = _lane_and_formats(r["log"])
    assert lanes == {5}, keys
    assert fmts <= E2M1_FORMATS and {"mxfp4", "nvfp4"} <= fmts, keys
    assert "mul_f32_matches_contract passed" in r["log"]


def _format_program(names: list[str], seed: int = 5):
    """One GEMV per weight format: N > slots (two row-groups), K = 2 chunks + 32 (a short last chunk)."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(seed)
    n_out, n_in = DEV.slots + 4, 2 * DEV.cols + 32
    b.buffer("x", n_in)
    b.host_image("x0", rng.normal(size=n_in).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    outs = {}
    for name in names:
        w = (rng.normal(size=(n_out, n_in)) * rng.choice([1e-3, 1.0, 30.0], size=(n_out, 1))).astype(np.float32)
        y = b.buffer(f"y.{name}", n_out)
        b.gemv(b.place_matrix(name, w, qt=FORMATS[name].quantize(w)), "x", y)
        outs[y] = y
    prog = b.finish({"inputs": {}, "outputs": outs}, {"weight_formats": sorted(names)})
    return prog


def _run(prog, target):
    rec = Recorder(target)
    r = Runner(prog, rec)
    r.reset()
    return rec, {k: v.copy() for k, v in r.step(0, 0).items()}


@pytest.mark.rtl
@needs_tools
def test_a_gemv_in_every_weight_format_is_bit_identical_to_the_simulator():
    prog = _format_program(list(FORMATS))
    assert sum(1 for i in prog.instrs if i.op is Op.SET_CFR) >= len(FORMATS)
    sim, o_sim = _run(prog, SimTarget(device=DEV))
    with RtlTarget() as t:
        rt, o_rtl = _run(prog, t)
        st = t.stats()
    assert first_difference(prog, sim, rt) is None, first_difference(prog, sim, rt)
    assert sim.trace() == rt.trace()
    for k in o_sim:
        assert _same(o_sim[k], o_rtl[k]), k
        assert np.isfinite(o_sim[k]).all() and np.abs(o_sim[k]).max() > 0, k  # a meaningful comparison
    assert st["macs"] > 0 and st["instructions"]["SET_CFR"] >= len(FORMATS)


@pytest.mark.rtl
@needs_tools
def test_injected_decode_bug_is_caught_at_the_first_e2m1_gemv():
    """On the INJECT_DECODE_BUG build the first differing readback is the first RD_ACC of the mxfp4 GEMV."""
    names = ["int8", "q4_1", "mxfp4", "nvfp4"]
    prog = _format_program(names, seed=6)
    sim, _ = _run(prog, SimTarget(device=DEV))
    with RtlTarget(inject_bug="decode") as bad_t:
        assert bad_t.stats()["inject_bug"] == "decode"
        bad, _ = _run(prog, bad_t)
    diff = first_difference(prog, sim, bad)
    assert diff is not None, "the injected decode bug went unnoticed"
    first_mx = next(i for i, ins in enumerate(prog.instrs) if ins.op is Op.RD_ACC and prog.operands[ins.operand].buffer == "y.mxfp4")
    assert diff.startswith(f"instruction {first_mx} (RD_ACC"), diff


def test_rtl_and_fpga_claim_exactly_the_formats_the_rtl_implements():
    """rtl (any 16-lane device) and the board's INFO (sim backend, the emulator's default) claim every device format."""
    import dataclasses
    import json

    from nhil.targets.fpga import protocol as P
    from nhil.targets.fpga.emulator import Board
    from nhil.targets.fpga.frame import Frame
    from nhil.targets.rtl.target import RTL_FORMATS, rtl_formats

    assert RTL_FORMATS == frozenset({"bf16", *FORMATS}) == DEVICE_FORMATS - set(PREQUANT) and "bf16" in RTL_FORMATS
    assert RtlTarget().capabilities().formats == RTL_FORMATS
    assert rtl_formats(dataclasses.replace(DEV, lanes=8)) == {"bf16"}  # quantized formats need 16-lane bursts
    board = Board(DEVICE_PRESETS["fpga-small"])
    kind, payload = board._dispatch(Frame(P.INFO, 0, 1, 0, b""), lambda b: None)
    info = json.loads(payload)
    assert info["backend"] == "sim" and set(info["formats"]) == set(RTL_FORMATS)


def _verify_quantized(tmp_path, target: str, quant: str, device: str | None = None) -> dict:
    """llama-tiny, 2 tokens, with ``quant`` (``bf16``: unquantized) on ``target`` (``device``: a preset): PASS, lockstep at every SYNC."""
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model="llama-tiny", target=target, tokens=2, quant=quant, target_options={"device": device} if device else {},
                               goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS", rep.get("error") or rep.get("checks")
    if quant != "bf16":
        assert set(rep["quant"]["weight_formats"]) == set(quant.replace(":lm_head=", ",").split(","))  # the program really is quantized
    assert device is None or rep["target_stats"]["device"] == device
    ls = rep["target_stats"]["lockstep"]
    assert ls["syncs_compared"] > 0 and ls["readbacks_compared"] > 0 and ls["first_mismatch"] is None
    assert next(c for c in rep["checks"] if c["name"] == "bit_identical_to_sim")["passed"]
    return rep


@pytest.mark.rtl
@needs_tools
def test_quantized_llama_tiny_verifies_on_rtl_in_lockstep_with_the_simulator(tmp_path):
    """`make verify MODEL=llama-tiny TARGET=rtl QUANT=q4_1:lm_head=mxfp6` in the default test run: GGUF Q4_1 blocks (with the
    activation-sum term) and an MXFP6 LM head, bit-identical to the simulator at every SYNC."""
    rep = _verify_quantized(tmp_path, "rtl", "q4_1:lm_head=mxfp6-e2m3")
    assert rep["target_stats"]["instructions"]["SET_CFR"] > 0


@pytest.mark.fpga
def test_quantized_llama_tiny_verifies_on_the_fpga_board_in_lockstep_with_the_simulator(tmp_path):
    """The board emulator (default backend) over the serial link: int4-g128 linears and an NVFP4 LM head."""
    _verify_quantized(tmp_path, "fpga", "int4-g128:lm_head=nvfp4")


def test_moe_experts_take_the_recipe_and_their_sub_programs_end_with_bf16():
    """qwen2_moe (routed + shared experts) under q8_0: every expert and shared-expert matrix is Q8_0, the router and the
    shared expert's sigmoid gate stay bf16, and each expert sub-program sets W_FMT and resets it to 0 before its SYNC."""
    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.quantize import build_plan
    from nhil.isa.instr import CFR_W_FMT
    from nhil.models import get_model

    gm = raise_graph(export_decode(get_model("qwen2_moe").model, 16)[0], "decode").gm
    prog = lower_decode_graph(gm, DEV, model_name="qwen2_moe", quant=build_plan("q8_0", gm))
    fmts = {n: p["format"] for n, p in prog.info["quant"]["placements"].items()}
    experts = {n: f for n, f in fmts.items() if ".experts." in n or "shared_expert." in n}
    routers = {n: f for n, f in fmts.items() if n.endswith("mlp.gate.weight") or "shared_expert_gate" in n}
    assert experts and set(experts.values()) == {"q8_0"}, experts
    assert routers and set(routers.values()) == {"bf16"}, routers
    assert "q8_0" in prog.info["weight_formats"]
    for m in prog.info["moe"]:
        for e in m["expert_markers"]:
            at = next(i for i, ins in enumerate(prog.instrs) if ins.op is Op.HOST and ins.imm == e)
            end = next(i for i in range(at + 1, len(prog.instrs)) if prog.instrs[i].op is Op.HOST and prog.host_ops[prog.instrs[i].imm].kernel in ("moe_expert", "moe_dispatch"))
            wf = [ins.imm for ins in prog.instrs[at:end] if ins.op is Op.SET_CFR and ins.k == CFR_W_FMT]
            assert wf and wf[0] == FORMATS["q8_0"].code and wf[-1] == 0, (e, wf)
            last_sync = max(i for i in range(at, end) if prog.instrs[i].op is Op.SYNC)
            assert [ins.op for ins in prog.instrs[last_sync - 1 : last_sync + 1]] == [Op.SET_CFR, Op.SYNC]


@pytest.mark.rtl
@needs_tools
def test_quantized_moe_verifies_on_rtl_in_lockstep_with_the_simulator(tmp_path):
    """qwen2_moe with Q8_0 experts (only the routed ones issued, in data-dependent order) on the RTL, bit-identical at every SYNC."""
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model="qwen2_moe", target="rtl", tokens=2, quant="q8_0", goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert "q8_0" in rep["quant"]["weight_formats"]
    ls = rep["target_stats"]["lockstep"]
    assert ls["syncs_compared"] > 0 and ls["first_mismatch"] is None


@pytest.mark.rtl
@pytest.mark.skipif(shutil.which("iverilog") is None, reason="Icarus Verilog not installed (apt-get install -y iverilog)")
@needs_tools
def test_icarus_runs_quantized_gemvs_bit_identically():
    """The second simulator: one GEMV per element family (int4 zero points, FP6, NVFP4's two scales, Q4_1's min, fp16)."""
    prog = _format_program(["int4-g32-asym", "mxfp6-e3m2", "nvfp4", "q4_1", "fp16"], seed=8)
    sim, o_sim = _run(prog, SimTarget(device=DEV))
    with RtlTarget(simulator="icarus") as t:
        rt, o_rtl = _run(prog, t)
    assert first_difference(prog, sim, rt) is None, first_difference(prog, sim, rt)
    assert all(_same(o_sim[k], o_rtl[k]) for k in o_sim)
