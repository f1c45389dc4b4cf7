"""GPT-2 bring-up: the new reference kernels against the original transformers modules
(LayerNorm, NewGELUActivation, Conv1D, GPT2Attention, wte + wpe) on random inputs incl. the
edge cases that distinguish the variants, plus raising / lowering facts of the tiny gpt2.
Raising bit-exactness (decode) and sim verify run with the other families in tests/test_arch.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nhil.compiler import export_decode, export_prefill, raise_graph
from nhil.models import get_model

nhil = torch.ops.nhil


def _gpt2_config(**over):
    from nhil.models.zoo import build_config

    cfg = build_config("gpt2")
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


# ------------------------------------------------------------------ LayerNorm


def test_layer_norm_equals_gpt2_layernorm_modules():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(2, 7, 64, generator=g) * 3 + 5  # a large mean: centring matters
    x[0, 0] = 1.25  # a constant row: variance 0, the result is bias (eps keeps it finite)
    x[1, 3] *= 1e4  # a large-magnitude row
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    ln = GPT2Block(_gpt2_config(), layer_idx=0).ln_1  # nn.LayerNorm(n_embd, eps=layer_norm_epsilon)
    with torch.no_grad():
        ln.weight.normal_(generator=g)
        ln.bias.normal_(generator=g)
    got = nhil.layer_norm(x, ln.weight.detach(), ln.bias.detach(), ln.eps)
    assert torch.equal(got, ln(x).detach())
    assert torch.equal(got[0, 0], ln.bias.detach())  # (x - mean) == 0 exactly
    # independent formula (biased variance, eps inside the sqrt), fp64
    xd = x.double()
    ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + ln.eps) * ln.weight.double() + ln.bias.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    plain = torch.nn.LayerNorm(64, eps=1e-3, elementwise_affine=False)
    assert torch.equal(nhil.layer_norm(x, None, None, 1e-3), plain(x))


# ------------------------------------------------------------------ GELU


def test_gelu_new_equals_new_gelu_activation_and_differs_from_fused_tanh():
    from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation

    g = torch.Generator().manual_seed(21)
    x = torch.cat([torch.randn(20000, generator=g) * 3, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 8.0, -8.0, 30.0, -30.0, 1e4, -1e4, float("inf")])])
    got = nhil.gelu(x, "gelu_new")
    torch.testing.assert_close(got, NewGELUActivation()(x), rtol=0, atol=0)  # bit-exact
    # the spelled-out form is a different function of the bits than torch's fused tanh GELU:
    # matching it as F.gelu(approximate="tanh") would have been an approximation
    fused = torch.nn.functional.gelu(x, approximate="tanh")
    assert int((got != fused).sum()) > 50
    torch.testing.assert_close(got, fused, rtol=1e-5, atol=1e-6)
    # independent formula in fp64
    xd = x[:-1].double()
    ref = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    torch.testing.assert_close(got[:-1].double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(nhil.gelu(x, "tanh"), GELUTanh()(x))
    torch.testing.assert_close(nhil.gelu(x, "none"), GELUActivation()(x), rtol=0, atol=0, equal_nan=True)  # erf GELU(inf) is nan in both
    with pytest.raises(ValueError, match="gelu variant 'quick'"):
        nhil.gelu(x, "quick")


# ------------------------------------------------------------------ Conv1D as linear


# (nx, nf, input shape); 256 -> 64 with 5 rows is a case where a contiguous copy of Wᵀ is
# not bit-exact on this CPU build (primitives.linear_ref)
@pytest.mark.parametrize("nx,nf,shape", [(64, 192, (1, 1, 64)), (64, 192, (1, 12, 64)), (64, 192, (5, 64)), (256, 64, (1, 5, 256)), (100, 37, (1, 3, 100))])
def test_linear_with_transposed_view_equals_conv1d(nx, nf, shape):
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(22)
    conv = Conv1D(nf, nx)
    with torch.no_grad():
        conv.weight.normal_(0, 0.15, generator=g)
        conv.bias.normal_(0, 0.1, generator=g)
    x = torch.randn(*shape, generator=g)
    w = conv.weight.detach()
    got = nhil.linear(x, w.t(), conv.bias.detach())
    assert torch.equal(got, conv(x).detach())  # the transposed view: Conv1D's own addmm
    torch.testing.assert_close(got.double(), x.double() @ w.double() + conv.bias.double(), rtol=1e-5, atol=1e-5)


def test_gpt2_conv1d_weights_are_raised_as_transposed_views():
    model = get_model("gpt2").model
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")  # bit-exact at positions 0 and 8
    lins = [n for n in raised.gm.graph.nodes if n.target == nhil.linear.default]
    assert len(lins) == 9  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer + the tied lm_head
    conv = [n for n in lins if n.args[1].target.endswith("_t")]
    assert len(conv) == 8 and all(n.args[2] is not None for n in conv)
    for n in conv:
        wt = raised.gm.get_parameter(n.args[1].target)
        w = model.get_parameter(n.args[1].target.removeprefix("model.").removesuffix("_t"))
        assert wt.shape == (w.shape[1], w.shape[0]) and wt.stride() == (1, w.shape[1])
        assert wt.data_ptr() == w.data_ptr()  # a view of the parameter, no copy


# ------------------------------------------------------------------ attention (RoPE-less MHA)


def _loop_causal(q, k, v, nh, scale, positions, kv_len):
    """fp64 per-head loop: query at positions[i] attends keys 0..positions[i]."""
    S = q.shape[1]
    hd = q.shape[-1] // nh
    out = torch.zeros(1, S, nh * hd, dtype=torch.float64)
    for h in range(nh):
        sl = slice(h * hd, (h + 1) * hd)
        for i in range(S):
            p = int(positions[i])
            s = torch.stack([q[0, i, sl].double() @ k[0, j, sl].double() * scale for j in range(min(p + 1, kv_len))])
            w = torch.softmax(s, 0)
            out[0, i, sl] = sum(w[j] * v[0, j, sl].double() for j in range(len(w)))
    return out


@pytest.mark.parametrize("impl,layer_scaled", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_attention_equals_gpt2_attention(impl, layer_scaled):
    """nhil.narrow x3 + nhil.attention between c_attn and c_proj == GPT2Attention.forward
    (causal mask, no cache), for SDPA and eager (only SDPA, the default, is raised), and with scale_attn_by_inverse_layer_idx (the
    scale carried by the primitive is the module's, 1/sqrt(hd)/(layer+1))."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cfg = _gpt2_config(scale_attn_by_inverse_layer_idx=layer_scaled)
    cfg._attn_implementation = impl
    torch.manual_seed(23)
    attn = GPT2Attention(cfg, layer_idx=1).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(1, 9, 64)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]  # the mask GPT2Model builds (masking_utils)
    mask = causal if impl == "sdpa" else torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    want = attn(x, attention_mask=mask)[0].detach()
    assert attn.scaling == pytest.approx(0.25 / (2 if layer_scaled else 1))
    qkv = attn.c_attn(x).detach()
    q, k, v = (nhil.narrow(qkv, i * 64, 64) for i in range(3))
    core = nhil.attention(q, k, v, 4, 4, attn.scaling)
    got = attn.c_proj(core).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(core.double(), _loop_causal(q, k, v, 4, attn.scaling, torch.arange(9), 9), rtol=1e-5, atol=1e-5)


def test_attention_kv_mha_decode_equals_prefill_row_and_ignores_stale_cache():
    """Decode at position p over a static cache (positions > p hold garbage) equals row p of
    the causal prefill attention of the same q/k/v (MHA: num_heads == num_kv_heads)."""
    g = torch.Generator().manual_seed(24)
    nh, hd, L, S = 4, 16, 16, 11
    q, k, v = (torch.randn(1, S, nh * hd, generator=g) for _ in range(3))
    full = nhil.attention(q, k, v, nh, nh, 0.25)
    for p in (0, 5, S - 1):
        kc, vc = torch.randn(1, nh, L, hd, generator=g) * 50, torch.randn(1, nh, L, hd, generator=g) * 50
        kc[:, :, :p] = k[:, :p].view(1, p, nh, hd).transpose(1, 2)
        vc[:, :, :p] = v[:, :p].view(1, p, nh, hd).transpose(1, 2)
        out = nhil.attention_kv(q[:, p : p + 1], k[:, p : p + 1], v[:, p : p + 1], kc, vc, torch.tensor([p]), nh, nh, 0.25)
        torch.testing.assert_close(out, full[:, p : p + 1], rtol=1e-5, atol=1e-6)
        assert torch.equal(kc[:, :, p], k[0, p].view(nh, hd)[None])  # the step's key was written at p


# ------------------------------------------------------------------ learned absolute positions


def test_pos_embedding_equals_wte_plus_wpe():
    model = get_model("gpt2").model
    tr = model.transformer
    ids = torch.tensor([[3, 200, 7, 7, 255]])
    pos = torch.tensor([[0, 1, 2, 126, 127]])  # up to the last learned position
    tok = nhil.embedding(tr.wte.weight.detach(), ids)
    want = (tr.wte(ids) + tr.wpe(pos)).detach()
    assert torch.equal(nhil.pos_embedding(tok, tr.wpe.weight.detach(), pos), want)
    assert torch.equal(nhil.pos_embedding(tok[:, :1], tr.wpe.weight.detach(), torch.tensor([0])), want[:, :1])  # [S] positions
    # the decode program's host kernel: the step's position, and a clear error past n_positions
    from nhil.errors import RunError
    from nhil.runtime.host_kernels import KERNELS

    out = np.zeros(64, np.float32)
    KERNELS["pos_embedding"]([tok[0, 4].numpy(), tr.wpe.weight.detach().numpy(), 127], [out], {})
    assert np.array_equal(out, want[0, 4].numpy())
    with pytest.raises(RunError, match="beyond the 128 learned position embeddings"):
        KERNELS["pos_embedding"]([out, tr.wpe.weight.detach().numpy(), 128], [out], {})


def test_host_layer_norm_and_gelu_kernels_call_the_reference():
    from nhil.runtime.host_kernels import KERNELS

    g = torch.Generator().manual_seed(25)
    x, w, b = torch.randn(64, generator=g) * 4, torch.randn(64, generator=g), torch.randn(64, generator=g)
    out = np.zeros(64, np.float32)
    KERNELS["layer_norm"]([x.numpy(), w.numpy(), b.numpy()], [out], {}, eps=1e-5)
    assert np.array_equal(out, torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5).numpy())
    KERNELS["layer_norm"]([x.numpy(), b.numpy()], [out], {}, eps=1e-5, has_weight=False)
    assert np.array_equal(out, torch.nn.functional.layer_norm(x, (64,), None, b, 1e-5).numpy())
    from transformers.activations import NewGELUActivation

    KERNELS["gelu"]([x.numpy()], [out], {}, variant="gelu_new")
    assert np.array_equal(out, NewGELUActivation()(x).numpy())


# ------------------------------------------------------------------ raising / lowering of the tiny gpt2


def test_gpt2_prefill_raises_bit_exact():
    """Prefill computes the position ids inside the Model's mask region, after the ``wpe``
    lookup in graph order: raising visits regions in dependency order (Raiser._topological)."""
    ep = export_prefill(get_model("gpt2").model, torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(26)))
    raised = raise_graph(ep, "prefill")  # strict, two random prompts, bit-exact
    assert raised.counts == {"nhil::add": 4, "nhil::attention": 2, "nhil::embedding": 1, "nhil::gelu": 2, "nhil::layer_norm": 5,
                             "nhil::linear": 9, "nhil::narrow": 6, "nhil::pos_embedding": 1}


def test_gpt2_with_another_gelu_runs_the_exported_erf_gelu_on_the_host():
    """activation_function="gelu" (exact erf, GELUActivation) has no nhil primitive: it is not
    approximated by gelu_new but kept as the exported ``aten.gelu`` (host ATen), bit-exact
    (raise_graph checks the raised graph against the exported one on two prompts)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(activation_function="gelu")).eval()
    ep = export_prefill(model, torch.zeros(1, 4, dtype=torch.long))
    raised = raise_graph(ep, "prefill")
    assert raised.host_aten == {"aten.gelu.default": 2} and "nhil::gelu" not in raised.counts
    assert ("transformer.h.0.mlp.act", "GELUActivation", "host ATen") in raised.raised_by


def test_gpt2_lowering_places_conv1d_gemvs_in_pim_and_the_rest_on_the_host():
    from nhil.compiler.lower import lower_decode_graph
    from nhil.isa import DEVICE_PRESETS
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    ep, _ = export_decode(get_model("gpt2").model, 16)
    raised = raise_graph(ep, "decode", check=False)
    prog = lower_decode_graph(raised.gm, DEVICE_PRESETS["aim-like"])
    kernels = [h.kernel for h in prog.host_ops]
    assert prog.info["linears"] == 9 and prog.info["attention_layers"] == 2
    assert kernels.count("layer_norm") == 5 and kernels.count("gelu") == 2 and kernels.count("pos_embedding") == 1
    assert "rope" not in kernels and "rope_cos_sin" not in kernels
    assert sum(1 for h in prog.host_ops if h.kernel == "add" and any(".bias" in i for i in h.inputs)) == 8  # Conv1D biases
    assert set(prog.io["outputs"]) == {"logits", "act.model.embed_tokens", "act.model.layers.0", "act.model.layers.1"}
    r = Runner(prog, SimTarget())
    r.reset()
    for n in raised.cache_names:
        raised.gm.get_buffer(n).zero_()
    for pos, tok in enumerate([5, 17, 200]):  # positions 1, 2 read the learned positions and the cache
        out = r.step(tok, pos)["logits"].copy()
        want = raised.gm(torch.tensor([[tok]]), torch.tensor([pos]))[0, -1].detach().numpy()
        assert np.corrcoef(out, want)[0, 1] > 0.999, pos
