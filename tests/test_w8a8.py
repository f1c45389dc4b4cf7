"""W8A8: per-token dynamic int8 / FP8 activations in the MAC (issue 20 item 4, ``nhil.numerics.act_quant``)."""

from __future__ import annotations

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
    return b, raise_graph(export_decode(b.model, 16)[0], "decode").gm


def _sim_ref(gm, recipe, prompt, tokens, device="aim-like"):
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.quantize import build_plan
    from nhil.golden.quant_reference import QuantReference
    from nhil.runtime import Runner
    from nhil.runtime.generate import run_teacher_forced
    from nhil.targets import get_target

    plan = build_plan(recipe, gm)
    prog = lower_decode_graph(gm, DEVICE_PRESETS[device], quant=plan)
    with get_target("sim") as t:
        t.load(prog)
        sim = run_teacher_forced(Runner(prog, t), prompt, tokens)
    return prog, sim, run_teacher_forced(QuantReference(gm, plan), prompt, tokens)


@pytest.mark.parametrize("recipe,device", [("int8:act=int8", "aim-like"), ("fp8-e4m3-pc:act=fp8", "aim-like"), ("int8:act=int8", "rtl-tiny"),
                                           ("int4-g128:act=int8,kv_cache=fp8", "aim-like")])
def test_w8a8_sim_equals_reference_bit_for_bit(recipe, device, tiny):
    bundle, gm = tiny
    prompt = bundle.encode(None)
    prog, sim, ref = _sim_ref(gm, recipe, prompt, [3, 5, 7, 11], device)
    assert sum(h.kernel == "act_quant" for h in prog.host_ops) == 15  # every quantized linear: 2 layers x 7 + the LM head
    assert np.array_equal(_bits(sim.logits), _bits(ref.logits))
    assert all(np.array_equal(_bits(sim.acts[k]), _bits(ref.acts[k])) for k in sim.acts)


def test_w8a8_changes_the_result(tiny):
    """8-bit activations are not the weight-only MAC (the comparison above can fail) and stay close (SQNR > 15 dB)."""
    bundle, gm = tiny
    prompt = bundle.encode(None)
    _, a, _ = _sim_ref(gm, "int8:act=int8", prompt, [3, 5])
    _, b, _ = _sim_ref(gm, "int8", prompt, [3, 5])
    x, y = np.asarray(a.logits, np.float64), np.asarray(b.logits, np.float64)
    assert (x != y).mean() > 0.9 and 10 * np.log10((y**2).sum() / ((x - y) ** 2).sum()) > 15


def test_quantize_activation_against_torch_and_hand_case():
    from nhil.golden.quant_reference import act_quant_torch
    from nhil.numerics.act_quant import quantize_activation
    from nhil.numerics.bf16 import round_to_bf16

    q, s = quantize_activation(np.array([1.0, -2.0, 0.25, 0.0], np.float32), "int8")
    assert s == np.float32(2.0) / np.float32(127) and list(q) == [64.0, -127.0, 16.0, 0.0]  # 63.5000x -> 64, 15.875 -> 16
    q, s = quantize_activation(np.array([448.0, -1.0, 3.0], np.float32), "fp8")
    assert s == 1.0 and list(q) == [448.0, -1.0, 3.0]
    rng = np.random.default_rng(3)
    for mode in ("int8", "fp8"):
        for _ in range(20):
            x = (rng.standard_t(3, size=96) * rng.uniform(0.01, 50)).astype(np.float32)
            q, s = quantize_activation(x, mode)
            tq, ts = act_quant_torch(torch.from_numpy(x), mode)
            assert np.array_equal(_bits(q), _bits(tq.numpy())) and np.float32(s) == ts.item()
            assert np.array_equal(_bits(q), _bits(round_to_bf16(q)))  # exact in bf16: WR_GB carries it unchanged
    q, s = quantize_activation(np.zeros(16, np.float32), "int8")
    assert s == 0 and not q.any()


def test_act_override_is_checked():
    from nhil.compiler.quantize import parse_recipe
    from nhil.errors import CompileError

    assert parse_recipe("int8:act=int8")[1] == [("act", "int8")]
    with pytest.raises(CompileError, match="activations are one of bf16, int8, fp8"):
        parse_recipe("int8:act=int4")
