"""``nhil::mla_kv`` / ``nhil::mla``: DeepSeek-V2/V3 multi-head latent attention (expanded form, as exported).

Source: transformers 5.24 ``modeling_deepseek_v3.DeepseekV3Attention.forward`` / ``expand_kv``,
``apply_rotary_pos_emb_interleave``, ``StaticLayer.update``, ``integrations/sdpa_attention.py``.
The PIM lowering executes the equivalent absorbed form (``nhil.compiler.lower_mla``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_attention import visible_mask
from nhil.compiler.primitives_lib import _fake, _impl, define
from nhil.compiler.primitives_rope import _apply_rope, rope_interleave

SCHEMAS = {
    "mla_kv": (
        "mla_kv(Tensor q, Tensor kv_latent, Tensor k_rope, Tensor(a!) latent_cache, Tensor(b!) rope_cache, "
        "Tensor cache_position, Tensor cos, Tensor sin, Tensor kv_b_weight, int num_heads, int kv_lora_rank, "
        "int qk_nope_head_dim, int qk_rope_head_dim, int v_head_dim, float scale, bool rope_interleave=True, "
        "int? q_lora_rank=None) -> Tensor"
    ),
    "mla": (
        "mla(Tensor q, Tensor kv_latent, Tensor k_rope, Tensor cos, Tensor sin, Tensor kv_b_weight, int num_heads, "
        "int kv_lora_rank, int qk_nope_head_dim, int qk_rope_head_dim, int v_head_dim, float scale, "
        "bool rope_interleave=True, int? q_lora_rank=None) -> Tensor"
    ),
}
PRIMITIVES = define(SCHEMAS)


def _mla_check(q, kv_latent, k_rope, kv_b_weight, num_heads, kv_lora_rank, nope, rope, v):
    if (q.shape[-1] != num_heads * (nope + rope) or kv_latent.shape[-1] != kv_lora_rank or k_rope.shape[-1] != rope
            or tuple(kv_b_weight.shape) != (num_heads * (nope + v), kv_lora_rank)):
        raise ValueError(f"inconsistent MLA shapes: q {tuple(q.shape)}, latent {tuple(kv_latent.shape)}, k_rope {tuple(k_rope.shape)}, "
                         f"kv_b {tuple(kv_b_weight.shape)} for {num_heads} heads, kv_lora_rank {kv_lora_rank}, nope/rope/v {nope}/{rope}/{v}")


def mla_rope_parts(q, k_rope, cos, sin, num_heads, nope, rope, interleave):
    """MLA head split + RoPE: q [B,S,H*(nope+rope)], k_rope [B,S,rope], cos/sin [B,S,rope] ->
    (q_pass [B,H,S,nope], q_rot [B,H,S,rope] RoPE'd, k_rot [B,1,S,rope] RoPE'd).
    ``interleave``: :func:`rope_interleave`, else rotate-half (modeling_deepseek_v3.apply_rotary_pos_emb).
    Shared by :func:`mla_kv_ref` and the ``mla_rope`` host kernel."""
    b, s, _ = q.shape
    qh = q.view(b, s, -1, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(qh, [nope, rope], dim=-1)
    k_rot = k_rope.view(b, 1, s, rope)
    if interleave:
        q_rot, k_rot = rope_interleave(q_rot, cos, sin), rope_interleave(k_rot, cos, sin)
    else:
        q_rot, k_rot = _apply_rope(q_rot, cos, sin), _apply_rope(k_rot, cos, sin)
    return q_pass, q_rot, k_rot


def _mla_queries(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads, kv_lora_rank, nope, rope, v, interleave):
    """Shape check (:func:`_mla_check`) + :func:`mla_rope_parts`; -> (B, S, q_pass, q_rot, k_rot)."""
    _mla_check(q, kv_latent, k_rope, kv_b_weight, num_heads, kv_lora_rank, nope, rope, v)
    b, s, _ = q.shape
    return (b, s, *mla_rope_parts(q, k_rope, cos, sin, num_heads, nope, rope, interleave))


def _mla_core(q_pass, q_rot, latent, k_rot, kv_b_weight, vis, num_heads, nope, v, scale):
    """Expand the latent (``kv_b_proj``), assemble keys ``[k_nope ‖ k_rot]``, SDPA; -> [B,S,H*v].
    Same ops as modeling_deepseek_v3.DeepseekV3Attention.expand_kv + sdpa_attention_forward."""
    b, _, s, _ = q_pass.shape
    query = torch.cat((q_pass, q_rot), dim=-1)
    n = latent.shape[2]
    kv = F.linear(latent, kv_b_weight).view(b, n, -1, nope + v).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v], dim=-1)
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    key = kv.new_empty(*kv.shape[:-1], nope + k_rot.shape[-1])
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(k_rot)
    mask = vis[None, None].expand(b, -1, s, vis.shape[-1])
    o = F.scaled_dot_product_attention(query, key, value, mask, scale=scale)
    return o.reshape(b, -1, s, v).transpose(1, 2).reshape(b, s, -1).contiguous()


@_impl("mla_kv")
def mla_kv_ref(q, kv_latent, k_rope, latent_cache, rope_cache, cache_position, cos, sin, kv_b_weight, num_heads: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float, rope_interleave: bool = True, q_lora_rank=None):
    """Multi-head latent attention (DeepSeek-V2/V3 MLA) over a static *latent* cache, as exported.

    q [B,S,H*(nope+rope)] (``q_b_proj`` output, or ``q_proj`` without q LoRA; pre-RoPE),
    kv_latent [B,S,r] (``kv_a_layernorm`` of the first r=kv_lora_rank features of
    ``kv_a_proj_with_mqa``), k_rope [B,S,rope] (its last rope features, pre-RoPE),
    latent_cache [B,1,L,r] / rope_cache [B,1,L,rope] (mutated: ``index_copy_(2,
    cache_position, ·)`` of the latent and the RoPE'd shared key), cos/sin [B,S,rope]
    (``rope_cos_sin``, YaRN tables), kv_b_weight [H*(nope+v), r] -> [B,S,H*v].
    ``scale`` is the exported softmax scale (qk_head_dim^-0.5 times the YaRN
    ``mscale(factor, mscale_all_dim)^2`` correction when rope_parameters carry it).
    ``q_lora_rank`` is descriptive (the q LoRA is carried by the linear/rms_norm before q).
    Expanded (non-absorbed) form, op for op: modeling_deepseek_v3.DeepseekV3Attention.forward
    and expand_kv, apply_rotary_pos_emb_interleave (``rope_interleave``; else rotate-half),
    StaticLayer.update, integrations/sdpa_attention.py with the causal bool mask.
    The PIM lowering executes the equivalent absorbed form (``lower_mla``).

    Raises:
        ValueError: inconsistent shapes.
    """
    nope, v = qk_nope_head_dim, v_head_dim
    b, s, q_pass, q_rot, k_rot = _mla_queries(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads, kv_lora_rank, nope, qk_rope_head_dim, v,
                                              rope_interleave)
    latent_cache.index_copy_(2, cache_position, kv_latent.view(b, 1, s, kv_lora_rank))
    rope_cache.index_copy_(2, cache_position, k_rot)
    vis = visible_mask(cache_position, latent_cache.shape[2], None)
    return _mla_core(q_pass, q_rot, latent_cache, rope_cache, kv_b_weight, vis, num_heads, nope, v, scale)


@_impl("mla")
def mla_ref(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
            v_head_dim: int, scale: float, rope_interleave: bool = True, q_lora_rank=None):
    """Causal MLA without cache (prefill from position 0): :func:`mla_kv_ref` with the prompt's
    own latents and RoPE'd shared keys as keys/values (shapes, sources and ``scale`` ditto;
    -> [B,S,H*v]).

    Raises:
        ValueError: inconsistent shapes.
    """
    nope, v = qk_nope_head_dim, v_head_dim
    b, s, q_pass, q_rot, k_rot = _mla_queries(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads, kv_lora_rank, nope, qk_rope_head_dim, v,
                                              rope_interleave)
    vis = visible_mask(torch.arange(s, device=q.device), s, None)
    return _mla_core(q_pass, q_rot, kv_latent.view(b, 1, s, kv_lora_rank), k_rot, kv_b_weight, vis, num_heads, nope, v, scale)


# ---------------------------------------------------------------- fake kernels


@_fake("mla_kv")
def _mla_kv_fake(q, kv_latent, k_rope, latent_cache, rope_cache, cache_position, cos, sin, kv_b_weight, num_heads, kv_lora_rank,
                 qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale, rope_interleave=True, q_lora_rank=None):
    return q.new_empty((*q.shape[:-1], num_heads * v_head_dim))


@_fake("mla")
def _mla_fake(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale,
              rope_interleave=True, q_lora_rank=None):
    return q.new_empty((*q.shape[:-1], num_heads * v_head_dim))
