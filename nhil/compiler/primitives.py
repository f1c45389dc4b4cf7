"""nhil graph-IR primitives (``torch.ops.nhil.*``), registered with ``torch.library``.

Each primitive has a *reference kernel*, which is its numerics definition, and a *fake
kernel* (shapes/dtypes only, for ``FakeTensorProp`` and export). The reference kernels
use the same torch ops in the same order as transformers 5.24's Llama code
(``transformers/models/llama/modeling_llama.py``, ``integrations/sdpa_attention.py``,
``masking_utils.py``; GPT-2's ``modeling_gpt2.py``, ``pytorch_utils.Conv1D`` and
``activations.NewGELUActivation`` for ``layer_norm`` / ``gelu`` / ``pos_embedding`` and the
Conv1D ``linear``) as they appear in the exported ATen graph, so a raised graph is
bit-identical to the exported one.

Layout convention: activations are token-major ``[B, S, features]``; multi-head tensors
are flat with heads concatenated (``[B, S, heads * head_dim]``), as fed to / produced by
the q/k/v/o projections. All float tensors are fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LIB = torch.library.Library("nhil", "DEF")  # noqa: the library object must stay alive

_SCHEMAS = {
    "embedding": "embedding(Tensor table, Tensor ids, float? scale=None) -> Tensor",
    "gelu_mul": "gelu_mul(Tensor gate, Tensor up, str approximate='tanh') -> Tensor",
    "softcap": "softcap(Tensor x, float cap) -> Tensor",
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, int? head_dim=None, bool unit_offset=False) -> Tensor",
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "rope_cos_sin": "rope_cos_sin(Tensor position_ids, Tensor inv_freq, float attention_scaling, *, bool half=False) -> (Tensor, Tensor)",
    "rope": "rope(Tensor x, Tensor cos, Tensor sin, int head_dim, int? rotary_dim=None, *, str style='rotate_half') -> Tensor",
    "narrow": "narrow(Tensor x, int start, int length) -> Tensor",
    "attention_kv": (
        "attention_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor cache_position, int num_heads, int num_kv_heads, float scale, int? window=None, "
        "float? softcap=None, *, Tensor? sinks=None) -> Tensor"
    ),
    "attention": (
        "attention(Tensor q, Tensor k, Tensor v, int num_heads, int num_kv_heads, float scale, "
        "int? window=None, float? softcap=None, *, Tensor? sinks=None) -> Tensor"
    ),
    "silu_mul": "silu_mul(Tensor gate, Tensor up) -> Tensor",
    "add": "add(Tensor a, Tensor b) -> Tensor",
    "layer_norm": "layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    "gelu": "gelu(Tensor x, str variant='gelu_new') -> Tensor",
    "pos_embedding": "pos_embedding(Tensor x, Tensor table, Tensor position_ids) -> Tensor",
    "moe": (
        "moe(Tensor x, Tensor router_weight, Tensor gate_up_proj, Tensor down_proj, int num_experts, int top_k, "
        "str score_func='softmax', bool norm_topk_prob=True, str act='silu', "
        # DeepSeek-V3 sigmoid rule: bias-corrected grouped top-k, routed scaling factor
        "Tensor? score_bias=None, int n_group=1, int topk_group=1, float routed_scaling_factor=1.0, *, "
        # shared expert (Qwen2-MoE: SwiGLU MLP on every token, optionally sigmoid-gated)
        "Tensor? shared_gate_proj=None, Tensor? shared_up_proj=None, Tensor? shared_down_proj=None, "
        "Tensor? shared_expert_gate=None, "
        # GPT-OSS: biased router, top-k -> softmax, transposed interleaved biased experts, clamped SwiGLU
        "Tensor? router_bias=None, bool softmax_after_topk=False, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
        "str experts_layout='concat', float swiglu_alpha=1.702, float swiglu_limit=7.0) -> Tensor"
    ),
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
for _schema in _SCHEMAS.values():
    LIB.define(_schema)

PRIMITIVES = tuple(_SCHEMAS)


def _impl(name):
    def deco(fn):
        torch.library.impl(f"nhil::{name}", "CompositeExplicitAutograd", lib=LIB)(fn)
        return fn

    return deco


def _fake(name):
    return torch.library.register_fake(f"nhil::{name}", lib=LIB)


# ---------------------------------------------------------------- reference kernels


@_impl("embedding")
def embedding_ref(table: torch.Tensor, ids: torch.Tensor, scale=None) -> torch.Tensor:
    """Row gather: table [V,H] fp32, ids [B,S] int64 -> [B,S,H]. Source: nn.Embedding (aten.embedding).

    ``scale``: Gemma's ``embed * embed_scale`` with the scale as an fp32 0-d tensor
    (modeling_gemma2.Gemma2TextScaledWordEmbedding: ``embed_scale.to(weight.dtype)``).
    """
    out = F.embedding(ids, table)
    if scale is not None:
        out = out * torch.tensor(scale, dtype=table.dtype)
    return out


@_impl("gelu_mul")
def gelu_mul_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU gating ``gelu(gate, approximate) * up`` (Gemma ``gelu_pytorch_tanh``;
    modeling_gemma2.Gemma2MLP: ``act_fn(gate_proj(x)) * up_proj(x)``); gate/up [B,S,I]."""
    return F.gelu(gate, approximate=approximate) * up


@_impl("softcap")
def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Final-logit soft-capping ``tanh(x / cap) * cap`` (modeling_gemma2.Gemma2ForCausalLM)."""
    return torch.tanh(x / cap) * cap


@_impl("rms_norm")
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim=None, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim: x [B,S,H], weight [H] -> [B,S,H].

    Default (LlamaRMSNorm; also Mistral/Qwen2/Qwen3/OLMo-2/Phi-3, whose fp32 cast order
    differs only by identity casts in fp32):
    ``weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``, x32 = x in fp32.

    ``head_dim`` d: per-head QK-norm (Qwen3/Gemma3 ``q_norm``/``k_norm``): x is the flat
    [B,S,nh*d] projection, normalised over each head's d elements with weight [d].
    ``unit_offset``: the Gemma "(1+w)" form, ``(h * (1.0 + weight.float())).to(dtype)``
    with h the normalised fp32 input (modeling_gemma2.Gemma2RMSNorm).
    """
    shape = x.shape
    if head_dim is not None:
        x = x.view(*shape[:-1], -1, head_dim)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if unit_offset:
        out = (h * (1.0 + weight.float())).to(input_dtype)
    else:
        out = weight * h.to(input_dtype)
    return out.reshape(shape) if head_dim is not None else out


@_impl("linear")
def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [B,S,K] @ weight[N,K]^T (+ bias[N]) -> [B,S,N] (torch.nn.functional.linear).

    GPT-2's ``Conv1D`` (pytorch_utils.Conv1D: ``addmm(bias, x.view(-1, K), W).view(..., N)``
    with W [K,N]) is raised to this primitive with ``weight = W.t()``, the transposed
    *view* of the [K,N] parameter (strides (1, N), no copy). For a contiguous 3-D / 2-D
    input with a bias, ``F.linear`` computes ``addmm(bias, x2d, weight.t())`` and
    ``weight.t()`` is then W itself, so the BLAS call is Conv1D's and the result is bit
    for bit the same. A contiguous copy of Wᵀ is *not*: it changes the BLAS call
    (measured with torch 2.13 CPU: differences up to 5e-5 for 768x2304 weights, 3e-6
    for 256x64 with 5 rows).
    """
    return F.linear(x, weight, bias)


@_impl("layer_norm")
def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: x [B,S,H] fp32, weight/bias [H] (or None) -> [B,S,H].

    ``F.layer_norm(x, (H,), weight, bias, eps)``: torch.nn.LayerNorm.forward, which the
    export records as one ``aten.layer_norm`` (GPT-2 ``ln_1`` / ``ln_2`` / ``ln_f``).
    Biased variance, eps inside the square root: ``(x - mean) / sqrt(var + eps) * w + b``.
    """
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


GELU_VARIANTS = ("gelu_new", "tanh", "none")


@_impl("gelu")
def gelu_ref(x: torch.Tensor, variant: str = "gelu_new") -> torch.Tensor:
    """GELU activation (no gating): x [B,S,I] -> [B,S,I].

    ``variant``:

    * ``gelu_new``: the tanh approximation *spelled out* as transformers'
      ``activations.NewGELUActivation`` (GPT-2 ``activation_function="gelu_new"``):
      ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))``, the same ops in
      the same order (``pow`` then ``mul`` ..., as recorded by the export). It is not
      bit-identical to ``F.gelu(approximate="tanh")``, which fuses the formula.
    * ``tanh``: ``F.gelu(x, approximate="tanh")`` (``GELUTanh`` / ``gelu_pytorch_tanh``).
    * ``none``: exact erf GELU ``F.gelu(x)`` (``GELUActivation``).

    Raises:
        ValueError: unknown variant.
    """
    if variant == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if variant in ("tanh", "none"):
        return F.gelu(x, approximate=variant)
    raise ValueError(f"gelu variant {variant!r} is not supported ({', '.join(GELU_VARIANTS)})")


@_impl("pos_embedding")
def pos_embedding_ref(x: torch.Tensor, table: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Learned absolute positions: ``x + table[position_ids]``.

    x [B,S,H] fp32 (token embeddings), table [P,H] fp32 (GPT-2 ``wpe``), position_ids
    [B,S] int64 (or [S], read as [1,S]) -> [B,S,H]. Source: modeling_gpt2.GPT2Model.forward
    ``inputs_embeds + self.wpe(position_ids)`` (aten.embedding then aten.add).

    Raises:
        IndexError: a position beyond the table (``F.embedding``'s error).
    """
    return x + F.embedding(_positions_2d(position_ids), table)


def _positions_2d(position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids


@_impl("rope_cos_sin")
def rope_cos_sin_ref(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, *, half: bool = False):
    """Default-RoPE tables: position_ids [B,S] int64 (or [S], read as [1,S]), inv_freq [hd/2] fp32
    -> (cos, sin), each [B,S,hd] fp32.

    ``freqs = pos[..., None].float() * inv_freq``; ``emb = cat(freqs, freqs)``;
    ``cos = emb.cos() * scaling``, ``sin = emb.sin() * scaling``
    (modeling_llama.LlamaRotaryEmbedding.forward in transformers 5.24, which uses a
    broadcast multiply, not the older matmul). The inv_freq buffer carries the scaling
    type (default / linear / llama3 / YaRN frequencies), ``attention_scaling`` YaRN's mscale.

    ``half``: tables of hd/2 frequencies, ``emb = freqs`` (no cat) -> [B,S,hd/2]
    (modeling_gpt_oss.GptOssRotaryEmbedding.forward), for ``rope(style='split_half')``.
    """
    pos = _positions_2d(position_ids)
    freqs = pos[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = freqs if half else torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos, sin


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B,S,n*hd] -> [B,n,S,hd] view (as LlamaAttention: view(..., -1, hd).transpose(1, 2))."""
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(xh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (xh * cos) + (_rotate_half(xh) * sin)


def _apply_rope_split_half(xh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """modeling_gpt_oss._apply_rotary_emb with half tables: ``x1, x2 = chunk(x, 2)``;
    ``cat(x1*cos - x2*sin, x2*cos + x1*sin)``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    x1, x2 = torch.chunk(xh, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


ROPE_STYLES = ("rotate_half", "split_half")


@_impl("rope")
def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim=None, *, style: str = "rotate_half") -> torch.Tensor:
    """Rotate-half RoPE per head: x [B,S,nh*hd], cos/sin [B,S,rd] -> [B,S,nh*hd] (same layout).

    ``x*cos + rotate_half(x)*sin`` per head (modeling_llama.apply_rotary_pos_emb). With
    ``rotary_dim`` rd < hd (partial rotary, Phi-3 ``partial_rotary_factor``): only the
    first rd elements of each head rotate, the rest pass through
    (modeling_phi3.apply_rotary_pos_emb: slice, rotate, cat).

    ``style='split_half'`` (GPT-OSS): cos/sin are half tables [B,S,hd/2]
    (``rope_cos_sin(half=True)``) and each head is rotated as
    ``cat(x1*cos - x2*sin, x2*cos + x1*sin)`` (modeling_gpt_oss._apply_rotary_emb).

    Raises:
        ValueError: unknown style, or split_half with partial rotary.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style {style!r} is not supported ({', '.join(ROPE_STYLES)})")
    b, s, _ = x.shape
    xh = _heads(x, head_dim)
    if style == "split_half":
        if rotary_dim is not None:
            raise ValueError("rope style 'split_half' with partial rotary is not supported")
        return _apply_rope_split_half(xh, cos, sin).transpose(1, 2).reshape(b, s, -1).contiguous()
    if rotary_dim is None:
        out = _apply_rope(xh, cos, sin)
    else:
        x_rot, x_pass = xh[..., :rotary_dim], xh[..., rotary_dim:]
        out = torch.cat([_apply_rope(x_rot, cos, sin), x_pass], dim=-1)
    return out.transpose(1, 2).reshape(b, s, -1).contiguous()


@_impl("narrow")
def narrow_ref(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Feature slice ``x[..., start:start+length]`` (a copy): splits fused projections
    (Phi-3 ``qkv_proj`` / ``gate_up_proj``; aten.slice / aten.chunk in the export)."""
    return x[..., start : start + length].clone()


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


@_impl("silu_mul")
def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU gating ``silu(gate) * up``; gate/up [B,S,I] -> [B,S,I] (LlamaMLP.forward)."""
    return F.silu(gate) * up


@_impl("add")
def add_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Residual add ``a + b`` (same shapes) (LlamaDecoderLayer.forward)."""
    return a + b


MOE_SCORE_FUNCS = ("softmax", "sigmoid")
MOE_ACTS = ("silu", "swiglu_clamp")
MOE_LAYOUTS = ("concat", "transposed_interleaved")


def moe_routing(logits: torch.Tensor, top_k: int, score_func: str = "softmax", norm_topk_prob: bool = True,
                score_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                routed_scaling_factor: float = 1.0, softmax_after_topk: bool = False):
    """Routing rule of :func:`moe_ref`: router logits [T,E] fp32 -> (weights [T,k] fp32, expert ids [T,k] int64).

    ``softmax`` (Mixtral / Qwen3-MoE): ``softmax`` (fp32) -> ``topk(k)`` (largest, sorted;
    ties resolved as torch.topk on CPU does, which is *not* lowest index first: all-equal
    [1,4] scores select experts 2, 3) -> with ``norm_topk_prob`` the in-place
    renormalisation ``w /= w.sum(-1, keepdim=True)``. Source:
    modeling_mixtral.MixtralTopKRouter.forward, modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    (transformers 5.24).

    ``sigmoid`` (DeepSeek-V3 "noaux_tc", modeling_deepseek_v3.DeepseekV3TopkRouter.forward):
    ``s = sigmoid(logits)``; selection scores ``s' = s + score_bias`` (``e_score_correction_bias``
    [E] fp32, required; it only steers selection); group score = sum of the top-2 ``s'`` of
    each of the ``n_group`` groups of E/n_group experts; the ``topk_group`` best groups are
    kept (``scatter_`` mask, others ``-inf``); ids = ``topk(s', k, sorted=False)``; weights
    = ``s.gather(ids)`` (uncorrected), with ``norm_topk_prob`` divided by ``sum + 1e-20``.

    ``softmax_after_topk`` (GPT-OSS, with ``softmax``): ``topk`` of the logits, then ``softmax``
    (fp32) over the k selected logits, dim 1 (modeling_gpt_oss.GptOssTopKRouter.forward); the
    router bias is part of the logits; ``norm_topk_prob`` does not apply then.

    All: ``routed_scaling_factor`` != 1 multiplies the weights last (``w * factor``).
    Shared by the reference kernel and the ``moe_route`` host kernel so both route identically.

    Raises:
        ValueError: unknown score function, ``sigmoid`` without ``score_bias``, or E not
            divisible by ``n_group``.
    """
    if score_func not in MOE_SCORE_FUNCS:
        raise ValueError(f"moe score function {score_func!r} is not supported ({', '.join(MOE_SCORE_FUNCS)})")
    if score_func == "softmax" and softmax_after_topk:
        v, ids = torch.topk(logits, top_k)
        w = F.softmax(v, dim=1, dtype=torch.float32)
    elif score_func == "softmax":
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, top_k)
        if norm_topk_prob:
            w /= w.sum(dim=-1, keepdim=True)
    else:
        e = logits.shape[-1]
        if score_bias is None or n_group < 1 or e % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"sigmoid routing needs score_bias [E] and n_group dividing E={e} (n_group={n_group}, topk_group={topk_group}, bias {'missing' if score_bias is None else 'given'})")
        scores = logits.sigmoid()
        choice = scores + score_bias
        group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if norm_topk_prob:
            denominator = w.sum(dim=-1, keepdim=True) + 1e-20
            w /= denominator
    if routed_scaling_factor != 1.0:
        w = w * routed_scaling_factor
    return w, ids


def moe_expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-slot expert SwiGLU of ``integrations/moe.batched_mm_experts_forward``: x [S,H] (token of
    each slot), gate_up [E,2I,H], down [E,H,I], ids [S] -> [S,H]
    (``bmm(gate_up[ids], x[...,None])`` -> chunk -> ``silu(g)*u`` -> ``bmm(down[ids], ·)``)."""
    gu = torch.bmm(gate_up[ids], x.unsqueeze(-1)).squeeze(-1)
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    return torch.bmm(down[ids], a.unsqueeze(-1)).squeeze(-1)


def moe_shared_expert(hs: torch.Tensor, gate_proj, up_proj, down_proj, expert_gate=None) -> torch.Tensor:
    """Shared expert of a MoE block, run on every token: hs [T,H] fp32 -> [T,H].

    ``down(silu(gate(hs)) * up(hs))`` with gate/up [I,H], down [H,I] (a SwiGLU
    ``Qwen2MoeMLP``), then, with ``expert_gate`` [1,H], scaled by
    ``sigmoid(F.linear(hs, expert_gate))`` ([T,1], broadcast over H). Source:
    modeling_qwen2_moe.Qwen2MoeSparseMoeBlock.forward / Qwen2MoeMLP.forward (transformers 5.24).
    """
    y = F.linear(F.silu(F.linear(hs, gate_proj)) * F.linear(hs, up_proj), down_proj)
    if expert_gate is not None:
        y = F.sigmoid(F.linear(hs, expert_gate)) * y
    return y


def _check_shared(h: int, shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate) -> None:
    """Shapes of the shared-expert tensors of :func:`moe_ref` (all three projections or none)."""
    given = [t is not None for t in (shared_gate_proj, shared_up_proj, shared_down_proj)]
    if any(given) and not all(given):
        raise ValueError("moe shared expert needs all of shared_gate_proj, shared_up_proj and shared_down_proj")
    if shared_expert_gate is not None and not all(given):
        raise ValueError("moe shared_expert_gate given without a shared expert")
    if all(given):
        i = shared_gate_proj.shape[0]
        ok = tuple(shared_gate_proj.shape) == (i, h) and tuple(shared_up_proj.shape) == (i, h) and tuple(shared_down_proj.shape) == (h, i)
        if not ok or (shared_expert_gate is not None and tuple(shared_expert_gate.shape) != (1, h)):
            raise ValueError(
                f"inconsistent moe shared-expert shapes: gate {tuple(shared_gate_proj.shape)}, up {tuple(shared_up_proj.shape)}, "
                f"down {tuple(shared_down_proj.shape)}, expert gate {None if shared_expert_gate is None else tuple(shared_expert_gate.shape)} (H={h})")


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS clamped SwiGLU: ``g = gate.clamp(max=limit)``, ``u = up.clamp(-limit, limit)``,
    ``(u + 1) * (g * sigmoid(g * alpha))`` (modeling_gpt_oss.GptOssExperts._apply_gate)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def moe_expert_ffn_gpt_oss(x, gate_up, gate_up_bias, down, down_bias, ids, alpha: float, limit: float) -> torch.Tensor:
    """Per-slot expert FFN of GPT-OSS with ``batched_mm`` (integrations/moe._batched_linear with
    ``is_transposed=True``, ``has_bias=True``): x [S,H], gate_up [E,H,2I] (gate = even columns,
    up = odd columns), gate_up_bias [E,2I], down [E,I,H], down_bias [E,H], ids [S] -> [S,H].
    ``bmm(x[:,None], gate_up[ids]) + bias`` -> :func:`swiglu_clamp` of the strided halves ->
    ``bmm(·[:,None], down[ids]) + bias``."""
    gu = torch.bmm(x.unsqueeze(1), gate_up[ids]).squeeze(1)
    gu.add_(gate_up_bias[ids])
    a = swiglu_clamp(gu[..., ::2], gu[..., 1::2], alpha, limit)
    y = torch.bmm(a.unsqueeze(1), down[ids]).squeeze(1)
    y.add_(down_bias[ids])
    return y


@_impl("moe")
def moe_ref(x, router_weight, gate_up_proj, down_proj, num_experts: int, top_k: int, score_func: str = "softmax", norm_topk_prob: bool = True, act: str = "silu",
            score_bias=None, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
            *, shared_gate_proj=None, shared_up_proj=None, shared_down_proj=None, shared_expert_gate=None,
            router_bias=None, softmax_after_topk: bool = False, gate_up_bias=None, down_bias=None,
            experts_layout: str = "concat", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):
    """Sparse MoE block: x [B,S,H] fp32 -> [B,S,H].

    router_weight [E,H]; gate_up_proj [E,2I,H] (gate rows first, then up rows);
    down_proj [E,H,I]. Routing: :func:`moe_routing` over ``F.linear(x, router_weight)``
    (``score_bias`` [E], ``n_group``, ``topk_group``, ``routed_scaling_factor``: the
    DeepSeek-V3 sigmoid rule, defaults = the softmax rule of Mixtral). Shared experts are
    not part of this primitive: DeepSeek-V3's ``shared_experts`` is a plain
    ``DeepseekV3MLP`` and raises into ``linear`` / ``silu_mul`` plus an ``add``.
    Each token's k selected experts run the SwiGLU FFN (:func:`moe_expert_ffn`), are scaled
    by their routing weight and summed in slot order (``view(T,k,H).sum(1)``).
    Same torch ops in the same order as transformers 5.24 with
    ``experts_implementation="batched_mm"`` (modeling_mixtral.MixtralSparseMoeBlock /
    Qwen3MoeSparseMoeBlock, integrations/moe.batched_mm_experts_forward), so the exported
    region raises bit-exactly.

    Keyword-only (all default to "absent"): a shared expert ``shared_gate_proj`` /
    ``shared_up_proj`` [I_s,H], ``shared_down_proj`` [H,I_s], run on every token, with an
    optional sigmoid gate ``shared_expert_gate`` [1,H] (:func:`moe_shared_expert`); the
    block output is then ``routed + shared`` (Qwen2-MoE).

    GPT-OSS (modeling_gpt_oss.GptOssMLP / GptOssTopKRouter / GptOssExperts with
    ``batched_mm``): ``router_bias`` [E] added by the router linear; ``softmax_after_topk``
    (:func:`moe_routing`); ``experts_layout='transposed_interleaved'``: gate_up_proj
    [E,H,2I] with interleaved gate/up columns, down_proj [E,I,H], with ``gate_up_bias``
    [E,2I] and ``down_bias`` [E,H] (:func:`moe_expert_ffn_gpt_oss`); ``act='swiglu_clamp'``
    with ``swiglu_alpha`` / ``swiglu_limit`` (:func:`swiglu_clamp`).

    Raises:
        ValueError: unsupported score function / activation, or inconsistent shapes.
    """
    if act not in MOE_ACTS:
        raise ValueError(f"moe activation {act!r} is not supported ({', '.join(MOE_ACTS)})")
    if experts_layout not in MOE_LAYOUTS:
        raise ValueError(f"moe experts layout {experts_layout!r} is not supported ({', '.join(MOE_LAYOUTS)})")
    gpt_oss = experts_layout == "transposed_interleaved"
    if gpt_oss != (act == "swiglu_clamp") or gpt_oss != (gate_up_bias is not None) or gpt_oss != (down_bias is not None):
        raise ValueError("moe: the transposed_interleaved layout goes with act='swiglu_clamp' and expert biases (GPT-OSS), and only with them")
    b, s, h = x.shape
    e = router_weight.shape[0]
    hdim, odim = (1, 2) if gpt_oss else (2, 1)
    if e != num_experts or gate_up_proj.shape[0] != e or down_proj.shape[0] != e or gate_up_proj.shape[hdim] != h or down_proj.shape[odim] != h or not 0 < top_k <= e:
        raise ValueError(f"inconsistent moe shapes: x {tuple(x.shape)}, router {tuple(router_weight.shape)}, gate_up {tuple(gate_up_proj.shape)}, down {tuple(down_proj.shape)}, E={num_experts}, k={top_k}")
    if router_bias is not None and tuple(router_bias.shape) != (e,):
        raise ValueError(f"moe router bias {tuple(router_bias.shape)} is not [E={e}]")
    _check_shared(h, shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate)
    hs = x.view(-1, h)
    shared = None
    if shared_gate_proj is not None:
        shared = moe_shared_expert(hs, shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate)
    logits = F.linear(hs.reshape(-1, h), router_weight, router_bias)
    w, ids = moe_routing(logits, top_k, score_func, norm_topk_prob, score_bias, n_group, topk_group, routed_scaling_factor, softmax_after_topk=softmax_after_topk)
    xs = hs.repeat_interleave(top_k, dim=0)
    if gpt_oss:
        y = moe_expert_ffn_gpt_oss(xs, gate_up_proj, gate_up_bias, down_proj, down_bias, ids.reshape(-1), swiglu_alpha, swiglu_limit)
    else:
        y = moe_expert_ffn(xs, gate_up_proj, down_proj, ids.reshape(-1))
    y = y * w.reshape(-1).unsqueeze(-1)
    out = y.view(-1, top_k, h).sum(dim=1)
    if shared is not None:
        out = out + shared
    return out.reshape(b, s, h)


def rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE of DeepSeek (``rope_interleave=True``): x [B,H,S,d], cos/sin [B,S,d]
    (``cat(freqs, freqs)`` tables) -> [B,H,S,d], pairs (x0,x1),(x2,x3).. rotated, output laid out
    as ``cat(even', odd')``. Same ops as modeling_deepseek_v3.apply_rotary_pos_emb_interleave."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
    nope, rope, v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    _mla_check(q, kv_latent, k_rope, kv_b_weight, num_heads, kv_lora_rank, nope, rope, v)
    b, s, _ = q.shape
    q_pass, q_rot, k_rot = mla_rope_parts(q, k_rope, cos, sin, num_heads, nope, rope, rope_interleave)
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
    nope, rope, v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    _mla_check(q, kv_latent, k_rope, kv_b_weight, num_heads, kv_lora_rank, nope, rope, v)
    b, s, _ = q.shape
    q_pass, q_rot, k_rot = mla_rope_parts(q, k_rope, cos, sin, num_heads, nope, rope, rope_interleave)
    vis = visible_mask(torch.arange(s, device=q.device), s, None)
    return _mla_core(q_pass, q_rot, kv_latent.view(b, 1, s, kv_lora_rank), k_rot, kv_b_weight, vis, num_heads, nope, v, scale)


# ---------------------------------------------------------------- fake kernels


@_fake("embedding")
def _embedding_fake(table, ids, scale=None):
    return table.new_empty((*ids.shape, table.shape[1]))


@_fake("gelu_mul")
def _gelu_mul_fake(gate, up, approximate="tanh"):
    return torch.empty_like(gate)


@_fake("softcap")
def _softcap_fake(x, cap):
    return torch.empty_like(x)


@_fake("rms_norm")
def _rms_norm_fake(x, weight, eps, head_dim=None, unit_offset=False):
    return torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))


@_fake("linear")
def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_fake("rope_cos_sin")
def _rope_cos_sin_fake(position_ids, inv_freq, attention_scaling, *, half=False):
    pos = _positions_2d(position_ids)
    shape = (*pos.shape, (1 if half else 2) * inv_freq.shape[0])
    return inv_freq.new_empty(shape, dtype=torch.float32), inv_freq.new_empty(shape, dtype=torch.float32)


@_fake("rope")
def _rope_fake(x, cos, sin, head_dim, rotary_dim=None, **kwargs):
    return torch.empty_like(x)


@_fake("narrow")
def _narrow_fake(x, start, length):
    return x.new_empty((*x.shape[:-1], length))


@_fake("attention_kv")
def _attention_kv_fake(q, k, v, k_cache, v_cache, cache_position, num_heads, num_kv_heads, scale, window=None, softcap=None, **kwargs):
    return torch.empty_like(q)


@_fake("attention")
def _attention_fake(q, k, v, num_heads, num_kv_heads, scale, window=None, softcap=None, **kwargs):
    return torch.empty_like(q)


@_fake("silu_mul")
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


@_fake("add")
def _add_fake(a, b):
    return torch.empty_like(a)


@_fake("layer_norm")
def _layer_norm_fake(x, weight, bias, eps):
    return torch.empty_like(x)


@_fake("gelu")
def _gelu_fake(x, variant="gelu_new"):
    return torch.empty_like(x)


@_fake("pos_embedding")
def _pos_embedding_fake(x, table, position_ids):
    return torch.empty_like(x)


@_fake("moe")
def _moe_fake(x, router_weight, gate_up_proj, down_proj, num_experts, top_k, score_func="softmax", norm_topk_prob=True, act="silu",
              score_bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, **kwargs):
    return torch.empty_like(x)


@_fake("mla_kv")
def _mla_kv_fake(q, kv_latent, k_rope, latent_cache, rope_cache, cache_position, cos, sin, kv_b_weight, num_heads, kv_lora_rank,
                 qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale, rope_interleave=True, q_lora_rank=None):
    return q.new_empty((*q.shape[:-1], num_heads * v_head_dim))


@_fake("mla")
def _mla_fake(q, kv_latent, k_rope, cos, sin, kv_b_weight, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale,
              rope_interleave=True, q_lora_rank=None):
    return q.new_empty((*q.shape[:-1], num_heads * v_head_dim))


from nhil.compiler import primitives_attention, primitives_moe, primitives_recurrent  # noqa: E402  (register the
# experts-on-given-routing, eager-attention halves and state-space / linear-attention primitives)

PRIMITIVES = PRIMITIVES + tuple(primitives_moe.SCHEMAS) + tuple(primitives_attention.SCHEMAS) + primitives_recurrent.PRIMITIVES
