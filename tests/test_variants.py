"""Attention / position variants raised with no per-family code (issue #13 item 6), against the
transformers module, on inputs that tell the variants apart.

Each family's RoPE application differs (GPT-J / CodeGen: interleaved pairs ``rotate_every_two``
on a partial rotary dim; Cohere: interleaved via ``repeat_interleave`` tables; Phi: partial
rotary of a rotate-half; Persimmon: per-head LayerNorm QK-norm + partial rotary; GPT-J /
CodeGen / Cohere: parallel attention + MLP residual). The attention anchors raise the
cache writes + SDPA into ``nhil::attention_kv`` and keep each family's own RoPE code as host
ATen. Reference: the transformers module itself (eager, fp32) at a cache position > 0 with
a random cache, where rotating pairs differently changes the logits; and the same module
with the Llama rotate-half substituted, which the raised graph must *not* match.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")


def _tiny(model_type: str):
    import transformers

    from nhil.landscape.tiny_config import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("arch, rotary_fn", [("gptj", "rotate_every_two"), ("codegen", "rotate_every_two"), ("cohere", "rotate_half")])
def test_rope_variant_raises_exactly_and_differs_from_rotate_half(arch, rotary_fn):
    import importlib

    from nhil.compiler.export import export_decode
    from nhil.compiler.raising import raise_graph

    model = _tiny(arch)
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")  # bit-exact vs the exported program at positions 0 and 8 (random caches)
    assert raised.counts["nhil::attention_kv"] == model.config.num_hidden_layers
    assert ("attention (anchors)" in {p for _, _, p in raised.raised_by})
    assert "nhil::rope" not in raised.counts  # the family's RoPE runs as its own exported ops (host ATen)

    # the transformers module at position 5 with the same random cache: the raised graph equals it bit for bit
    g = torch.Generator().manual_seed(3)
    caches = {n: torch.randn(raised.gm.get_buffer(n).shape, generator=g) for n in raised.cache_names}
    from nhil.compiler.check import check_raised_exact

    check_raised_exact(ep, raised, (torch.tensor([[11]]), torch.tensor([5])), caches)

    # ... and a rotate-half variant of the same weights gives other logits on these inputs
    mod = importlib.import_module(type(model).__module__)
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    other = copy.deepcopy(model)
    orig = getattr(mod, rotary_fn)
    try:
        setattr(mod, rotary_fn, llama.rotate_half)  # Cohere's own rotate_half rotates interleaved pairs
        ep_b, _ = export_decode(other, 16)
    finally:
        setattr(mod, rotary_fn, orig)
    out_a = _run(ep, caches, 5)
    out_b = _run(ep_b, caches, 5)
    assert (out_a - out_b).abs().max() > 1e-4, "rotate-half and the family's RoPE agree on these inputs: the test would not tell them apart"


def _run(ep, caches, pos):
    from nhil.compiler.check import _call_exported

    mod = ep.module()
    for n, t in caches.items():
        mod.get_buffer(n).copy_(t)
    with torch.no_grad():
        out = _call_exported(ep, mod, (torch.tensor([[11]]), torch.tensor([pos])))
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("arch", ["phi", "persimmon"])
def test_partial_rotary_and_qk_layernorm_raise_exactly(arch):
    from nhil.compiler.export import export_decode
    from nhil.compiler.raising import raise_graph

    model = _tiny(arch)
    assert (model.config.rope_parameters or {}).get("partial_rotary_factor", 1.0) < 1.0  # the variant under test is present
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")
    assert raised.counts["nhil::attention_kv"] == model.config.num_hidden_layers
    assert raised.host_aten.get("aten.slice.Tensor", 0) > 0  # the rotary / pass-through split, as exported


@pytest.mark.parametrize("arch", ["xglm", "megatron-bert"])
def test_bmm_eager_attention_raises_to_the_pim_products(arch):
    """BERT-era eager attention: ``torch.bmm`` over [B*H, L, hd] merges of the cache (XGLM, with a
    ``torch.full`` clamp bound in the score transform), or ``matmul`` with the probabilities' dropout
    submodule between the two products (Megatron-BERT). Both products become the PIM primitives
    ``nhil::attention_scores`` / ``nhil::attention_values`` in every layer (none left as host ATen), and
    the raised graph equals the exported one bit for bit at a position > 0 with random caches."""
    from nhil.compiler.check import check_raised_exact
    from nhil.compiler.export import export_decode
    from nhil.compiler.raising import raise_graph

    model = _tiny(arch)
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")
    n = model.config.num_hidden_layers
    assert raised.counts["nhil::attention_scores"] == raised.counts["nhil::attention_values"] == n
    assert not any(k in raised.host_aten for k in ("aten.bmm.default", "aten.matmul.default"))
    g = torch.Generator().manual_seed(3)
    caches = {c: torch.randn(raised.gm.get_buffer(c).shape, generator=g) for c in raised.cache_names}
    check_raised_exact(ep, raised, (torch.tensor([[11]]), torch.tensor([5])), caches)
    # the transformers module tells positions apart on these caches: the logits at 5 and 9 differ
    assert (_run(ep, caches, 5) - _run(ep, caches, 9)).abs().max() > 1e-5


def test_alibi_bias_raises_exactly_and_changes_the_logits():
    """BLOOM's ALiBi: ``baddbmm(alibi, q, Kᵀ, beta=1, alpha=1/sqrt(hd))``. The product is the PIM
    ``nhil::attention_scores`` in every layer; the bias and scale are host ATen rounded as ATen's
    ``baddbmm`` rounds them, so the raised graph equals the exported one bit for bit at a position > 0
    with random caches; and the same weights without the bias give other logits on these inputs (the
    test tells ALiBi from no position bias)."""
    import importlib

    from nhil.compiler.check import check_raised_exact
    from nhil.compiler.export import export_decode
    from nhil.compiler.raising import raise_graph

    model = _tiny("bloom")
    ep, _ = export_decode(model, 16)
    raised = raise_graph(ep, "decode")
    n = model.config.num_hidden_layers
    assert raised.counts["nhil::attention_scores"] == raised.counts["nhil::attention_values"] == n
    assert "aten.baddbmm.default" not in raised.host_aten
    g = torch.Generator().manual_seed(3)
    caches = {c: torch.randn(raised.gm.get_buffer(c).shape, generator=g) for c in raised.cache_names}
    check_raised_exact(ep, raised, (torch.tensor([[11]]), torch.tensor([5])), caches)

    mod = importlib.import_module(type(model).__module__)
    orig = mod._get_alibi_slopes  # BloomModel.forward without a padding mask: slopes[:, None, None] * key positions
    try:
        mod._get_alibi_slopes = lambda heads, device: torch.zeros_like(orig(heads, device))
        ep_b, _ = export_decode(copy.deepcopy(model), 16)
    finally:
        mod._get_alibi_slopes = orig
    assert (_run(ep, caches, 5) - _run(ep_b, caches, 5)).abs().max() > 1e-5
