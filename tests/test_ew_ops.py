"""In-device elementwise ops EWMUL / EWADD / AF (docs/isa.md "Elementwise ops"): semantics against numpy float64 /
ml_dtypes / hand values, the simulator's step (and fast path) on them, their timing, the RTL/FPGA refusal, and the
opt-in ew-swiglu / ew-residual passes on llama-tiny (tight tier = the device-numerics reference bit for bit)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import LoadError, RunError
from nhil.isa import DEVICE_PRESETS
from nhil.isa.instr import ALL_CH, Instr, Op
from nhil.isa.semantics import check_instr
from nhil.numerics.bf16 import bf16_bits_to_f32
from nhil.numerics.ew import AF_IDS, af_apply, af_lut, ew_add, ew_mul

ALL_BF16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# ---------------------------------------------------------------- the AF tables
@pytest.mark.parametrize("name,f", [("silu", lambda x: x / (1.0 + math.exp(-x))), ("gelu", lambda x: x * (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0)])
def test_af_table_is_float64_function_rounded_once_to_bf16(name, f):
    ml = pytest.importorskip("ml_dtypes")
    with np.errstate(invalid="ignore"):
        x = bf16_bits_to_f32(ALL_BF16).astype(np.float64)
    fin = np.isfinite(x)
    with np.errstate(over="ignore"):
        y = np.array([f(v) if abs(v) < 700 or name == "gelu" else (0.0 * v if v < 0 else v) for v in x[fin]])
    want = y.astype(ml.bfloat16).view(np.uint16)  # ml_dtypes: float64 -> bf16, one RNE rounding
    assert np.array_equal(af_lut(AF_IDS[name])[fin], want)
    lut = af_lut(AF_IDS[name])
    inf, ninf, nan = np.uint16(0x7F80), np.uint16(0xFF80), np.uint16(0xFFC1)
    assert lut[inf] == 0x7F80 and lut[ninf] == 0x8000 and lut[nan] == 0x7FC0  # f(+inf) = +inf, f(-inf) = -0, NaN canonical
    assert lut[0x0000] == 0x0000 and lut[0x8000] == 0x8000  # f(+-0) = +-0


def test_af_table_equals_the_reference_written_in_torch():
    """The device-numerics reference (nhil.golden.quant_ew, direct rounding in torch) equals the simulator's table everywhere."""
    from nhil.golden.quant_ew import silu_table_value

    x = bf16_bits_to_f32(ALL_BF16)
    ref = silu_table_value(torch.from_numpy(x.copy())).numpy()
    got = bf16_bits_to_f32(af_lut(AF_IDS["silu"]))
    assert np.array_equal(np.isnan(ref), np.isnan(got))
    fin = ~np.isnan(got)
    assert np.array_equal(_bits(ref)[fin], _bits(got)[fin])


def test_hand_values():
    # silu(1) = 0.7310585786..., bf16 RNE: 0.73046875 (0x3F3B); silu(-1) = -0.26894142 -> -0.26953125 (0xBE8A)
    assert af_lut(0)[0x3F80] == 0x3F3B and af_lut(0)[0xBF80] == 0xBE8A
    # AF rounds its fp32 input to bf16 first: 1 + 2^-9 is below half an ulp of bf16(1) -> the entry of 1.0
    assert _bits(af_apply(np.float32([1 + 2.0**-9]), 0))[0] == 0x3F3B0000
    assert _bits(af_apply(np.float32([1 + 3 * 2.0**-9]), 0))[0] == np.uint32(af_lut(0)[0x3F81]) << 16  # rounds up (RNE), not truncated
    # EWMUL / EWADD: one fp32 RNE operation; overflow to inf; NaN canonical; -0 + +0 = +0
    a = np.float32([1.5, 3e38, np.nan, -0.0, 1 + 2.0**-23])
    b = np.float32([2.0, 10.0, 1.0, 0.0, 1 + 2.0**-23])
    assert list(_bits(ew_mul(a, b))) == [_bits(3.0), 0x7F800000, 0x7FC00000, 0x80000000, _bits(np.float32(1 + 2.0**-22))]
    assert list(_bits(ew_add(a, b))) == [_bits(3.5), _bits(np.float32(3e38)), 0x7FC00000, 0x00000000, _bits(np.float32(2 + 2.0**-22))]
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    assert np.array_equal(_bits(ew_mul(x, y)), _bits((x.astype(np.float64) * y).astype(np.float32)))  # exact product, rounded once
    assert np.array_equal(_bits(ew_add(x, y)), _bits((x.astype(np.float64) + y).astype(np.float32)))


# ---------------------------------------------------------------- the simulator
D = DEVICE_PRESETS["rtl-tiny"]


def _state():
    from nhil.targets.sim.fast import FastPimState

    st = FastPimState(D)
    rng = np.random.default_rng(0)
    st.acc[:] = rng.standard_normal(st.acc.shape).astype(np.float32) * 4
    return st


def test_simulator_step_and_fast_path_apply_the_ops_to_every_bank():
    from nhil.targets.base import ReadbackDigest
    from nhil.targets.sim.device import PimState

    st, fast = _state(), _state()
    a0 = st.acc.copy()
    prog = [Instr(Op.AF, ALL_CH, k=0, imm=0), Instr(Op.EWMUL, ALL_CH, k=0, imm=1), Instr(Op.EWADD, ALL_CH, k=2, imm=3), Instr(Op.AF, 0, ch=0, k=3, imm=1)]
    for i, ins in enumerate(prog):
        PimState.step(st, i, ins, None)
    fast.run_block([(i, ins, None) for i, ins in enumerate(prog)], ReadbackDigest())
    assert np.array_equal(_bits(st.acc), _bits(fast.acc))
    silu = bf16_bits_to_f32(af_lut(0)[(_bits(a0[..., 0]) + 0x7FFF + ((_bits(a0[..., 0]) >> 16) & 1)) >> 16])
    assert np.array_equal(_bits(st.acc[..., 0]), _bits((silu.astype(np.float64) * a0[..., 1]).astype(np.float32)))
    assert np.array_equal(_bits(st.acc[..., 2]), _bits((a0[..., 2].astype(np.float64) + a0[..., 3]).astype(np.float32)))
    assert np.array_equal(_bits(st.acc[..., 1]), _bits(a0[..., 1]))  # the operand accumulator is unchanged


def test_bad_operands_are_refused_by_the_semantics_table():
    assert "second accumulator" in check_instr(Instr(Op.EWMUL, ALL_CH, k=0, imm=4), D)
    assert "unknown AF function 7" in check_instr(Instr(Op.AF, ALL_CH, k=0, imm=7), D)
    assert "accumulator 5" in check_instr(Instr(Op.EWADD, ALL_CH, k=5, imm=0), D)
    with pytest.raises(RunError, match="unknown AF function"):
        _state().step(3, Instr(Op.AF, ALL_CH, k=0, imm=9), None)


# ---------------------------------------------------------------- refusal on RTL / FPGA, acceptance on sim
def _ew_program(device):
    b = ProgramBuilder(device)
    b.emit(Op.AF, k=0, imm=0)
    return b.finish({"inputs": {}, "outputs": {}}, {})


def test_rtl_and_fpga_refuse_a_program_with_elementwise_ops_at_load():
    from nhil.targets.fpga.target import FpgaTarget
    from nhil.targets.rtl import RtlTarget
    from nhil.targets.sim import SimTarget

    SimTarget().load(_ew_program(D))  # the simulator claims them
    with pytest.raises(LoadError, match=r"does not implement AF \(AF: in-device elementwise ops.*simulator only; recompile without the passes ew-swiglu, ew-residual"):
        RtlTarget().load(_ew_program(DEVICE_PRESETS["rtl-tiny"]))
    with FpgaTarget(device="fpga-small") as t:
        with pytest.raises(LoadError, match=r"does not implement AF \(AF: in-device elementwise ops"):
            t.load(_ew_program(DEVICE_PRESETS["fpga-small"]))


# ---------------------------------------------------------------- timing
def test_timing_of_an_elementwise_op_after_a_mac():
    from nhil.isa.device import DeviceConfig
    from nhil.isa.program import Operand, Program
    from nhil.timing import TimingEngine, check_stream
    from nhil.timing.table import TIMING_PRESETS

    d = DeviceConfig(name="aim-like", channels=1, banks=16, rows=4096)
    T = TIMING_PRESETS["aim-like"].replace(host_latency_ns=0.0, host_op_ns=0.0)
    body = [Instr(Op.MAC_AB, ALL_CH, row=0, col=0, n=64, k=0), Instr(Op.EWMUL, ALL_CH, k=0, imm=1), Instr(Op.RD_ACC, ALL_CH, col=0, n=16, k=0, operand=0)]
    prog = Program(d, body + [Instr(Op.SYNC), Instr(Op.EOC)], [Operand("y", 0, 16)], [], {"y": 16}, [], {}, {"outputs": {}}, {})
    e = TimingEngine(d, T, record=True, program=prog)
    st = e.run_program()
    # MAC: ACT + nRCDRDMAC, 64 bursts nCCD apart (last at 56 + 126); EW nMACLAT later; RDACC nEW after the EW, 2 bursts
    last_mac = 56 + 2 * 63
    ew_t = last_mac + T.nMACLAT
    assert [c.t for c in e.commands() if c.kind == "EW"] == [ew_t]
    assert st.cycles == ew_t + T.nEW + T.rd_acc_cycles(2)
    assert check_stream(e.commands(), d, T) == []


# ---------------------------------------------------------------- the passes on llama-tiny
@pytest.fixture(scope="module")
def tiny_gm():
    from nhil.compiler import export_decode, raise_graph
    from nhil.models import get_model

    ep, _ = export_decode(get_model("llama-tiny").model, 64)
    return raise_graph(ep, "decode").gm


def _compile(gm, extra):
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.pipeline import DEFAULT_PASSES, PassManager

    return PassManager(list(DEFAULT_PASSES) + list(extra)).compile(lower_decode_graph, gm, DEVICE_PRESETS["aim-like"], model_name="llama-tiny")


def _run(prog, tokens):
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    r = Runner(prog, SimTarget())
    r.reset()
    return [{k: v.copy() for k, v in r.step(t, pos).items()} for pos, t in enumerate(tokens)]


TOKENS = [3, 17, 42, 99, 5, 7]


def test_ew_residual_is_bit_identical_and_removes_the_host_adds(tiny_gm):
    base, ew = _compile(tiny_gm, ()), _compile(tiny_gm, ("ew-residual",))
    kern = lambda p: [h.kernel for h in (p.host_ops[i.imm] for i in p.instrs if i.op is Op.HOST)]  # noqa: E731
    assert kern(base).count("add") == 2 * 2 and kern(ew).count("add") == 0 and len(ew.info["ew_add"]) == 4  # 2 layers x 2 residual adds
    assert sum(i.op is Op.EWADD for i in ew.instrs) > 0
    for a, b in zip(_run(base, TOKENS), _run(ew, TOKENS), strict=True):
        for k in a:
            assert np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), k


def test_ew_swiglu_equals_the_device_numerics_reference_bit_for_bit(tiny_gm):
    from nhil.golden.quant_reference import QuantReference

    prog = _compile(tiny_gm, ("ew-swiglu", "ew-residual", "host-overlap"))
    assert len(prog.info["ew_silu"]) == 2 and not any(prog.host_ops[i.imm].kernel == "silu_mul" for i in prog.instrs if i.op is Op.HOST)
    got = _run(prog, TOKENS)
    ref = QuantReference(tiny_gm, ew_silu=prog.info["ew_silu"])
    host_ref = QuantReference(tiny_gm)
    differs = False
    for pos, t in enumerate(TOKENS):
        r = ref.step(t, pos)
        h = host_ref.step(t, pos)
        for k in r:
            assert np.array_equal(r[k].view(np.uint32), got[pos][k].view(np.uint32)), (pos, k)
        differs |= not np.array_equal(h["logits"].view(np.uint32), r["logits"].view(np.uint32))
    assert differs  # the LUT SiLU really is different arithmetic from the host's fp32 silu (the reference models it)


@pytest.mark.sim
def test_verify_passes_both_tiers_with_the_elementwise_passes(tmp_path):
    from nhil.compiler.pipeline import DEFAULT_PASSES
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=8, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r",
                               passes=tuple(DEFAULT_PASSES) + ("ew-swiglu", "ew-residual", "host-overlap")))
    assert rep["outcome"] == "PASS", rep.get("error") or rep.get("divergence_summary")
    checks = {c["name"]: c["passed"] for c in rep["checks"]}
    assert checks["tight_bit_identical_to_reference"] and checks["logits_within_tolerance"] and checks["teacher_forced_top1"]
    assert "ew-swiglu" in rep["passes"]


def test_prefill_of_a_program_with_elementwise_ops_equals_the_per_token_path():
    """The prefill transform (nhil.compiler.prefill) on a program with EWMUL / EWADD / AF: segments holding them run per
    token (EW ops act on accumulator set 0 only), so the prompt's outputs and KV rows equal the per-token path's bit for bit."""
    from nhil.compiler import pipeline
    from nhil.compiler.pipeline import DEFAULT_PASSES
    from nhil.models import get_model

    torch.manual_seed(0)
    prog = pipeline.compile(get_model("llama-tiny", seed=0), "aim-like", "bf16", list(DEFAULT_PASSES) + ["ew-swiglu", "ew-residual", "host-overlap"],
                            max_cache_len=24).program
    assert prog.info["ew_silu"] and prog.info["ew_add"]
    tokens = [5, 17, 3, 99, 42, 7, 1, 64, 23, 8, 2, 77, 31, 50, 6, 19, 11, 4]
    from prefill_paths import per_token_and_prefill

    res = [r[:3] for r in per_token_and_prefill(prog, tokens)]
    (oa, na, ma), (ob, nb, mb) = res
    for x, y in zip(oa, ob, strict=True):
        for k in x:
            assert np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)), k
    assert ma.keys() == mb.keys() and all(np.array_equal(ma[r], mb[r]) for r in ma)
    assert np.array_equal(na.view(np.uint32), nb.view(np.uint32))
