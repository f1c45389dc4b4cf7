"""The prefill extension (MAC_ABV, global buffers and accumulator sets) and the prefill program.

References: the per-token path (the decode program run once per prompt token), ISA v0's
MAC_AB with each vector in the global buffer, and ``nhil.numerics.mac.mac_bursts``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nhil.compiler.prefill import PrefillUnsupported, prefill_program
from nhil.errors import ProgramFormatError, RunError
from nhil.isa import DEVICE_PRESETS, Instr, Op
from nhil.isa.instr import ALL_CH, FLAG_POS_SLOT
from nhil.isa.semantics import check_instr
from nhil.numerics.bf16 import f32_to_bf16_bits
from nhil.runtime.executor import Runner
from nhil.runtime.generate import prefill_runner, run_teacher_forced
from nhil.targets.base import ResolvedInstr
from nhil.targets.sim import SimTarget
from nhil.targets.sim.device import PimState
from nhil.targets.sim.fast import FastPimState
from prefill_paths import per_token_and_prefill as _per_token_and_prefill

DEV = dataclasses.replace(DEVICE_PRESETS["rtl-tiny2"], name="tiny-v4", vectors=4)  # 2 ch x 16 banks, 128-element rows


def _random_state(cls, rng, special=False):
    st = cls(DEV)
    st.load_images([])
    s = st.slot(3, allocate=True)
    w = rng.standard_normal((DEV.channels, DEV.banks, DEV.cols)).astype(np.float32)
    if special:
        w.reshape(-1)[:5] = [np.inf, -np.inf, np.nan, 0.0, -0.0]
    st.mem[:, :, s, :] = f32_to_bf16_bits(w)
    return st


def _gb(rng, n):
    return f32_to_bf16_bits(rng.standard_normal(n).astype(np.float32) * 3)


@pytest.mark.parametrize("cls", [PimState, FastPimState])
@pytest.mark.parametrize("special", [False, True])
def test_mac_abv_equals_mac_ab_with_each_vector_in_the_global_buffer(cls, special):
    """ACC_j after MAC_ABV == ACC after MAC_AB with GB_j's contents in GB, bit for bit, for every set and accumulator."""
    rng = np.random.default_rng(1)
    nb = DEV.gb_elems // DEV.lanes
    vecs = [_gb(rng, DEV.gb_elems) for _ in range(3)]
    st = _random_state(cls, np.random.default_rng(0), special)
    for j, v in enumerate(vecs):
        st.step(0, Instr(Op.WR_GB, ALL_CH, bank=j, col=0, n=nb), v)
        st.step(0, Instr(Op.WR_ACC, ALL_CH, bank=j, k=2, col=0, n=DEV.slots), np.full(DEV.slots, 0.5 * j, np.float32))
    ins = Instr(Op.MAC_ABV, ALL_CH, row=3, col=1, n=nb - 2, k=2, imm=3)
    if cls is FastPimState:
        st.run_block([ResolvedInstr(0, ins)], type("D", (), {"add": lambda *a: None, "sync": lambda *a: None})())
        assert st.counts["MAC_ABV"] == 1
    else:
        st.step(0, ins, None)
    got = [st.step(0, Instr(Op.RD_ACC, ALL_CH, bank=j, k=2, col=0, n=DEV.slots), None) for j in range(3)]
    for j, v in enumerate(vecs):
        ref = _random_state(PimState, np.random.default_rng(0), special)
        ref.step(0, Instr(Op.WR_GB, ALL_CH, col=0, n=nb), v)
        ref.step(0, Instr(Op.WR_ACC, ALL_CH, k=2, col=0, n=DEV.slots), np.full(DEV.slots, 0.5 * j, np.float32))
        ref.step(0, Instr(Op.MAC_AB, ALL_CH, row=3, col=1, n=nb - 2, k=2), None)
        want = ref.step(0, Instr(Op.RD_ACC, ALL_CH, k=2, col=0, n=DEV.slots), None)
        assert np.array_equal(got[j].view(np.uint32), want.view(np.uint32)), j
    assert not np.array_equal(got[0], got[1])  # the sets saw different vectors


def test_extension_fields_are_bounded_by_the_device():
    base = DEVICE_PRESETS["rtl-tiny"]  # vectors = 1: no extension
    assert "vectors" in check_instr(Instr(Op.MAC_ABV, ALL_CH, row=0, col=0, n=1, imm=2), base)
    assert "global buffer 1 >= 1" in check_instr(Instr(Op.WR_GB, ALL_CH, bank=1, col=0, n=1), base)
    assert "accumulator set 4 >= 4" in check_instr(Instr(Op.RD_ACC, ALL_CH, bank=4, col=0, n=1), DEV)
    assert check_instr(Instr(Op.MAC_ABV, ALL_CH, row=0, col=0, n=DEV.cols // DEV.lanes, imm=4), DEV) is None
    st = PimState(DEV)
    st.step(0, Instr(Op.SET_CFR, ALL_CH, k=1, imm=0x30), None)
    with pytest.raises(RunError, match="MAC_ABV reads bf16 rows only"):
        st.step(1, Instr(Op.MAC_ABV, ALL_CH, row=0, col=0, n=1, imm=2), None)


def test_token_offset_byte_round_trips_and_is_refused_without_a_position_flag():
    ins = Instr(Op.WR_SBK, FLAG_POS_SLOT, row=4, col=1, imm=0xFFFF, operand=0, tok=37)
    assert Instr.decode(ins.encode()) == ins
    word = bytearray(Instr(Op.WR_GB, ALL_CH, n=1, operand=0).encode())
    word[13] = 5
    with pytest.raises(ProgramFormatError, match="token offset byte is 0x05 without a position flag"):
        Instr.decode(bytes(word), 7)


def _compile(name, quant="bf16", device="aim-like"):
    from nhil.compiler.pipeline import compile
    from nhil.models import get_model

    torch.manual_seed(0)
    return compile(get_model(name, seed=0), device, quant, max_cache_len=24).program


def _assert_same(a, b):
    (oa, na, ma, _), (ob, nb, mb, _) = a, b
    assert len(oa) == len(ob)
    for t, (x, y) in enumerate(zip(oa, ob)):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)), f"token {t}: {k}"
    assert ma.keys() == mb.keys() and all(np.array_equal(ma[r], mb[r]) for r in ma), "KV-cache / bank rows differ"
    assert np.array_equal(na.view(np.uint32), nb.view(np.uint32)), "the decode step after the prefill differs"


# GQA + RoPE, sliding window + softcap, LayerNorm/bias/learned positions, QKV bias
@pytest.mark.parametrize("name", ["llama-tiny", "gemma2", "gpt2", "qwen2"])
def test_prefill_equals_the_per_token_path_bit_for_bit(name):
    prog = _compile(name)
    a, b = _per_token_and_prefill(prog, [5, 17, 3, 99, 42, 7, 1, 64, 23, 8, 2, 77, 31, 50, 6, 19, 11, 4])  # 18 tokens: two MAC_ABV batches of 16 + 2
    _assert_same(a, b)
    assert b[3]["MAC_ABV"] > 0 and "MAC_ABV" not in a[3]


def test_prefill_on_the_reference_simulator():
    a, b = _per_token_and_prefill(_compile("llama-tiny"), [5, 17, 3, 99, 42], reference=True)
    _assert_same(a, b)


def test_prefill_with_quantized_weights_and_a_device_without_the_extension():
    """Quantized GEMVs stay per-token MAC_ABs; on a device with vectors = 1 no MAC_ABV is emitted at all."""
    a, b = _per_token_and_prefill(_compile("llama-tiny", "q4_1:lm_head=mxfp4"), [5, 17, 3, 99])
    _assert_same(a, b)
    _assert_same(*_per_token_and_prefill(_compile("llama-tiny", "bf16:kv_cache=fp8"), [5, 17, 3, 99]))  # raw-word K rows, byte Vᵀ appends
    prog = _compile("llama-tiny", device="fpga-small")
    pf = prefill_program(prog, 4)
    assert Op.MAC_ABV not in pf.required_ops() and pf.info["prefill"]["vectors"] == 1
    _assert_same(*_per_token_and_prefill(prog, [5, 17, 3, 99]))


def test_prefill_refuses_moe_dispatch_and_falls_back_to_per_token():
    prog = _compile("qwen2_moe")
    with pytest.raises(PrefillUnsupported, match="MoE expert dispatch"):
        prefill_program(prog, 4)
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    pf, why = prefill_runner(r, 4)
    assert pf is None and "moe_dispatch" in why


def test_prefill_detects_a_missing_token_offset():
    """Mutation check: KV appends bound at $pos (tok dropped) put every token's K/V at one position."""
    prog = _compile("llama-tiny")
    pf = prefill_program(prog, 4)
    broken = dataclasses.replace(pf, instrs=[i._replace(tok=0) for i in pf.instrs])
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    r.reset()
    good = [o["logits"].copy() for o in _attached(pf, r).prefill([5, 17, 3, 99], 0)]
    r.reset()
    bad = [o["logits"].copy() for o in _attached(broken, r).prefill([5, 17, 3, 99], 0)]
    assert not np.array_equal(good[0], bad[0])  # every token appended at position 0: token 0 sees the last token's K/V


def _attached(p, r):
    x = Runner(p, r.t)
    x.attach(r)
    return x


def test_teacher_forced_run_with_prefill_equals_per_token_run():
    prog = _compile("llama-tiny")
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    prompt, gold = [5, 17, 3, 99, 42, 7], [1, 2, 3, 4]
    a = run_teacher_forced(r, prompt, gold)
    pf, _ = prefill_runner(r, len(prompt))
    b = run_teacher_forced(r, prompt, gold, prefill=pf)
    assert np.array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))
    assert a.acts.keys() == b.acts.keys() and all(np.array_equal(a.acts[k], b.acts[k]) for k in a.acts)


def test_verify_runs_the_prompt_as_a_prefill_program_and_checks_its_outputs(tmp_path, monkeypatch):
    """verify's prompt goes through the prefill program (report), and a MAC_ABV bug is caught by the tight
    tier at a prompt position, where only the prefill program ran."""
    from nhil.targets.sim import kernels
    from nhil.verify import VerifyOptions, verify

    dirs = dict(goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs")
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=2, **dirs))
    assert rep["outcome"] == "PASS", rep.get("error") or rep["checks"]
    n = len(rep["prompt_ids"])
    assert rep["prefill"]["mode"] == "program" and rep["prefill"]["tokens"] == n and rep["prefill"]["vectors"] == 16
    assert "ran as one prefill program" in open(rep["run_dir"] + "/report.md").read()
    real = kernels.mac_bf16_vec
    monkeypatch.setattr(kernels, "mac_bf16_vec", lambda mem, gbs, accs, c0, c1, s, k, col, n_, nv: real(mem, gbs, accs, c0, c1, s, k, col, max(1, n_ - 1), nv))
    bad = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=2, **dirs))
    assert bad["outcome"] == "MISMATCH" and "tight" in bad["failed_tier"]
    fd = bad["tight"]["first_difference"]
    assert fd["position"] < n, fd  # inside the prompt: the prefill program's output


def test_targets_without_the_extension_refuse_mac_abv_and_get_a_prefill_program_without_it():
    from nhil.errors import LoadError
    from nhil.numerics.formats import DEVICE_FORMATS
    from nhil.targets.base import DEVICE_OPS, Capabilities, check_program_fits

    prog = _compile("llama-tiny")
    caps = Capabilities(0, DEVICE_OPS, DEVICE_FORMATS, prog.device)  # what the RTL and the FPGA board claim
    with pytest.raises(LoadError, match="does not implement MAC_ABV"):
        check_program_fits(prefill_program(prog, 4), caps, "fpga")
    plain = prefill_program(prog, 4, extension=False)
    check_program_fits(plain, caps, "fpga")
    assert Op.MAC_ABV not in plain.required_ops()


def test_a_prefill_program_round_trips_through_pimb_and_pims():
    from nhil.isa.asm import assemble, disassemble
    from nhil.isa.program import Program

    pf = prefill_program(_compile("llama-tiny"), 3)
    blob = pf.encode()
    back = Program.decode(blob)
    assert back.instrs == pf.instrs and any(i.tok for i in back.instrs) and any(i.op is Op.MAC_ABV for i in back.instrs)
    assert assemble(disassemble(back, full=True)).encode() == blob
