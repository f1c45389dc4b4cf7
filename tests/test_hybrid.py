"""Hybrid / state-space layers (issue 14): recurrent-state export, primitives vs transformers, lowering, tight tier.

References are transformers 5.24's own Mamba-2 functions and modules
(``modeling_mamba2.mamba2_selective_state_update``, ``causal_conv1d_update``,
``MambaRMSNormGated``) and the eager decode step of the model itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nhil.compiler import export_decode, raise_graph
from nhil.compiler.check import check_raised_exact
from nhil.models import get_model
from nhil.runtime import host_kernels
from nhil.verify import VerifyOptions, verify

nhil = torch.ops.nhil
mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")


def _ssm_inputs(g, H=8, hd=16, G=2, N=16, dt_scale=1.0, bias_shift=0.0):
    x = torch.randn(1, 1, H * hd, generator=g)
    dt = torch.randn(1, 1, H, generator=g) * dt_scale
    A_log = torch.log(torch.arange(1, H + 1, dtype=torch.float32))
    B, C = torch.randn(1, 1, G * N, generator=g), torch.randn(1, 1, G * N, generator=g)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.1 + bias_shift
    return x, dt, A_log, B, C, D, dt_bias


@pytest.mark.parametrize("dt_scale,bias_shift", [(1.0, 0.0), (30.0, 20.0), (1.0, -30.0)])  # ordinary; decay -> 0 (dt huge); decay -> 1 (dt ~ 0)
def test_ssm_state_update_equals_transformers_over_64_steps(dt_scale, bias_shift):
    """The primitive vs ``mamba2_selective_state_update`` as ``Mamba2Mixer`` calls it, state carried 64 steps from a
    non-zero start, 2 groups; bit for bit, also at decay extremes."""
    H, hd, G, N = 8, 16, 2, 16
    g = torch.Generator().manual_seed(1)
    s_ref = torch.randn(1, H, hd, N, generator=g)
    s_nhil = s_ref.clone()
    for _ in range(64):
        x, dt, A_log, B, C, D, dt_bias = _ssm_inputs(g, H, hd, G, N, dt_scale, bias_shift)
        A = -torch.exp(A_log.float())
        want = mamba2.mamba2_selective_state_update(
            s_ref, x.view(1, H, hd), dt.transpose(1, 2).expand(-1, -1, hd), A[:, None, None].expand(-1, hd, N), B.view(1, G, N),
            C.view(1, G, N), D[:, None].expand(-1, hd), z=None, dt_bias=dt_bias[:, None].expand(-1, hd), dt_softplus=True).view(1, 1, -1)
        got = nhil.ssm_state_update(x, dt, A_log, B, C, D, dt_bias, s_nhil, H, hd, G, N)
        assert torch.equal(got, want) and torch.equal(s_nhil, s_ref)
    assert torch.isfinite(s_nhil).all()


def test_ssm_state_update_mutations_are_not_equal():
    """The comparison above can fail: decay applied after the input, or the D skip dropped, differ from transformers."""
    H, hd, G, N = 8, 16, 1, 16
    g = torch.Generator().manual_seed(2)
    x, dt, A_log, B, C, D, dt_bias = _ssm_inputs(g, H, hd, G, N)
    s = torch.randn(1, H, hd, N, generator=g)
    from nhil.compiler.primitives_recurrent import ssm_discretize

    _, dA, dBx, _ = ssm_discretize(x, dt, A_log, B, D, dt_bias, H, hd, G, N)
    right = s * dA + dBx
    assert not torch.equal((s + dBx) * dA, right)
    st = s.clone()
    y = nhil.ssm_state_update(x, dt, A_log, B, C, D, dt_bias, st, H, hd, G, N)
    st2 = s.clone()
    y0 = nhil.ssm_state_update(x, dt, A_log, B, C, torch.zeros_like(D), dt_bias, st2, H, hd, G, N)
    assert torch.equal(st, right) and not torch.equal(y, y0)


def test_causal_conv1d_update_equals_transformers_over_64_steps():
    g = torch.Generator().manual_seed(3)
    C, K = 40, 4
    w, bias = torch.randn(C, 1, K, generator=g), torch.randn(C, generator=g)
    s_ref = torch.randn(1, C, K, generator=g)
    s_nhil = s_ref.clone()
    for _ in range(64):
        x = torch.randn(1, 1, C, generator=g)
        want = mamba2.causal_conv1d_update(x.transpose(1, 2), s_ref, w.squeeze(1), bias, activation="silu").transpose(1, 2)
        got = nhil.causal_conv1d_update(x, s_nhil, w, bias, "silu")
        assert torch.equal(got, want) and torch.equal(s_nhil, s_ref)


def test_rms_norm_gated_equals_transformers_module():
    g = torch.Generator().manual_seed(4)
    m = mamba2.MambaRMSNormGated(128, group_size=32, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_(generator=g)
    x, z = torch.randn(1, 1, 128, generator=g), torch.randn(1, 1, 128, generator=g) * 4
    assert torch.equal(nhil.rms_norm_gated(x, z, m.weight.detach(), 1e-5, 32), m(x, z))


def test_mamba2_decode_export_raises_bit_exact_over_64_steps():
    """Exported decode step (nhil's recurrent-state cache) vs the raised graph, both carrying their own states
    for 64 tokens from zero: logits and every state bit-identical at every step; the graph is faithful."""
    model = get_model("mamba2").model
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")  # also checks a random non-zero state
    assert raised.unraised == []
    assert raised.counts["nhil::ssm_state_update"] == 2 and raised.counts["nhil::causal_conv1d_update"] == 2
    assert raised.counts["nhil::rms_norm_gated"] == 2 and raised.counts["nhil::linear"] == 5
    assert sorted(raised.cache_names) == ["conv_state_0", "conv_state_1", "ssm_state_0", "ssm_state_1"]
    ssm = next(n for n in raised.gm.graph.nodes if n.target == nhil.ssm_state_update.default)
    assert ssm.args[8:12] == (8, 16, 1, 16)  # heads, head_dim, groups, state size from the config
    assert tuple(raised.gm.get_buffer("conv_state_0").shape) == (1, 160, 4)  # conv channels I + 2*G*N, kernel 4
    em = ep.module()
    for name in raised.cache_names:
        em.get_buffer(name).zero_()
        raised.gm.get_buffer(name).zero_()
    g = torch.Generator().manual_seed(5)
    for pos in range(64):
        ids = torch.randint(0, 256, (1, 1), generator=g)
        with torch.no_grad():
            want, got = em(input_ids=ids, cache_position=torch.tensor([pos])), raised.gm(ids, torch.tensor([pos]))
        assert torch.equal(got, want), pos
    assert all(torch.equal(em.get_buffer(n), raised.gm.get_buffer(n)) for n in raised.cache_names)
    assert raised.gm.get_buffer("ssm_state_1").abs().max() > 0


def test_decode_path_from_zero_state_follows_the_eager_model():
    """The exported decode path run token by token from zero states predicts what the eager model (chunked prefill
    form over the whole sequence) predicts: same argmax at every position of a 20-token sequence."""
    model = get_model("mamba2").model
    ep, _ = export_decode(model, 16)
    em = ep.module()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0]
        steps = torch.cat([em(input_ids=ids[:, p : p + 1], cache_position=torch.tensor([p]))[0] for p in range(20)])
    assert torch.equal(steps.argmax(-1), full.argmax(-1))


@pytest.fixture
def dirs(tmp_path):
    return dict(goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs")


@pytest.mark.sim
def test_mamba2_verify_passes_on_sim_bit_exact(dirs):
    rep = verify(VerifyOptions(model="mamba2", target="sim", tokens=16, **dirs))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["tight"]["passed"] and rep["tight"]["elements_compared"] > 1000


def _wrap(monkeypatch, name, fn):
    import functools

    real = host_kernels.KERNELS[name]
    calls = []

    @functools.wraps(real)
    def mutant(ins, outs, ctx, **a):
        calls.append(1)
        return fn(len(calls), real, ins, outs, ctx, **a)

    monkeypatch.setitem(host_kernels.KERNELS, name, mutant)


def _caught(rep, layer):
    assert rep["outcome"] == "MISMATCH", rep.get("error")
    assert rep["tight"]["passed"] is False
    fd = rep["tight"]["first_difference"]
    assert fd["tensor"] == layer, fd
    assert fd["reference_bits"] != fd["target_bits"]


@pytest.mark.sim
def test_decay_after_input_in_layer_1_is_caught_and_localised(dirs, monkeypatch):
    """Mutation: layer 1's state update applies the decay after adding the input, ``(S + dBx) * dA``."""
    from nhil.compiler.primitives_recurrent import ssm_discretize
    from nhil.runtime.host_recurrent import _t

    def mutated(call, real, ins, outs, ctx, num_heads, head_dim, n_groups, state_size):
        if call % 2:  # layer 0 (the first ssm_update of each step) stays right
            return real(ins, outs, ctx, num_heads=num_heads, head_dim=head_dim, n_groups=n_groups, state_size=state_size)
        x, dt, B, st, a_log, D, dt_bias = ins
        H, hd, G, N = num_heads, head_dim, n_groups, state_size
        _, dA, dBx, _ = ssm_discretize(_t(x, 1, 1, H * hd), _t(dt, 1, 1, H), _t(a_log, H), _t(B, 1, 1, G * N), _t(D, H), _t(dt_bias, H), H, hd, G, N)
        outs[0][:] = ((_t(st, 1, H, hd, N) + dBx) * dA).reshape(-1).numpy()

    _wrap(monkeypatch, "ssm_update", mutated)
    _caught(verify(VerifyOptions(model="mamba2", target="sim", tokens=8, **dirs)), "model.layers.1")


@pytest.mark.sim
def test_gate_dropped_in_the_gated_norm_is_caught(dirs, monkeypatch):
    """Mutation: the gated RMSNorm forgets ``silu(gate)`` (plain grouped RMSNorm of x)."""
    def no_gate(call, real, ins, outs, ctx, eps, group_size):
        x, _gate, w = ins
        g = np.full_like(np.asarray(x), 80.0)  # silu(80) == 80 in fp32: the gate is gone up to a scale the norm removes
        real([x, g, w], outs, ctx, eps=eps, group_size=group_size)

    _wrap(monkeypatch, "rms_norm_gated", no_gate)
    _caught(verify(VerifyOptions(model="mamba2", target="sim", tokens=8, **dirs)), "model.layers.0")


# ------------------------------------------------------------------ LFM2: gated short conv


def test_gated_short_conv_equals_transformers_lfm2_module_over_64_steps():
    """``causal_conv1d_update(in_gate=B, out_gate=C, activation='none')`` + out_proj vs ``Lfm2ShortConv.forward`` (decode branch)
    with its own cache layer, 64 decode steps from a non-zero conv state: bit for bit."""
    import transformers
    from transformers.cache_utils import StaticCache

    cfg = transformers.Lfm2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, layer_types=["conv", "full_attention"])
    lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
    torch.manual_seed(7)
    m = lfm2.Lfm2ShortConv(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    cache = StaticCache(config=cfg, max_cache_len=4)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        m(torch.randn(1, 1, 32, generator=g), cache=cache)  # lazily allocates the conv state, takes the prefill branch
        state = cache.layers[0].conv_states[0]
        state.copy_(torch.randn(state.shape, generator=g))
        mine = state.clone()
        for _ in range(64):
            x = torch.randn(1, 1, 32, generator=g)
            want = m(x, cache=cache)
            bcx = m.in_proj(x)
            y = nhil.causal_conv1d_update(nhil.narrow(bcx, 64, 32), mine, m.conv.weight, None, "none",
                                          in_gate=nhil.narrow(bcx, 0, 32), out_gate=nhil.narrow(bcx, 32, 32))
            assert torch.equal(m.out_proj(y), want) and torch.equal(mine, state)


def test_lfm2_decode_raising_is_bit_exact_and_faithful():
    raised = raise_graph(export_decode(get_model("lfm2").model, 16)[0], "decode")
    assert raised.unraised == []
    conv = [n for n in raised.gm.graph.nodes if n.target == nhil.causal_conv1d_update.default]
    assert len(conv) == 1 and conv[0].args[4] == "none" and set(conv[0].kwargs) == {"in_gate", "out_gate"}
    assert raised.counts["nhil::attention_kv"] == 1 and raised.counts["nhil::silu_mul"] == 2
    assert sorted(raised.cache_names) == ["conv_state_0", "key_cache_1", "value_cache_1"]
    assert tuple(raised.gm.get_buffer("conv_state_0").shape) == (1, 64, 3)  # hidden channels x L_cache 3


@pytest.mark.sim
def test_lfm2_verify_passes_on_sim_bit_exact(dirs):
    rep = verify(VerifyOptions(model="lfm2", target="sim", tokens=16, **dirs))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["tight"]["passed"] and rep["tight"]["elements_compared"] > 1000


# ------------------------------------------------------------------ OLMo-hybrid: gated DeltaNet


@pytest.mark.parametrize("a_shift,b_shift", [(0.0, 0.0), (30.0, 30.0), (-30.0, -30.0)])  # ordinary; decay -> 0, beta -> 2; decay -> 1, beta -> 0
def test_gated_delta_rule_equals_transformers_over_64_steps(a_shift, b_shift):
    """``nhil::gated_delta_rule`` vs ``torch_recurrent_gated_delta_rule`` with the gates as ``OlmoHybridGatedDeltaNet``
    computes them, 2 key heads shared by 4 value heads, state carried 64 steps from a non-zero start: bit for bit."""
    oh = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    import torch.nn.functional as F

    hk, hv, dk, dv = 2, 4, 16, 16
    g = torch.Generator().manual_seed(9)
    A_log, dt_bias = torch.log(torch.rand(hv, generator=g) * 16), torch.randn(hv, generator=g)
    s_ref = torch.randn(1, hv, dk, dv, generator=g) * 0.1
    s_nhil = s_ref.clone()
    for _ in range(64):
        q, k = torch.randn(1, 1, hk * dk, generator=g), torch.randn(1, 1, hk * dk, generator=g)
        v = torch.randn(1, 1, hv * dv, generator=g)
        a, b = torch.randn(1, 1, hv, generator=g) + a_shift, torch.randn(1, 1, hv, generator=g) + b_shift
        beta = b.sigmoid() * 2.0
        gg = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        want, s_ref = oh.torch_recurrent_gated_delta_rule(q.view(1, 1, -1, dk), k.view(1, 1, -1, dk), v.view(1, 1, -1, dv), g=gg, beta=beta,
                                                          initial_state=s_ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = nhil.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, s_nhil, hk, hv, dk, dv, 2.0)
        assert torch.equal(got, want.reshape(1, 1, -1)) and torch.equal(s_nhil, s_ref)
    assert torch.isfinite(s_nhil).all()


def test_norm_before_gate_equals_transformers_module():
    oh = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    g = torch.Generator().manual_seed(10)
    m = oh.OlmoHybridRMSNormGated(16, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_(generator=g)
    x, z = torch.randn(1, 1, 64, generator=g), torch.randn(1, 1, 64, generator=g)
    want = m(x.reshape(-1, 16), z.reshape(-1, 16)).reshape(1, 1, -1)
    assert torch.equal(nhil.rms_norm_gated(x, z, m.weight.detach(), 1e-5, 16, True), want)
    assert not torch.equal(nhil.rms_norm_gated(x, z, m.weight.detach().repeat(4), 1e-5, 16), want)  # gate-before-norm differs


def test_olmo_hybrid_decode_raising_is_bit_exact_and_faithful():
    raised = raise_graph(export_decode(get_model("olmo_hybrid").model, 16)[0], "decode")
    assert raised.unraised == []
    gdr = [n for n in raised.gm.graph.nodes if n.target == nhil.gated_delta_rule.default]
    assert len(gdr) == 1 and gdr[0].args[8:13] == (2, 4, 16, 16, 2.0)  # key heads, value heads, dk, dv, beta in [0, 2]
    norm = [n for n in raised.gm.graph.nodes if n.target == nhil.rms_norm_gated.default]
    assert len(norm) == 1 and norm[0].args[4:6] == (16, True)
    assert raised.counts["nhil::attention_kv"] == 1 and raised.counts["nhil::causal_conv1d_update"] == 1
    assert sorted(raised.cache_names) == ["conv_state_0", "key_cache_1", "ssm_state_0", "value_cache_1"]
    assert tuple(raised.gm.get_buffer("ssm_state_0").shape) == (1, 4, 16, 16)


@pytest.mark.sim
def test_olmo_hybrid_verify_passes_on_sim_bit_exact(dirs):
    rep = verify(VerifyOptions(model="olmo_hybrid", target="sim", tokens=16, **dirs))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["tight"]["passed"] and rep["tight"]["elements_compared"] > 1000


@pytest.mark.sim
def test_delta_rule_beta_dropped_is_caught(dirs, monkeypatch):
    """Mutation: the host update forgets beta (``delta = v - kv_mem``)."""
    def no_beta(call, real, ins, outs, ctx, **a):
        v, kvm, decay, beta, kh, st = ins
        real([v, kvm, decay, np.ones_like(np.asarray(beta)), kh, st], outs, ctx, **a)

    _wrap(monkeypatch, "delta_update", no_beta)
    _caught(verify(VerifyOptions(model="olmo_hybrid", target="sim", tokens=8, **dirs)), "model.layers.0")


def test_timing_report_counts_recurrent_state_traffic():
    """The timing report gives the states' bytes next to the KV cache's: Mamba-2 tiny per layer conv 160 x 4 and
    SSM 8 x 16 x 16 bf16 values, read once and written once per token."""
    from nhil.compiler.pipeline import compile as compile_model
    from nhil.timing.report import analyze

    rep = analyze(compile_model(get_model("mamba2"), "aim-like", max_cache_len=16).program)
    per_layer = 2 * (160 * 4 + 8 * 16 * 16)
    assert rep["recurrent_state"] == {"layers": 4, "state_bytes": 2 * per_layer, "round_trip_bytes": 4 * per_layer}
    assert rep["kv_bytes"] == 0
    assert rep["instructions_by_kind"]["RD_SBK"] == 2 * (1 + 8 * 16) and rep["exposed_cycles_by_kind"]["WR_SBK"] > 0


def test_shape_only_mamba2_equals_real_compiler():
    """The shape-only Mamba-2 graph writer (``shape_recurrent``, used by the bench's realistic-size row) lowers to the
    instruction stream the real compiler produces for the zoo's tiny mamba2, host op for host op."""
    from nhil.compile import compile_model
    from nhil.compiler.pipeline import compile_shapes
    from nhil.compiler.shape_recurrent import Mamba2Shape
    from nhil.isa.instr import Op

    def key(p):
        return [(i.op, i.flags, i.ch, i.bank, i.row, i.col, i.n, i.k, p.host_ops[i.imm].kernel if i.op is Op.HOST else i.imm) for i in p.instrs]

    real = compile_model("mamba2")
    tiny = Mamba2Shape("mamba2-tiny", hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, vocab_size=256, tie_word_embeddings=False)
    so = compile_shapes(tiny, real.device, max_cache_len=real.info["max_cache_len"] or 16)
    assert key(so) == key(real)
    assert [h.attrs for h in so.host_ops] == [h.attrs for h in real.host_ops]


def test_recurrent_primitives_have_lowering_and_attribute_checks():
    import nhil.compiler.lower  # noqa: F401  (imports every lowering module)
    from nhil.compiler.attr_checks import ATTR_CHECKS
    from nhil.compiler.lowering import LOWERINGS
    from nhil.compiler.primitives import PRIMITIVES
    from nhil.compiler.primitives_recurrent import PRIMITIVES as REC

    assert set(REC) <= set(PRIMITIVES)
    for p in REC:
        assert f"nhil::{p}" in LOWERINGS and f"nhil::{p}" in ATTR_CHECKS


def test_a_family_whose_cache_cannot_be_shaped_fails_with_a_named_error():
    """MiniMax keeps a cache of its own: the recurrent-state probe refuses it with a CompileError naming the model
    class and transformers' reason (EXPORT_FAIL in verify), not a traceback from inside the trace."""
    import transformers

    from nhil.errors import CompileError
    from nhil.landscape.tiny_config import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("minimax")).eval()
    with pytest.raises(CompileError, match=r"recurrent-state cache probe \(one eager step of MiniMaxForCausalLM\) failed: ValueError: MiniMax uses cache of its own"):
        export_decode(model, 16)
