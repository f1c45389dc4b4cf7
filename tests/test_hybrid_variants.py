"""Gated DeltaNet layouts of the Qwen3.5 / Qwen3-Next families and hybrid tiny configs that keep an attention layer.

References: the transformers 5.24 modules' own decode step (``Qwen3_5GatedDeltaNet``,
``Qwen3NextGatedDeltaNet`` with their cache), the exported program (bit-exact raise at a
later position from random states), and transformers' own cache built from the tiny config.
"""

from __future__ import annotations

import pytest
import torch

from nhil.compiler import export_decode, raise_graph
from nhil.compiler.check import check_raised_exact
from nhil.landscape.tiny_config import tiny_config
from nhil.models import get_model
from nhil.verify import VerifyOptions, verify

nhil = torch.ops.nhil
transformers = pytest.importorskip("transformers")


def _config_path(tmp_path, model_type):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(tiny_config(model_type).to_json_string())
    return str(d / "config.json")


def _module_with_state(model_type: str, cls_path: str, seed: int):
    """A seeded GatedDeltaNet of the tiny config, its cache with random non-zero conv / recurrent states."""
    import importlib

    cfg = tiny_config(model_type)
    mod, name = cls_path.rsplit(".", 1)
    torch.manual_seed(seed)
    m = getattr(importlib.import_module(mod), name)(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    cache = transformers.DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        m(torch.randn(1, 3, cfg.hidden_size, generator=g), cache=cache)  # prefill branch: allocates the states
    conv, rec = cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]
    conv.copy_(torch.randn(conv.shape, generator=g))
    rec.copy_(torch.randn(rec.shape, generator=g) * 0.3)
    return cfg, m, cache, conv, rec, g


def _delta_step(m, cfg, qkv, z, b, a, conv, rec):
    """One decode step from nhil primitives: conv over q|k|v, narrow, gated delta rule, norm-before-gate, out_proj."""
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    c = nhil.causal_conv1d_update(qkv, conv, m.conv1d.weight, m.conv1d.bias, "silu")
    q, k, v = nhil.narrow(c, 0, hk * dk), nhil.narrow(c, hk * dk, hk * dk), nhil.narrow(c, 2 * hk * dk, hv * dv)
    o = nhil.gated_delta_rule(q, k, v, a, b, m.A_log, m.dt_bias, rec, hk, hv, dk, dv, 1.0)
    return m.out_proj(nhil.rms_norm_gated(o, z, m.norm.weight, m.norm.variance_epsilon, dv, True))


def test_qwen3_5_gated_delta_net_step_equals_the_transformers_module_over_16_steps():
    """Fused ``in_proj_qkv`` layout: the primitives reproduce ``Qwen3_5GatedDeltaNet.forward``'s decode branch (its own
    cache, states carried from a random start) bit for bit, output and both states, at every step."""
    cfg, m, cache, conv, rec, g = _module_with_state("qwen3_5_text", "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet", 11)
    my_conv, my_rec = conv.clone(), rec.clone()
    with torch.no_grad():
        for _ in range(16):
            x = torch.randn(1, 1, cfg.hidden_size, generator=g)
            want = m(x, cache=cache)
            got = _delta_step(m, cfg, m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x), my_conv, my_rec)
            assert torch.equal(got, want) and torch.equal(my_conv, conv) and torch.equal(my_rec, rec)
    assert rec.abs().max() > 0


def _per_key_head(x, hk: int, widths: list[int]) -> list:
    """Columns of ``x`` [1, 1, hk * sum(widths)] grouped per key head ``[w0 | w1 | ...]``: piece j of every head,
    head-major, joined (Qwen3-Next ``fix_query_key_value_ordering``, written out from its docstring)."""
    w = sum(widths)
    return [nhil.concat([nhil.narrow(x, h * w + sum(widths[:j]), n) for h in range(hk)]) for j, n in enumerate(widths)]


def test_qwen3_next_gated_delta_net_step_equals_the_transformers_module_over_16_steps():
    """Per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` layout: the narrow / concat de-interleave plus the primitives
    reproduce ``Qwen3NextGatedDeltaNet.forward``'s decode branch bit for bit; a head-order mistake does not."""
    cfg, m, cache, conv, rec, g = _module_with_state("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet", 12)
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rep = hv // hk
    my_conv, my_rec = conv.clone(), rec.clone()
    with torch.no_grad():
        for step in range(16):
            x = torch.randn(1, 1, cfg.hidden_size, generator=g)
            want = m(x, cache=cache)
            q, k, v, z = _per_key_head(m.in_proj_qkvz(x), hk, [dk, dk, rep * dv, rep * dv])
            b, a = _per_key_head(m.in_proj_ba(x), hk, [rep, rep])
            if step == 0:  # the layout matters: q and k swapped is another layer
                wrong = _delta_step(m, cfg, nhil.concat([k, q, v]), z, b, a, my_conv.clone(), my_rec.clone())
                assert not torch.equal(wrong, want)
            got = _delta_step(m, cfg, nhil.concat([q, k, v]), z, b, a, my_conv, my_rec)
            assert torch.equal(got, want) and torch.equal(my_conv, conv) and torch.equal(my_rec, rec)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_delta_layouts_raise_bit_exact_at_a_later_position_from_random_states(tmp_path, model_type):
    """The tiny model's exported decode step raises with no unraised op to one ``causal_conv1d_update`` + one
    ``gated_delta_rule`` (2 key heads, 4 value heads, 16 x 16, beta in [0, 1]) + the norm-before-gate, and is
    bit-identical to the export at cache position 5 from random conv / recurrent states and KV cache."""
    model = get_model(_config_path(tmp_path, model_type)).model
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")
    assert raised.unraised == []
    assert {p for path, _c, p in raised.raised_by if path.endswith("linear_attn")} == {"gated DeltaNet"}
    gdr = [n for n in raised.gm.graph.nodes if n.target == nhil.gated_delta_rule.default]
    assert len(gdr) == 1 and gdr[0].args[8:13] == (2, 4, 16, 16, 1.0)
    assert raised.counts["nhil::causal_conv1d_update"] == 1 and raised.counts["nhil::attention_kv"] == 1
    norm = [n for n in raised.gm.graph.nodes if n.target == nhil.rms_norm_gated.default]
    assert len(norm) == 1 and norm[0].args[4:6] == (16, True)
    assert tuple(raised.gm.get_buffer("conv_state_0").shape) == (1, 128, 4)  # q|k|v channels 32+32+64, kernel 4
    g = torch.Generator().manual_seed(13)
    caches = {n: torch.randn(raised.gm.get_buffer(n).shape, generator=g) * 0.5 for n in raised.cache_names}
    check_raised_exact(ep, raised, (torch.tensor([[7]]), torch.tensor([5])), caches)


@pytest.mark.parametrize("model_type", ["zamba2", "nemotron_h", "bamba", "granitemoehybrid", "jamba"])
def test_hybrid_tiny_configs_keep_an_attention_and_a_recurrent_layer(model_type):
    """Two layers, one of them attention by transformers' own cache (``get_seq_length`` works: it raises on a cache of
    linear-attention layers only), one of them recurrent; the config class's validators accept it."""
    cfg = tiny_config(model_type)
    cache = transformers.DynamicCache(config=cfg)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 0
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert any("LinearAttention" in k for k in kinds) and any(k != "LinearAttentionLayer" for k in kinds), kinds


def test_zamba2_hybrid_layer_ids_point_into_the_kept_layers():
    """Zamba2's ``hybrid_layer_ids`` (indices into the 54 published layers) are renumbered to the kept layer 1."""
    cfg = tiny_config("zamba2")
    assert cfg.layers_block_type == ["linear_attention", "hybrid"] and cfg.hybrid_layer_ids == [1]


@pytest.mark.sim
def test_qwen3_5_tiny_verifies_on_sim(tmp_path):
    rep = verify(VerifyOptions(model=_config_path(tmp_path, "qwen3_5_text"), target="sim", tokens=8,
                               goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs"))
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["tight"]["passed"]


@pytest.mark.parametrize("model_type", ["falcon_h1", "bamba"])
def test_mamba2_mixers_of_hybrids_raise_bit_exact_at_a_later_position_from_random_states(tmp_path, model_type):
    """Falcon-H1 (muP-scaled in_proj output, gate inside the mixer) and Bamba mixers raise to ``ssm_state_update``
    (8 heads x 16, 1 group, state 16), bit-identical to the export at position 5 from random states."""
    model = get_model(_config_path(tmp_path, model_type)).model
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")
    assert raised.unraised == []
    ssm = [n for n in raised.gm.graph.nodes if n.target == nhil.ssm_state_update.default]
    assert len(ssm) == (2 if model_type == "falcon_h1" else 1) and all(n.args[8:12] == (8, 16, 1, 16) for n in ssm)
    assert raised.counts["nhil::attention_kv"] >= 1
    g = torch.Generator().manual_seed(14)
    caches = {n: torch.randn(raised.gm.get_buffer(n).shape, generator=g) * 0.5 for n in raised.cache_names}
    check_raised_exact(ep, raised, (torch.tensor([[9]]), torch.tensor([5])), caches)


def test_bamba_decode_export_uses_the_cache_position_for_rope():
    """Bamba's model numbers positions from 0 in every call when given no ``position_ids``; the exported decode step
    gets them from ``cache_position`` as generate() does: 8 steps equal the eager model stepped with position_ids
    ``[[p]]`` (its own DynamicCache) to float rounding, and differ from the eager model stepped at position 0."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("bamba")).eval()
    em = export_decode(model, 16)[0].module()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    diffs = []
    with torch.no_grad():
        got = torch.cat([em(input_ids=ids[:, p : p + 1], cache_position=torch.tensor([p]))[0] for p in range(8)])
        for zero in (False, True):
            cache = transformers.DynamicCache(config=model.config)
            want = torch.cat([model(input_ids=ids[:, p : p + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[0 if zero else p]])).logits[0]
                              for p in range(8)])
            diffs.append((got - want).abs().max().item())
    assert diffs[0] < 1e-6 < 1e-4 < diffs[1], diffs
