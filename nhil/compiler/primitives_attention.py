"""``nhil::attention_scores`` / ``nhil::attention_values``: decode attention split at the soft-max,
for attention whose score transform is the model's own code (eager attention).

An eager attention layer computes ``matmul(q, Kᵀ)``, then its own transform of the scores
(scale, additive mask, ALiBi bias, soft-cap, ... then softmax), then ``matmul(p, V)``. The two
products over the KV cache are PIM-bound and named here; the transform between them runs
as host ATen, exactly as exported (``nhil.compiler.raise_anchor_eager.h_attention_eager``). The
device computes a score for every cache position (rows beyond the current one are zero, and
the model's own mask gives them probability 0).

Source: transformers 5.24 ``models/llama/modeling_llama.eager_attention_forward`` (and the
families that copy it), ``cache_utils.StaticCache.update`` (``index_copy_``),
``modeling_llama.repeat_kv``.
"""

from __future__ import annotations

import torch

from nhil.compiler.primitives import LIB, _check_heads, _fake, _heads, _impl, _repeat_kv

SCHEMAS = {
    "attention_scores": "attention_scores(Tensor q, Tensor k, Tensor(a!) k_cache, Tensor cache_position, int num_heads, int num_kv_heads) -> Tensor",
    "attention_values": "attention_values(Tensor probs, Tensor v, Tensor(a!) v_cache, Tensor cache_position, int num_heads, int num_kv_heads) -> Tensor",
}
for _schema in SCHEMAS.values():
    LIB.define(_schema)


@_impl("attention_scores")
def attention_scores_ref(q, k, k_cache, cache_position, num_heads: int, num_kv_heads: int):
    """q [B,S,Hq*hd], k [B,S,Hkv*hd] (written into k_cache [B,Hkv,L,hd] at ``cache_position``)
    -> raw scores ``matmul(q_h, repeat_kv(k_cache)ᵀ)`` [B,Hq,S,L].

    Raises:
        ValueError: inconsistent head counts / widths.
    """
    hd, n_rep = _check_heads(q, k, num_heads, num_kv_heads)
    k_cache.index_copy_(2, cache_position, _heads(k, hd))
    return torch.matmul(_heads(q, hd), _repeat_kv(k_cache, n_rep).transpose(2, 3))


@_impl("attention_values")
def attention_values_ref(probs, v, v_cache, cache_position, num_heads: int, num_kv_heads: int):
    """probs [B,Hq,S,L], v [B,S,Hkv*hd] (written into v_cache [B,Hkv,L,hd]) -> ``matmul(p, repeat_kv(v_cache))``
    re-laid out to [B,S,Hq*hd].

    Raises:
        ValueError: inconsistent head counts / widths.
    """
    hd = v.shape[-1] // num_kv_heads
    if num_heads % num_kv_heads or v.shape[-1] != num_kv_heads * hd or probs.shape[1] != num_heads:
        raise ValueError(f"bad head counts: probs {tuple(probs.shape)}, v width {v.shape[-1]}, {num_heads} q heads, {num_kv_heads} kv heads")
    v_cache.index_copy_(2, cache_position, _heads(v, hd))
    o = torch.matmul(probs, _repeat_kv(v_cache, num_heads // num_kv_heads))
    b, _, s, _ = o.shape
    return o.transpose(1, 2).reshape(b, s, -1).contiguous()


@_fake("attention_scores")
def _scores_fake(q, k, k_cache, cache_position, num_heads, num_kv_heads):
    return q.new_empty((q.shape[0], num_heads, q.shape[1], k_cache.shape[2]))


@_fake("attention_values")
def _values_fake(probs, v, v_cache, cache_position, num_heads, num_kv_heads):
    return probs.new_empty((probs.shape[0], probs.shape[2], num_heads * v_cache.shape[3]))
