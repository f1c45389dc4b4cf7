"""Host kernels: the parts of a step that run on the host CPU, not in PIM.

Each kernel takes fp32 numpy views of host buffers/images and writes its outputs. Where
a graph-IR primitive exists, the kernel calls its reference kernel (``torch.ops.nhil``)
so host numerics are exactly the graph IR's. ``masked_softmax`` is the host half of
decode attention: ``softmax(scale * scores)`` over cache positions ``<= pos`` in fp32
(``torch.softmax``), positions beyond ``pos`` get probability exactly 0 — the same
computation SDPA does with a boolean causal mask.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nhil.errors import RunError

KERNELS: dict[str, Callable] = {}


def kernel(name: str):
    """Register a host kernel ``fn(inputs: list, outputs: list[np.ndarray], ctx: dict, **attrs)``."""

    def deco(fn):
        KERNELS[name] = fn
        return fn

    return deco


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32))


def _ops():
    import nhil.compiler.primitives  # noqa: F401  (registers torch.ops.nhil)

    return torch.ops.nhil


@kernel("embedding")
def embedding(inputs, outputs, ctx, scale=None):
    table, token = inputs
    if not 0 <= token < table.shape[0]:
        raise RunError(f"token id {token} outside the vocabulary of {table.shape[0]}")
    outputs[0][:] = _ops().embedding(_t(table), torch.tensor([[token]]), scale).reshape(-1).numpy()


@kernel("rms_norm")
def rms_norm(inputs, outputs, ctx, eps, head_dim=None, unit_offset=False):
    x, w = inputs
    outputs[0][:] = _ops().rms_norm(_t(x).reshape(1, 1, -1), _t(w), eps, head_dim, unit_offset).reshape(-1).numpy()


@kernel("rope_cos_sin")
def rope_cos_sin(inputs, outputs, ctx, attention_scaling, half=False):
    pos, inv_freq = inputs
    cos, sin = _ops().rope_cos_sin(torch.tensor([[pos]]), _t(inv_freq), attention_scaling, half=half)
    outputs[0][:] = cos.reshape(-1).numpy()
    outputs[1][:] = sin.reshape(-1).numpy()


@kernel("rope")
def rope(inputs, outputs, ctx, head_dim, rotary_dim=None, style="rotate_half"):
    x, cos, sin = inputs
    y = _ops().rope(_t(x).reshape(1, 1, -1), _t(cos).reshape(1, 1, -1), _t(sin).reshape(1, 1, -1), head_dim, rotary_dim, style=style)
    outputs[0][:] = y.reshape(-1).numpy()


@kernel("silu_mul")
def silu_mul(inputs, outputs, ctx):
    g, u = inputs
    outputs[0][:] = _ops().silu_mul(_t(g), _t(u)).numpy()


@kernel("add")
def add(inputs, outputs, ctx):
    a, b = inputs
    outputs[0][:] = _ops().add(_t(a), _t(b)).numpy()


@kernel("masked_softmax")
def masked_softmax(inputs, outputs, ctx, num_heads, max_len, scale, window=None, softcap=None, sinks=False):
    """Host half of decode attention: ``softmax(cap(scale * scores))`` over the visible keys.

    Visible: ``j <= pos`` and, with a sliding ``window`` W, ``j > pos - W``
    (``nhil::attention_kv``'s mask, ``primitives.visible_mask``); ``softcap`` c applies
    ``c * tanh(s / c)`` to the scaled logits first (Gemma 2). Masked keys get exactly 0.
    ``sinks`` (GPT-OSS): ``inputs[2]`` holds one sink logit per head, appended as an extra
    column; ``softmax(s - max)`` over keys + sink, sink column dropped
    (``primitives._attend_sinks``), so the probabilities of a row sum to less than 1.
    """
    from nhil.compiler.primitives import visible_mask

    scores, pos = inputs[:2]
    s = _t(scores).reshape(num_heads, max_len) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    visible = visible_mask(torch.tensor([pos]), max_len, window)[0]
    s = s.masked_fill(~visible, float("-inf"))
    if sinks:
        comb = torch.cat([s, _t(inputs[2]).reshape(num_heads, 1)], dim=-1)
        comb = comb - comb.max(dim=-1, keepdim=True).values
        outputs[0][:] = torch.softmax(comb, dim=-1)[:, :-1].reshape(-1).numpy()
        return
    outputs[0][:] = torch.softmax(s, dim=-1).reshape(-1).numpy()


@kernel("narrow")
def narrow(inputs, outputs, ctx, start, length):
    (x,) = inputs
    outputs[0][:] = _ops().narrow(_t(x), start, length).numpy()


@kernel("gelu_mul")
def gelu_mul(inputs, outputs, ctx, approximate="tanh"):
    g, u = inputs
    outputs[0][:] = _ops().gelu_mul(_t(g), _t(u), approximate).numpy()


@kernel("softcap")
def softcap(inputs, outputs, ctx, cap):
    (x,) = inputs
    outputs[0][:] = _ops().softcap(_t(x), cap).numpy()


@kernel("moe_route")
def moe_route(inputs, outputs, ctx, top_k, norm_topk_prob=True, score_func="softmax", softmax_after_topk=False, n_group=1, topk_group=1, routed_scaling_factor=1.0):
    """MoE routing on the host: router logits [E] (and, for the DeepSeek sigmoid rule, the
    ``e_score_correction_bias`` [E] as a second input) -> ``route`` = [expert ids (fp32) ...,
    weights ...] (``2*top_k``, slot order), by ``primitives.moe_routing`` (the reference
    kernel's routing; ``softmax_after_topk``: GPT-OSS top-k then softmax, logits incl. the router bias)."""
    from nhil.compiler.primitives import moe_routing

    logits = inputs[0]
    bias = _t(inputs[1]) if len(inputs) > 1 else None
    w, ids = moe_routing(_t(logits).reshape(1, -1), top_k, score_func, norm_topk_prob, bias, n_group, topk_group, routed_scaling_factor,
                         softmax_after_topk=softmax_after_topk)
    outputs[0][:top_k] = ids.reshape(-1).numpy().astype(np.float32)
    outputs[0][top_k:] = w.reshape(-1).numpy()


@kernel("moe_expert")
def moe_expert(inputs, outputs, ctx, layer, expert):
    """Marker opening expert ``expert``'s sub-program; the Runner never calls it in the
    linear stream (it skips sub-programs and runs them from ``moe_dispatch``)."""
    raise RunError(f"moe_expert marker (layer {layer}, expert {expert}) reached in the linear stream: this runtime does not implement MoE dispatch")


@kernel("moe_dispatch")
def moe_dispatch(inputs, outputs, ctx, layer, experts, top_k, num_experts):
    """Combine of a MoE layer after the Runner ran the routed experts' sub-programs:
    ``out = (stack(y[id_j]) * w[:, None]).view(1, k, H).sum(1)`` over the k slots, as
    ``primitives.moe_ref``. inputs = [route, y_0 .. y_{E-1}] (unrouted y_e are stale, unread)."""
    route = inputs[0]
    ids = [int(i) for i in route[:top_k]]
    w = _t(route[top_k : 2 * top_k])
    ys = torch.stack([_t(inputs[1 + e]) for e in ids])
    y = ys * w.unsqueeze(-1)
    outputs[0][:] = y.view(1, top_k, -1).sum(dim=1).reshape(-1).numpy()


@kernel("layer_norm")
def layer_norm(inputs, outputs, ctx, eps, has_weight=True, has_bias=True):
    """LayerNorm of one token: inputs = [x, weight (if has_weight), bias (if has_bias)] -> ``nhil::layer_norm``."""
    it = iter(inputs[1:])
    w = _t(next(it)) if has_weight else None
    b = _t(next(it)) if has_bias else None
    outputs[0][:] = _ops().layer_norm(_t(inputs[0]).reshape(1, 1, -1), w, b, eps).reshape(-1).numpy()


@kernel("gelu")
def gelu(inputs, outputs, ctx, variant="gelu_new"):
    (x,) = inputs
    outputs[0][:] = _ops().gelu(_t(x), variant).numpy()


@kernel("pos_embedding")
def pos_embedding(inputs, outputs, ctx):
    """Learned absolute position of the step: ``x + table[pos]`` (``nhil::pos_embedding``)."""
    x, table, pos = inputs
    if not 0 <= pos < table.shape[0]:
        raise RunError(f"position {pos} is beyond the {table.shape[0]} learned position embeddings (n_positions) of the model")
    outputs[0][:] = _ops().pos_embedding(_t(x).reshape(1, 1, -1), _t(table), torch.tensor([[pos]])).reshape(-1).numpy()


@kernel("moe_shared_add")
def moe_shared_add(inputs, outputs, ctx, gated=True):
    """Shared expert of a MoE layer added to the routed combine: inputs = [routed [H],
    shared [H], (gate logit [1])]; ``out = routed + sigmoid(gate) * shared`` (without
    ``gated``: ``routed + shared``), the same torch ops as ``primitives.moe_ref``."""
    routed, shared = _t(inputs[0]), _t(inputs[1])
    if gated:
        shared = torch.sigmoid(_t(inputs[2])) * shared
    outputs[0][:] = (routed + shared).numpy()


@kernel("moe_swiglu_clamp")
def moe_swiglu_clamp(inputs, outputs, ctx, alpha, limit):
    """GPT-OSS expert activation on the host: inputs = [gate GEMV [I], up GEMV [I], gate bias [I],
    up bias [I]]; ``swiglu_clamp(gate + gate_bias, up + up_bias)`` (``primitives.swiglu_clamp``,
    the bias being the even / odd entries of ``gate_up_proj_bias[e]``)."""
    from nhil.compiler.primitives import swiglu_clamp

    g, u, gb, ub = (_t(a) for a in inputs)
    outputs[0][:] = swiglu_clamp(g + gb, u + ub, alpha, limit).numpy()


@kernel("mla_rope")
def mla_rope(inputs, outputs, ctx, num_heads, qk_nope_head_dim, qk_rope_head_dim, rope_interleave=True):
    """Host half of MLA (``lower_mla`` step 1): q [H*(nope+rope)], k_rope [rope], cos/sin [rope]
    -> (q_rot of every head, RoPE'd [H*rope]; shared k_rot RoPE'd [rope]), by
    ``primitives.mla_rope_parts`` (the ``nhil::mla_kv`` reference's own code)."""
    from nhil.compiler.primitives import mla_rope_parts

    q, k_rope, cos, sin = inputs
    row = lambda a: _t(a).reshape(1, 1, -1)  # noqa: E731
    _, q_rot, k_rot = mla_rope_parts(row(q), row(k_rope), row(cos), row(sin), num_heads, qk_nope_head_dim, qk_rope_head_dim, rope_interleave)
    outputs[0][:] = q_rot.reshape(-1).numpy()
    outputs[1][:] = k_rot.reshape(-1).numpy()


@kernel("mla_pack")
def mla_pack(inputs, outputs, ctx, num_heads, kv_lora_rank, qk_rope_head_dim, width):
    """MLA query / key rows (``lower_mla`` step 3): ``qcat_h = [q_abs_h ‖ q_rot_h ‖ 0]`` per head
    and ``kcat = [latent ‖ k_rot ‖ 0]``, each ``width`` wide (r + rope rounded up to the burst)."""
    qabs, qrot, latent, krot = inputs
    r, rope = kv_lora_rank, qk_rope_head_dim
    q = np.zeros((num_heads, width), np.float32)
    q[:, :r] = np.asarray(qabs).reshape(num_heads, r)
    q[:, r : r + rope] = np.asarray(qrot).reshape(num_heads, rope)
    outputs[0][:] = q.reshape(-1)
    outputs[1][:] = 0.0
    outputs[1][:r] = latent
    outputs[1][r : r + rope] = krot
