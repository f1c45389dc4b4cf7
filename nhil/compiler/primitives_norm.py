"""Normalisation primitives: ``nhil::rms_norm`` (Llama-family RMSNorm, per-head QK-norm, Gemma's ``(1+w)`` form)
and ``nhil::layer_norm`` (GPT-2's LayerNorm), with the fp32 cast order of transformers 5.24 as exported.

The gated RMSNorm of state-space layers (``nhil::rms_norm_gated``) is in ``nhil.compiler.primitives_recurrent``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_lib import _fake, _impl, define

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, int? head_dim=None, bool unit_offset=False) -> Tensor",
    "layer_norm": "layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
}
PRIMITIVES = define(SCHEMAS)


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


@_impl("layer_norm")
def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: x [B,S,H] fp32, weight/bias [H] (or None) -> [B,S,H].

    ``F.layer_norm(x, (H,), weight, bias, eps)``: torch.nn.LayerNorm.forward, which the
    export records as one ``aten.layer_norm`` (GPT-2 ``ln_1`` / ``ln_2`` / ``ln_f``).
    Biased variance, eps inside the square root: ``(x - mean) / sqrt(var + eps) * w + b``.
    """
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---------------------------------------------------------------- fake kernels


@_fake("rms_norm")
def _rms_norm_fake(x, weight, eps, head_dim=None, unit_offset=False):
    return torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))


@_fake("layer_norm")
def _layer_norm_fake(x, weight, bias, eps):
    return torch.empty_like(x)
