"""Attention primitives over a static KV cache and without one.

* ``nhil::attention_kv`` / ``nhil::attention``: causal GQA attention, the key/value write into the
  static cache included (``attention_kv``), with sliding window, logit soft-cap (Gemma-2) or per-head
  sinks (GPT-OSS). Source: transformers 5.24 ``cache_utils.StaticCache.update`` (``index_copy_``),
  ``masking_utils`` causal / sliding-window masks, ``modeling_llama.repeat_kv``,
  ``integrations/sdpa_attention.py``, ``modeling_gemma2.eager_attention_forward``,
  ``modeling_gpt_oss.eager_attention_forward``.
* ``nhil::attention_scores`` / ``nhil::attention_values``: decode attention split at the soft-max,
  for attention whose score transform is the model's own code (eager attention). An eager attention
  layer computes ``matmul(q, Kᵀ)``, then its own transform of the scores (scale, additive mask, ALiBi
  bias, soft-cap, ... then softmax), then ``matmul(p, V)``. The two products over the KV cache are
  PIM-bound and named here; the transform between them runs as host ATen, exactly as exported
  (``nhil.compiler.raise_anchor_eager.h_attention_eager``). The device computes a score for every
  cache position (rows beyond the current one are zero, and the model's own mask gives them
  probability 0). Source: ``models/llama/modeling_llama.eager_attention_forward`` (and the families
  that copy it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_lib import _fake, _heads, _impl, define

SCHEMAS = {
    "attention_kv": (
        "attention_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor cache_position, int num_heads, int num_kv_heads, float scale, int? window=None, "
        "float? softcap=None, *, Tensor? sinks=None) -> Tensor"
    ),
    "attention": (
        "attention(Tensor q, Tensor k, Tensor v, int num_heads, int num_kv_heads, float scale, "
        "int? window=None, float? softcap=None, *, Tensor? sinks=None) -> Tensor"
    ),
    "attention_scores": "attention_scores(Tensor q, Tensor k, Tensor(a!) k_cache, Tensor cache_position, int num_heads, int num_kv_heads) -> Tensor",
    "attention_values": "attention_values(Tensor probs, Tensor v, Tensor(a!) v_cache, Tensor cache_position, int num_heads, int num_kv_heads) -> Tensor",
}
PRIMITIVES = define(SCHEMAS)


def _repeat_kv(xh: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B,Hkv,L,hd] -> [B,Hkv*n_rep,L,hd] (modeling_llama.repeat_kv: None-index, expand, reshape)."""
    b, hkv, slen, hd = xh.shape
    return xh[:, :, None, :, :].expand(b, hkv, n_rep, slen, hd).reshape(b, hkv * n_rep, slen, hd)


def _sdpa_flat(qh, kh, vh, mask, scale, s):
    """SDPA + the exported output re-layout: [B,Hq,S,hd] -> [B,S,Hq*hd]."""
    b, _, _, hd = qh.shape
    o = F.scaled_dot_product_attention(qh, kh, vh, mask, scale=scale)
    return o.reshape(b, -1, s, hd).transpose(1, 2).reshape(b, s, -1).contiguous()


def _check_heads(q, k, num_heads, num_kv_heads):
    if num_heads % num_kv_heads or q.shape[-1] % num_heads:
        raise ValueError(f"bad head counts: q width {q.shape[-1]}, {num_heads} q heads, {num_kv_heads} kv heads")
    hd = q.shape[-1] // num_heads
    if k.shape[-1] != num_kv_heads * hd:
        raise ValueError(f"k width {k.shape[-1]} != {num_kv_heads} kv heads * head_dim {hd}")
    return hd, num_heads // num_kv_heads


def visible_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """bool [S, kv_len]: key j visible to the query at position ``q_pos[i]`` iff
    ``j <= q_pos[i]`` (causal, masking_utils.causal_mask_function) and, with a sliding
    window W, ``j > q_pos[i] - W`` (masking_utils.sliding_window_overlay)."""
    kv_idx = torch.arange(kv_len, device=q_pos.device)
    vis = kv_idx[None, :] <= q_pos[:, None]
    if window is not None:
        vis = vis & (kv_idx[None, :] > q_pos[:, None] - window)
    return vis


def _attend_sinks(qh, kh, vh, fmask, scale, s, sinks):
    """Eager attention with per-head sink logits (modeling_gpt_oss.eager_attention_forward):
    ``matmul(q, kᵀ)*scale + additive mask``, the sink logit of each head appended as an
    extra column, ``- max``, softmax (fp32), sink column dropped, ``matmul(·, v)``."""
    b = qh.shape[0]
    w = torch.matmul(qh, kh.transpose(2, 3)) * scale
    w = w + fmask
    sk = sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    comb = torch.cat([w, sk], dim=-1)
    comb = comb - comb.max(dim=-1, keepdim=True).values
    probs = F.softmax(comb, dim=-1, dtype=comb.dtype)
    o = torch.matmul(probs[..., :-1], vh)
    return o.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()


def _attend(qh, kh, vh, vis, scale, s, softcap, sinks=None):
    """Attention core over [B,H,*,hd] heads with bool visibility ``vis`` [S, L].

    * ``softcap is None``: SDPA with the boolean mask (integrations/sdpa_attention.py).
    * ``softcap`` set: the eager form of gemma2's ``eager_attention_forward``:
      ``matmul(q, kᵀ)*scale / c -> tanh -> *c -> + additive mask (0 / finfo.min,
      masking_utils.eager_mask) -> softmax(fp32) -> matmul(·, v)``.
    * ``sinks`` [Hq] set: GPT-OSS eager attention with sinks (:func:`_attend_sinks`).
    Output re-laid out to [B,S,Hq*hd].
    """
    b, _, _, hd = qh.shape
    mask = vis[None, None].expand(b, -1, s, vis.shape[-1])
    if sinks is not None:
        if softcap is not None:
            raise ValueError("attention with both sinks and a soft-cap is not supported")
        if sinks.shape != (qh.shape[1],):
            raise ValueError(f"attention sinks {tuple(sinks.shape)} must be one logit per query head ({qh.shape[1]})")
        fmask = torch.where(mask, torch.zeros((), dtype=qh.dtype), torch.finfo(qh.dtype).min)
        return _attend_sinks(qh, kh, vh, fmask, scale, s, sinks)
    if softcap is None:
        return _sdpa_flat(qh, kh, vh, mask, scale, s)
    fmask = torch.where(mask, torch.zeros((), dtype=qh.dtype), torch.finfo(qh.dtype).min)
    w = torch.matmul(qh, kh.transpose(2, 3)) * scale
    w = w / softcap
    w = torch.tanh(w)
    w = w * softcap
    w = w + fmask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(qh.dtype)
    o = torch.matmul(w, vh)
    return o.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()


@_impl("attention_kv")
def attention_kv_ref(q, k, v, k_cache, v_cache, cache_position, num_heads: int, num_kv_heads: int, scale: float, window=None, softcap=None, *, sinks=None):
    """Static-KV-cache causal GQA attention.

    q [B,S,Hq*hd], k/v [B,S,Hkv*hd] (k already RoPE'd), k_cache/v_cache [B,Hkv,L,hd]
    (mutated in place: ``index_copy_(2, cache_position, ·)``), cache_position [S] int64
    -> [B,S,Hq*hd]. Key j is visible to query i iff ``j <= cache_position[i]`` and, with
    a sliding ``window`` W, ``j > cache_position[i] - W``. ``softcap`` c: attention logits
    soft-capped ``c*tanh(s/c)`` (eager form, see :func:`_attend`). ``sinks`` [Hq]: a learned
    per-head logit in the softmax denominator (GPT-OSS, :func:`_attend_sinks`).
    Source: transformers StaticCache.update (index_copy_), masking_utils causal /
    sliding-window masks (bool [B,1,S,L]), modeling_llama.repeat_kv and
    sdpa_attention_forward (``F.scaled_dot_product_attention(q, k, v, mask, scale=scale)``),
    modeling_gemma2.eager_attention_forward (soft-cap).

    Raises:
        ValueError: inconsistent head counts / widths.
    """
    hd, n_rep = _check_heads(q, k, num_heads, num_kv_heads)
    b, s, _ = q.shape
    k_cache.index_copy_(2, cache_position, _heads(k, hd))
    v_cache.index_copy_(2, cache_position, _heads(v, hd))
    vis = visible_mask(cache_position, k_cache.shape[2], window)
    return _attend(_heads(q, hd), _repeat_kv(k_cache, n_rep), _repeat_kv(v_cache, n_rep), vis, scale, s, softcap, sinks)


@_impl("attention")
def attention_ref(q, k, v, num_heads: int, num_kv_heads: int, scale: float, window=None, softcap=None, *, sinks=None):
    """Causal GQA attention without cache (prefill from position 0).

    q [B,S,Hq*hd], k/v [B,S,Hkv*hd] -> [B,S,Hq*hd]; key j visible to query i iff j <= i
    (and j > i - window with a sliding window). Same op sequence as
    :func:`attention_kv_ref` minus the cache write (sources ditto).

    Raises:
        ValueError: inconsistent head counts / widths.
    """
    hd, n_rep = _check_heads(q, k, num_heads, num_kv_heads)
    b, s, _ = q.shape
    vis = visible_mask(torch.arange(s, device=q.device), s, window)
    return _attend(_heads(q, hd), _repeat_kv(_heads(k, hd), n_rep), _repeat_kv(_heads(v, hd), n_rep), vis, scale, s, softcap, sinks)


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


# ---------------------------------------------------------------- fake kernels


@_fake("attention_kv")
def _attention_kv_fake(q, k, v, k_cache, v_cache, cache_position, num_heads, num_kv_heads, scale, window=None, softcap=None, **kwargs):
    return torch.empty_like(q)


@_fake("attention")
def _attention_fake(q, k, v, num_heads, num_kv_heads, scale, window=None, softcap=None, **kwargs):
    return torch.empty_like(q)


@_fake("attention_scores")
def _scores_fake(q, k, k_cache, cache_position, num_heads, num_kv_heads):
    return q.new_empty((q.shape[0], num_heads, q.shape[1], k_cache.shape[2]))


@_fake("attention_values")
def _values_fake(probs, v, v_cache, cache_position, num_heads, num_kv_heads):
    return probs.new_empty((probs.shape[0], probs.shape[2], num_heads * v_cache.shape[3]))
