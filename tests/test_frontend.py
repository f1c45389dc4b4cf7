"""Compiler frontend: export, exact raising into nhil primitives, primitive reference kernels."""

from __future__ import annotations

import math
import operator
import re

import pytest
import torch

from nhil.compiler import check_raised_exact, export_decode, export_prefill, raise_graph
from nhil.compiler.check import _call_exported
from nhil.errors import CompileError
from nhil.models import get_model

nhil = torch.ops.nhil
L = 16


@pytest.fixture(scope="module")
def tiny():
    return get_model("llama-tiny").model


@pytest.fixture(scope="module")
def decode(tiny):
    ep, example = export_decode(tiny, L)
    return ep, raise_graph(ep, "decode")


def _caches(mod, names):
    return {n: mod.get_buffer(n) for n in names}


# ------------------------------------------------------------------ raising, exactness


def test_prefill_raising_bit_exact_on_two_prompts(tiny):
    g = torch.Generator().manual_seed(1234)
    ep = export_prefill(tiny, torch.randint(0, 256, (1, 9), generator=g))
    raised = raise_graph(ep, "prefill")
    for _ in range(2):
        check_raised_exact(ep, raised, (torch.randint(0, 256, (1, 9), generator=g),))
    logits = raised.gm(torch.randint(0, 256, (1, 9), generator=g))
    assert logits.shape == (1, 9, 256) and logits.dtype == torch.float32


def test_decode_steps_bit_exact_and_match_eager(tiny, decode):
    ep, raised = decode
    em, gm = ep.module(), raised.gm
    ce, cg = _caches(em, raised.cache_names), _caches(gm, raised.cache_names)
    for t in (*ce.values(), *cg.values()):
        t.zero_()
    tokens, step_logits = [17], []
    with torch.no_grad():
        for pos in range(10):  # caches carried across steps on both sides
            inputs = (torch.tensor([[tokens[-1]]]), torch.tensor([pos]))
            want = _call_exported(ep, em, inputs)
            got = gm(*inputs)
            assert torch.equal(got, want), f"logits differ at position {pos}"
            for name in raised.cache_names:
                assert torch.equal(ce[name], cg[name]), f"{name} differs at position {pos}"
            step_logits.append(got[0, -1])
            tokens.append(int(got[0, -1].argmax()))
        eager = tiny(torch.tensor([tokens[:-1]]), use_cache=False).logits[0]
    assert (torch.stack(step_logits) - eager).abs().max().item() < 1e-5
    for t in cg.values():
        t.zero_()


def test_decode_counts_and_graph_ir_shape(decode):
    ep, raised = decode
    n_layers = 2
    assert raised.counts == {
        "nhil::add": 2 * n_layers,
        "nhil::attention_kv": n_layers,
        "nhil::embedding": 1,
        "nhil::linear": 7 * n_layers + 1,
        "nhil::rms_norm": 2 * n_layers + 1,
        "nhil::rope": 2 * n_layers,
        "nhil::rope_cos_sin": 1,
        "nhil::silu_mul": n_layers,
    }
    assert raised.unraised == []
    g = raised.gm.graph
    assert [n.name for n in g.nodes if n.op == "placeholder"] == ["input_ids", "cache_position"]
    attrs = {n.target for n in g.nodes if n.op == "get_attr"}
    assert {"model.model.layers.0.self_attn.q_proj.weight", "model.model.rotary_emb.inv_freq", "key_cache_0", "value_cache_1"} <= attrs
    for n in g.nodes:
        if n.op == "call_function":
            assert n.target is operator.getitem or (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "nhil"), n
            assert isinstance(n.meta["val"], (torch.Tensor, tuple)) and isinstance(n.meta["nn_module_stack_path"], str)
    att = next(n for n in g.nodes if n.target == nhil.attention_kv.default)
    assert att.meta["nn_module_stack_path"].endswith("layers.0.self_attn")
    lm_head = [n for n in g.nodes if n.target == nhil.linear.default][-1]
    assert lm_head.args[1].target.endswith("embed_tokens.weight")  # tied LM head
    assert tuple(g.output_node().args[0].meta["val"].shape) == (1, 1, 256)


def test_an_op_no_pattern_raises_runs_as_exact_host_aten():
    """A new activation (erf GELU) in the MLP: no pattern raises it, so it runs on the host as the
    exported op, and the raised graph is still bit-identical (raise_graph checks it)."""
    from nhil.models.llama import build_llama_tiny

    model = build_llama_tiny().model  # a private copy: the registry's shared model stays untouched
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    ep, _ = export_decode(model, 8)
    raised = raise_graph(ep, "decode")
    assert raised.host_aten.get("aten.gelu.default") == 1 and raised.host_aten.get("aten.mul.Tensor") == 1
    assert raised.counts["nhil::silu_mul"] == 1  # layer 1 keeps its SwiGLU primitive
    assert raised.counts["nhil::linear"] == 7 * 2 + 1  # every projection is still a PIM GEMV
    assert ("model.model.layers.0.mlp.act_fn", "GELU", "host ATen") in raised.raised_by


def test_a_gemv_no_pattern_raises_is_a_compile_error_naming_it():
    from nhil.models.llama import build_llama_tiny

    model = build_llama_tiny().model
    from tests.test_host_aten import InlineDown  # an MLP whose down projection is matmul(h, W.t())

    model.model.layers[1].mlp = InlineDown(model.model.layers[1].mlp)
    ep, _ = export_decode(model, 8)
    with pytest.raises(CompileError) as err:
        raise_graph(ep, "decode")
    msg = str(err.value)
    assert "model.layers.1.mlp" in msg and "down_proj.weight" in msg and "PIM-bound" in msg, msg
    assert re.search(r"\.py:\d+", msg)


@pytest.mark.real
@pytest.mark.slow
def test_real_llama_decode_raises_exactly():
    model = get_model("llama").model
    ep, _ = export_decode(model, 64)
    raised = raise_graph(ep, "decode")  # checks bit-exactness at positions 0 and 32
    assert raised.counts["nhil::attention_kv"] == 30 and raised.counts["nhil::linear"] == 7 * 30 + 1
    assert raised.unraised == []


# ------------------------------------------------------------------ primitive reference kernels


def test_rms_norm_linear_embedding_silu_add_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 32, generator=g), torch.randn(32, generator=g)
    want = w * x / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6).float()
    torch.testing.assert_close(nhil.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-5)
    wl, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    torch.testing.assert_close(nhil.linear(x, wl, b), x @ wl.T + b)
    torch.testing.assert_close(nhil.linear(x, wl, None), x @ wl.T)
    table, ids = torch.randn(50, 32, generator=g), torch.randint(0, 50, (2, 5), generator=g)
    assert torch.equal(nhil.embedding(table, ids), table[ids])
    gate, up = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    torch.testing.assert_close(nhil.silu_mul(gate, up), gate / (1 + torch.exp(-gate)) * up)
    assert torch.equal(nhil.add(gate, up), gate + up)


def test_rope_reference_vs_complex_rotation():
    g = torch.Generator().manual_seed(1)
    nh, hd, S = 3, 16, 6
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    pos = torch.tensor([[0, 1, 2, 5, 9, 100]])
    cos, sin = nhil.rope_cos_sin(pos, inv_freq, 1.0)
    assert cos.shape == (1, S, hd)
    x = torch.randn(1, S, nh * hd, generator=g)
    got = nhil.rope(x, cos, sin, hd).view(1, S, nh, hd)
    xh = x.view(1, S, nh, hd).double()
    z = torch.complex(xh[..., : hd // 2], xh[..., hd // 2 :])  # rotate-half pairs (i, i + hd/2)
    angle = pos[0].double()[:, None] * inv_freq.double()[None, :]
    r = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    want = torch.cat([r.real, r.imag], -1).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _loop_attention(q, kc, vc, qpos, hq, hkv, scale):
    """softmax(q k^T * scale) v, one query and head at a time, keys j <= qpos[i]."""
    B, S, _ = q.shape
    hd = kc.shape[-1]
    out = torch.zeros(B, S, hq * hd, dtype=torch.float64)
    for b in range(B):
        for h in range(hq):
            kvh = h // (hq // hkv)
            for i in range(S):
                qi = q[b, i, h * hd:(h + 1) * hd].double()
                n = int(qpos[i]) + 1
                scores = torch.stack([qi @ kc[b, kvh, j].double() * scale for j in range(n)])
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                out[b, i, h * hd:(h + 1) * hd] = sum(p[j] * vc[b, kvh, j].double() for j in range(n))
    return out.float()


def test_attention_kv_reference_vs_loop():
    g = torch.Generator().manual_seed(2)
    hq, hkv, hd, Lc, S = 4, 2, 8, 10, 2
    q = torch.randn(1, S, hq * hd, generator=g)
    k, v = torch.randn(1, S, hkv * hd, generator=g), torch.randn(1, S, hkv * hd, generator=g)
    kc, vc = torch.randn(1, hkv, Lc, hd, generator=g), torch.randn(1, hkv, Lc, hd, generator=g)
    cp = torch.tensor([4, 5])
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref[:, :, cp] = k.view(1, S, hkv, hd).transpose(1, 2)
    vc_ref[:, :, cp] = v.view(1, S, hkv, hd).transpose(1, 2)
    out = nhil.attention_kv(q, k, v, kc, vc, cp, hq, hkv, 0.3)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out, _loop_attention(q, kc_ref, vc_ref, cp, hq, hkv, 0.3), rtol=1e-5, atol=1e-5)


def test_attention_prefill_reference_vs_loop():
    g = torch.Generator().manual_seed(3)
    hq, hkv, hd, S = 6, 3, 8, 5
    q = torch.randn(1, S, hq * hd, generator=g)
    k, v = torch.randn(1, S, hkv * hd, generator=g), torch.randn(1, S, hkv * hd, generator=g)
    kh, vh = k.view(1, S, hkv, hd).transpose(1, 2), v.view(1, S, hkv, hd).transpose(1, 2)
    want = _loop_attention(q, kh, vh, torch.arange(S), hq, hkv, 1 / math.sqrt(hd))
    torch.testing.assert_close(nhil.attention(q, k, v, hq, hkv, 1 / math.sqrt(hd)), want, rtol=1e-5, atol=1e-5)


def test_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 3, 64), torch.empty(1, 3, 32)
        kc = torch.empty(1, 2, 8, 16)
        assert nhil.attention_kv(q, k, k, kc, kc.clone(), torch.zeros(3, dtype=torch.long), 4, 2, 0.25).shape == (1, 3, 64)
        cos, sin = nhil.rope_cos_sin(torch.zeros(1, 3, dtype=torch.long), torch.empty(8), 1.0)
        assert cos.shape == sin.shape == (1, 3, 16)
        assert nhil.embedding(torch.empty(10, 64), torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 64)
        assert nhil.linear(q, torch.empty(5, 64), None).shape == (1, 3, 5)
