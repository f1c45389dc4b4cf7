"""Model zoo: tiny seeded configs of modern LLM families, built from their transformers classes.

Every entry is ``name -> (config class, causal-LM class, config kwargs, notes)``; all are
2-layer, hidden 64, vocab 256 models that build, export and compile in seconds. The
configs follow ``/work/shared/research/tiny_configs.py`` (verified to export with torch
2.13 / transformers 5.24), with ``max_position_embeddings`` raised where needed and the
MoE families loaded with ``experts_implementation="batched_mm"`` (the default per-expert
loop does not export: data-dependent guards).

Weights: ``torch.manual_seed(seed)`` then HF's default init, after which
:func:`nhil.models.seeding.seed_weights` redraws every matrix (and every 3-D expert
tensor) from N(0, 0.15): the default std 0.02 gives near-uniform logits, so greedy
decoding would hinge on ties. Norm weights keep their init; 1-D biases are redrawn from
N(0, 0.1) so that QKV bias matters, and DeepSeek-V3's router buffer
``e_score_correction_bias`` (zeros at init) from N(0, 0.1) so that the bias-corrected
expert selection differs from the plain one.
"""

from __future__ import annotations


from nhil.models.registry import ModelBundle, register

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

ZOO: dict[str, tuple[str, str, dict, str]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(COMMON, head_dim=16, sliding_window=8),
                "GQA 4/2, sliding window 8 on every layer"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(COMMON, tie_word_embeddings=True),
              "QKV bias, GQA 4/2, tied embeddings"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, head_dim=16, tie_word_embeddings=True),
              "per-head QK-norm (RMSNorm over head_dim), GQA 4/2"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(COMMON, pad_token_id=0, eos_token_id=2),
              "post-norm placement, QK-norm over the full projection width"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
        "fused QKV and gate-up projections, partial rotary 0.75"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2),
        "LayerNorm, learned absolute positions, GELU-tanh MLP, MHA, Conv1D"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "(1+w) RMSNorm, sandwich norms, GeGLU-tanh, sliding/global, attention + final soft-cap, embedding scale"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
        "Gemma 3 text: QK-norm, local/global RoPE bases, sliding/global"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        "MoE 4 experts top-2, softmax -> top-k -> renormalise"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False),
        "MoE 4 experts top-2 (no renorm) + sigmoid-gated shared expert, QKV bias"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True),
        "MoE 4 experts top-2 with renormalisation, QK-norm"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=128, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0}),
        "MLA, YaRN, sigmoid + bias-corrected grouped top-k routing, shared expert, first layer dense"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}),
        "attention sinks, sliding/full, YaRN, top-k -> softmax router with bias, clamped SwiGLU experts"),
    # hybrids / state-space models (issue 14): decode through nhil's recurrent-state cache (nhil.compiler.export_recurrent)
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=8,
        n_groups=1, conv_kernel=4, chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "Mamba-2 SSD: selective state update (8 heads x 16 x state 16, scalar decay per head), short conv 4, gated RMSNorm"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        COMMON, layer_types=["conv", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "LFM2 hybrid: gated short-conv layer (C * conv3(B * x), conv state) + GQA attention layer with QK-norm, SwiGLU"),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        COMMON, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "OLMo hybrid: gated DeltaNet layer (2 key / 4 value heads x 16, conv 4, L2-normed q/k, beta in [0, 2]) + attention layer"),
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"}


def build_config(name: str):
    """The transformers config object of zoo entry ``name``."""
    import transformers

    cfg_cls, _, kwargs, _ = ZOO[name]
    extra = {"experts_implementation": "batched_mm"} if name in MOE else {}
    return getattr(transformers, cfg_cls)(**kwargs, **extra)


def build_zoo_model(name: str, seed: int = 0) -> ModelBundle:
    """Build zoo entry ``name`` with seeded weights (see the module docstring)."""
    import torch
    import transformers

    _, model_cls, _, notes = ZOO[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(build_config(name))
    from nhil.models.seeding import seed_weights  # imports torch: not at registry listing (argument checks)

    weights_id = f"seed:{seed}" + seed_weights(model, 0.15)
    model.eval()
    return ModelBundle(name=name, model=model, tokenizer=None, weights_id=weights_id, source=f"{model_cls} tiny (seeded): {notes}")


for _name, (_c, _m, _kw, _notes) in ZOO.items():
    register(_name, f"{_m} tiny seeded: {_notes}", tokenizer=False, vocab_size=_kw.get("vocab_size"))(lambda seed=0, n=_name: build_zoo_model(n, seed))
