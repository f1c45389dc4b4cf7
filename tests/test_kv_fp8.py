"""FP8 KV cache (issue 20 item 3, ``nhil.numerics.kv_fp8``): E4M3 K/V rows written and read in PIM.

The simulator equals the quantized reference bit for bit with the cache in fp8; the cache bytes the
simulator holds are torch's float8_e4m3fn codes of the reference's k/v; the byte-write WR_SBK, the
binder of the Vᵀ byte and the ISA checks against hand cases.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nhil.isa import DEVICE_PRESETS


def _bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def tiny():
    from nhil.compiler import export_decode, raise_graph
    from nhil.models import get_model

    b = get_model("llama-tiny")
    return b, {L: raise_graph(export_decode(b.model, L)[0], "decode").gm for L in (16, 48)}


def _run(gm, recipe, device, prompt, tokens):
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.quantize import build_plan
    from nhil.golden.quant_reference import QuantReference
    from nhil.runtime import Runner
    from nhil.runtime.generate import run_teacher_forced
    from nhil.targets import get_target

    plan = build_plan(recipe, gm)
    prog = lower_decode_graph(gm, device, quant=plan)
    t = get_target("sim")
    t.open()
    t.load(prog)
    sim = run_teacher_forced(Runner(prog, t), prompt, tokens)
    ref = QuantReference(gm, plan)
    out = run_teacher_forced(ref, prompt, tokens)
    return prog, t, sim, ref, out


# a device with 32-column rows: 48 cache positions span two Vᵀ rows per slot group
SMALL = dataclasses.replace(DEVICE_PRESETS["rtl-tiny"], name="kv-small", row_bytes=64)


@pytest.mark.parametrize("recipe,dev,L", [("bf16:kv_cache=fp8", "aim-like", 16), ("int4-g128:kv_cache=fp8", "aim-like", 16),
                                           pytest.param("bf16:kv_cache=fp8", "small", 48, marks=pytest.mark.slow)])
def test_fp8_kv_cache_sim_equals_reference_bit_for_bit(recipe, dev, L, tiny):
    """Logits of every step and the residual stream at every position: simulator == quantized reference (bits)."""
    bundle, gms = tiny
    device = SMALL if dev == "small" else DEVICE_PRESETS[dev]
    prompt = bundle.encode(None)
    tokens = [3, 5, 7, 11, 2] if L == 16 else [int(x) for x in np.random.default_rng(1).integers(0, 200, L - len(prompt))]
    prog, t, sim, _, ref = _run(gms[L], recipe, device, prompt, tokens)
    t.close()
    assert prog.info["kv_cache"] == "fp8" and {"fp8-e4m3", "fp8-e4m3-b16"} <= set(prog.info["weight_formats"])
    assert np.array_equal(_bits(sim.logits), _bits(ref.logits))
    assert set(sim.acts) == set(ref.acts) and all(np.array_equal(_bits(sim.acts[k]), _bits(ref.acts[k])) for k in sim.acts)


def test_fp8_kv_cache_changes_the_result_and_stays_close(tiny):
    """The fp8 cache is not the bf16 one (the comparison above can fail), and its logits stay near (SQNR > 10 dB)."""
    bundle, gms = tiny
    prompt, toks = bundle.encode(None), [3, 5, 7]
    *_, fp8 = _run(gms[16], "bf16:kv_cache=fp8", DEVICE_PRESETS["aim-like"], prompt, toks)
    *_, bf16 = _run(gms[16], "bf16:lm_head=bf16", DEVICE_PRESETS["aim-like"], prompt, toks)
    a, b = np.asarray(fp8.logits, np.float64), np.asarray(bf16.logits, np.float64)
    assert (a != b).mean() > 0.9
    assert 10 * np.log10((b**2).sum() / ((a - b) ** 2).sum()) > 10


def test_cache_bytes_in_the_banks_are_torch_float8_codes(tiny):
    """After 9 positions, every K row record and Vᵀ byte the simulator holds equals ``(x / s).to(torch.float8_e4m3fn)``
    of the reference's cached k / v (scales 1.0, the fp32 scale in each record / row header)."""
    bundle, gms = tiny
    gm = gms[16]
    prompt, toks = bundle.encode(None), [3, 5, 7, 9]
    prog, t, _, ref, _ = _run(gm, "bf16:kv_cache=fp8", DEVICE_PRESETS["aim-like"], prompt, toks)
    d = prog.device
    n = len(prompt) + len(toks) - 1
    attn = [n for n in gm.graph.nodes if n.op == "call_function" and "attention_kv" in str(n.target)]  # graph order = layer order
    kc = [ref.caches[n.args[3].target] for n in attn]
    vc = [ref.caches[n.args[4].target] for n in attn]
    assert len(kc) == len(vc) == 2
    for layer, lay in prog.info["kv_layout"].items():
        lay = {k: int(v) for k, v in lay.items()}
        hkv, hd = lay["kv_heads"], lay["head_dim"]
        kv = kc[int(layer)][0].to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # [hkv, L, hd], scale 1
        vv = vc[int(layer)][0].to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        for pos in range(n):
            slot = pos % d.slots
            row = np.ascontiguousarray(t.read_row(slot // d.banks, slot % d.banks, lay["k_base"] + pos // d.slots), "<u2").view(np.uint8)
            for h in range(hkv):
                rec = row[h * (hd + 4) : (h + 1) * (hd + 4)]
                assert rec[:4].view("<f4")[0] == 1.0 and np.array_equal(rec[4:], kv[h, pos]), (layer, pos, h)
        for u in range(hkv * hd):
            g, s = divmod(u, d.slots)
            row = np.ascontiguousarray(t.read_row(s // d.banks, s % d.banks, lay["v_base"] + g * lay["v_rows_per_group"]), "<u2").view(np.uint8)
            assert row[:4].view("<f4")[0] == 1.0
            assert np.array_equal(row[4 : 4 + n], vv[u // hd, :n, u % hd]), (layer, u)
            assert not row[4 + n :].any()  # positions not yet written stay zero
    t.close()


def test_k_row_words_equal_torch_float8_and_saturate():
    from nhil.numerics.kv_fp8 import k_row_words

    rng = np.random.default_rng(0)
    k = (rng.normal(size=2 * 16) * 40).astype(np.float32)
    k[3], k[20] = 1e6, -1e6  # saturate to +-448
    s = np.array([0.5, 2.0], np.float32)
    w = k_row_words(k, s, 16).view(np.uint8).reshape(2, 20)
    want = (torch.from_numpy(k.reshape(2, 16)) / torch.from_numpy(s)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(w[:, 4:], want) and list(w[:, :4].copy().view("<f4")[:, 0]) == [0.5, 2.0]
    assert w[0, 4 + 3] == 0x7E and w[1, 4 + 4] == 0xFE  # 448, -448


def test_wr_sbk_byte_select_hand_case():
    """k=1 writes the low byte, k=2 the high byte of each masked lane, from the payload's low byte; k=0 whole words."""
    from nhil.isa.instr import Instr, Op
    from nhil.targets.base import ResolvedInstr
    from nhil.targets.sim.target import SimTarget

    d = DEVICE_PRESETS["rtl-tiny"]
    with SimTarget() as t:
        from nhil.isa.program import Program

        t.load(Program(d, [Instr(Op.SYNC), Instr(Op.EOC)], [], [], {}, [], {}, {"inputs": {}, "outputs": {}}, {}))
        word = lambda k, imm, p: ResolvedInstr(0, Instr(Op.WR_SBK, 0, ch=0, bank=2, row=5, col=1, k=k, imm=imm), np.asarray(p, np.uint16))  # noqa: E731
        t.execute([word(0, 0xFFFF, [0xAAAA] * 16)])
        t.execute([word(1, 0b101, [0x1234] * 16), word(2, 0b110, [0x00CD] * 16)])
        r = t.read_row(0, 2, 5)[16:19]
        assert [hex(x) for x in r] == ["0xaa34", "0xcdaa", "0xcd34"]


def test_v_byte_binding_and_isa_checks():
    from nhil.isa.instr import FLAG_POS_COL, Instr, Op
    from nhil.isa.semantics import check_instr
    from nhil.numerics.kv_fp8 import bind_v_byte

    # position t -> byte 4 + t % cols: t = 0 -> word 2 low byte; t = 1 -> word 2 high; t = 29 -> byte 33 = word 16 (burst 1, lane 0) high
    assert bind_v_byte(0, 32, 16) == (0, 0, 2, 1) and bind_v_byte(1, 32, 16) == (0, 0, 2, 2)
    assert bind_v_byte(29, 32, 16) == (0, 1, 0, 2) and bind_v_byte(32, 32, 16) == (1, 0, 2, 1)
    d = DEVICE_PRESETS["rtl-tiny"]
    assert check_instr(Instr(Op.WR_SBK, FLAG_POS_COL, row=1, k=3), d, 1) is None
    assert "byte select k=3" in check_instr(Instr(Op.WR_SBK, 0, row=1, k=3), d, 16)
    assert "byte select k=4" in check_instr(Instr(Op.WR_SBK, 0, row=1, k=4), d, 16)


def test_verify_kv_cache_fp8_passes_on_sim_and_is_skipped_on_rtl(tmp_path):
    from nhil.args import UsageError
    from nhil.verify import VerifyOptions, verify

    kw = dict(model="llama-tiny", tokens=3, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r", kv_cache="fp8")
    rep = verify(VerifyOptions(target="sim", **kw))
    assert rep["outcome"] == "PASS" and rep["tight"]["passed"] and rep["quant"]["recipe"] == "bf16:kv_cache=fp8"
    rep = verify(VerifyOptions(target="rtl", **kw))
    assert rep["outcome"] == "SKIPPED" and "fp8-e4m3-b16" in rep["error"]
    with pytest.raises(UsageError, match="one of bf16, fp8"):
        VerifyOptions(model="llama-tiny", kv_cache="fp16")
    with pytest.raises(UsageError, match="contradicts"):
        VerifyOptions(model="llama-tiny", quant="int8:kv_cache=bf16", kv_cache="fp8")
