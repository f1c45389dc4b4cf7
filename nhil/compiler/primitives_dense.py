"""Dense graph-IR primitives: embeddings, ``linear``, feature slices, residual add, activations and soft-capping.

Reference kernels use the torch ops of transformers 5.24 in the exported order (module docstring of
``nhil.compiler.primitives``): Llama's ``nn.Embedding`` / ``LlamaMLP`` / decoder residual, GPT-2's
``Conv1D`` ``linear``, ``NewGELUActivation`` and learned positions, Gemma's GeGLU, scaled embedding and
final-logit soft-cap, Phi-3's fused-projection slices. Layouts: ``nhil.compiler.primitives_lib``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_lib import _fake, _impl, _positions_2d, define

SCHEMAS = {
    "embedding": "embedding(Tensor table, Tensor ids, float? scale=None) -> Tensor",
    "gelu_mul": "gelu_mul(Tensor gate, Tensor up, str approximate='tanh') -> Tensor",
    "softcap": "softcap(Tensor x, float cap) -> Tensor",
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "narrow": "narrow(Tensor x, int start, int length) -> Tensor",
    "silu_mul": "silu_mul(Tensor gate, Tensor up) -> Tensor",
    "add": "add(Tensor a, Tensor b) -> Tensor",
    "gelu": "gelu(Tensor x, str variant='gelu_new') -> Tensor",
    "pos_embedding": "pos_embedding(Tensor x, Tensor table, Tensor position_ids) -> Tensor",
}
PRIMITIVES = define(SCHEMAS)


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


@_impl("narrow")
def narrow_ref(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Feature slice ``x[..., start:start+length]`` (a copy): splits fused projections
    (Phi-3 ``qkv_proj`` / ``gate_up_proj``; aten.slice / aten.chunk in the export)."""
    return x[..., start : start + length].clone()


@_impl("silu_mul")
def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU gating ``silu(gate) * up``; gate/up [B,S,I] -> [B,S,I] (LlamaMLP.forward)."""
    return F.silu(gate) * up


@_impl("add")
def add_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Residual add ``a + b`` (same shapes) (LlamaDecoderLayer.forward)."""
    return a + b


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


@_fake("linear")
def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_fake("narrow")
def _narrow_fake(x, start, length):
    return x.new_empty((*x.shape[:-1], length))


@_fake("silu_mul")
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


@_fake("add")
def _add_fake(a, b):
    return torch.empty_like(a)


@_fake("gelu")
def _gelu_fake(x, variant="gelu_new"):
    return torch.empty_like(x)


@_fake("pos_embedding")
def _pos_embedding_fake(x, table, position_ids):
    return torch.empty_like(x)
