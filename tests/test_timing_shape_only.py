"""Shape-only compilation: same instruction stream as the real compiler; large configs compile."""

from __future__ import annotations

import pytest

from nhil.compiler.shape_only import CONFIGS, ShapeConfig, compile_shape_only
from nhil.isa.instr import Op


def _key(p):
    return [(i.op, i.flags, i.ch, i.bank, i.row, i.col, i.n, i.k, p.host_ops[i.imm].kernel if i.op is Op.HOST else i.imm) for i in p.instrs]


def _same_as_real(name):
    from nhil.compile import compile_model
    from nhil.models import get_model

    from nhil.compiler.pipeline import compile_shapes

    real = compile_model(name)  # the default pipeline: every pass, program-stage ones included
    so = compile_shapes(ShapeConfig.from_hf(get_model(name).model.config, name), real.device, max_cache_len=real.info["max_cache_len"])
    assert _key(so) == _key(real)
    assert so.info["shape_only"] and not any(img.data is not None for img in so.bank_images)


def test_shape_only_llama_tiny_equals_real_compiler():
    _same_as_real("llama-tiny")


@pytest.mark.real
def test_shape_only_smollm2_equals_real_compiler():
    _same_as_real("llama")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_large_configs_compile_shape_only(name):
    p = compile_shape_only(name, max_cache_len=128)
    c = CONFIGS[name]
    assert p.info["rows_used"] <= p.device.rows
    placed = p.info["placed_weight_bytes"]
    if c.params_b:
        # every PIM matrix is placed: bf16 bytes within 10% of the parameter count minus a host-side embedding
        assert 0.8 * 2e9 * c.params_b < placed + 2 * c.vocab_size * c.hidden_size * (not c.tie_word_embeddings) + 1 < 1.1 * 2e9 * c.params_b


def test_layer_extrapolation_matches_the_measured_program():
    """The ablation's 1-/2-layer extrapolation (used for huge naive programs) reproduces a measured 4-layer program's cycles and GEMV bytes."""
    from nhil.compiler.pipeline import PassManager
    from nhil.compiler.schedule import PIPELINE
    from nhil.timing.ablation import _layers_extrapolated
    from nhil.timing.report import analyze

    cfg = ShapeConfig("small", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, head_dim=128)
    for passes in (list(PIPELINE), [p for p in PIPELINE if p != "bank-spread"]):
        measured = analyze(PassManager(passes).compile(compile_shape_only, cfg, max_cache_len=32))
        ex = _layers_extrapolated(cfg, passes, "aim-like", 32, 3350.0)
        assert ex["cycles_per_token"] == pytest.approx(measured["cycles_per_token"], rel=0.01)
        assert ex["gemv"]["useful_bytes"] == measured["gemv"]["useful_bytes"]


def test_moe_timing_issues_top_k_expert_sub_programs():
    """The timing engine issues a MoE step as the runtime does: linear stream plus the sub-programs of top_k
    experts per dispatch, no markers (before, every expert of the linear stream was timed)."""
    from nhil.timing.engine import timed_order

    cfg = ShapeConfig("moe-small", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, head_dim=64, num_local_experts=4, num_experts_per_tok=2)
    p = compile_shape_only(cfg, max_cache_len=32)
    order = timed_order(p)
    macs = lambda idx: sum(1 for i in idx if p.instrs[i].op is Op.MAC_AB)  # noqa: E731
    moe = p.info["moe"]
    skipped = sum(sum(m["mac_ab_per_expert"][m["top_k"]:]) for m in moe)  # experts k..E-1 of every layer are not issued
    assert macs(order) == macs(range(len(p.instrs))) - skipped > 0
    markers = [i for i, ins in enumerate(p.instrs) if ins.op is Op.HOST and p.host_ops[ins.imm].kernel == "moe_expert"]
    assert len(markers) == 2 * 4 and not set(markers) & set(order)
    assert len(order) == len(set(order))
