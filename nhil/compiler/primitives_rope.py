"""Rotary position embedding primitives: ``nhil::rope_cos_sin`` (the tables) and ``nhil::rope`` (rotate-half,
partial rotary, GPT-OSS split-half), plus DeepSeek's interleaved-pair form used by MLA (:func:`rope_interleave`).

Sources: transformers 5.24 ``modeling_llama.LlamaRotaryEmbedding`` / ``apply_rotary_pos_emb``,
``modeling_phi3.apply_rotary_pos_emb``, ``modeling_gpt_oss._apply_rotary_emb``,
``modeling_deepseek_v3.apply_rotary_pos_emb_interleave``.
"""

from __future__ import annotations

import torch

from nhil.compiler.primitives_lib import _fake, _heads, _impl, _positions_2d, define

SCHEMAS = {
    "rope_cos_sin": "rope_cos_sin(Tensor position_ids, Tensor inv_freq, float attention_scaling, *, bool half=False) -> (Tensor, Tensor)",
    "rope": "rope(Tensor x, Tensor cos, Tensor sin, int head_dim, int? rotary_dim=None, *, str style='rotate_half') -> Tensor",
}
PRIMITIVES = define(SCHEMAS)


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


def rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE of DeepSeek (``rope_interleave=True``): x [B,H,S,d], cos/sin [B,S,d]
    (``cat(freqs, freqs)`` tables) -> [B,H,S,d], pairs (x0,x1),(x2,x3).. rotated, output laid out
    as ``cat(even', odd')``. Same ops as modeling_deepseek_v3.apply_rotary_pos_emb_interleave."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---------------------------------------------------------------- fake kernels


@_fake("rope_cos_sin")
def _rope_cos_sin_fake(position_ids, inv_freq, attention_scaling, *, half=False):
    pos = _positions_2d(position_ids)
    shape = (*pos.shape, (1 if half else 2) * inv_freq.shape[0])
    return inv_freq.new_empty(shape, dtype=torch.float32), inv_freq.new_empty(shape, dtype=torch.float32)


@_fake("rope")
def _rope_fake(x, cos, sin, head_dim, rotary_dim=None, **kwargs):
    return torch.empty_like(x)
