"""MoE primitives: ``nhil::moe`` (a whole sparse MoE block with a named routing rule) and ``nhil::moe_experts``
(the experts of a MoE layer whose routing is not a named rule).

A MoE block is PIM-bound in two places: the router GEMV and the routed experts' GEMVs.
``nhil::moe`` carries the routing rule (:func:`moe_routing`: Mixtral / Qwen3-MoE softmax, DeepSeek-V3
sigmoid, GPT-OSS top-k-then-softmax), the experts (SwiGLU, GPT-OSS clamped SwiGLU) and an optional
shared expert (Qwen2-MoE). When a family's routing is one nhil has no rule for (a new score function,
an op order the router patterns do not know), the routing runs as host ATen (the exported ops: the
router linear is still a PIM GEMV) and hands the expert ids and weights to ``nhil::moe_experts``,
which runs the experts exactly as ``nhil::moe`` does: per slot the SwiGLU FFN of the chosen expert,
scaled by its weight, summed over the slots in order.

Source: transformers 5.24 with ``experts_implementation="batched_mm"``:
``integrations/moe.batched_mm_experts_forward`` with the default gate (``_default_apply_gate``):
``repeat_interleave`` of the tokens over the k slots, ``bmm(gate_up_proj[ids], x)`` -> chunk ->
``silu(gate) * up`` -> ``bmm(down_proj[ids], ·)`` -> ``* weight`` -> ``view(T, k, H).sum(1)``;
the routers of ``modeling_mixtral`` / ``modeling_qwen3_moe`` / ``modeling_deepseek_v3`` /
``modeling_gpt_oss``, ``modeling_qwen2_moe.Qwen2MoeSparseMoeBlock`` (shared expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_lib import _fake, _impl, define

SCHEMAS = {
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
    "moe_experts": "moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up_proj, Tensor down_proj, int num_experts, int top_k) -> Tensor",
}
PRIMITIVES = define(SCHEMAS)


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


def _check(x, ids, weights, gate_up_proj, down_proj, num_experts: int, top_k: int) -> None:
    t, h = x.shape
    e, i2, h2 = gate_up_proj.shape
    if (h2 != h or e != num_experts or i2 % 2 or tuple(down_proj.shape) != (e, h, i2 // 2) or tuple(ids.shape) != (t, top_k)
            or tuple(weights.shape) != (t, top_k) or ids.dtype != torch.int64):
        raise ValueError(f"moe_experts shapes do not fit: x {tuple(x.shape)}, ids {tuple(ids.shape)} {ids.dtype}, weights {tuple(weights.shape)}, "
                         f"gate_up {tuple(gate_up_proj.shape)}, down {tuple(down_proj.shape)}, E={num_experts}, k={top_k}")


@_impl("moe_experts")
def moe_experts_ref(x, ids, weights, gate_up_proj, down_proj, num_experts: int, top_k: int):
    """Routed SwiGLU experts: x [T,H] fp32, ids [T,k] int64, weights [T,k] fp32, gate_up_proj
    [E,2I,H] (gate rows, then up rows), down_proj [E,H,I] -> [T,H] (module docstring).

    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    _check(x, ids, weights, gate_up_proj, down_proj, num_experts, top_k)
    t, h = x.shape
    y = moe_expert_ffn(x.repeat_interleave(top_k, dim=0), gate_up_proj, down_proj, ids.reshape(-1))
    y = y * weights.reshape(-1).unsqueeze(-1)
    return y.view(t, top_k, h).sum(dim=1)


# ---------------------------------------------------------------- fake kernels


@_fake("moe")
def _moe_fake(x, router_weight, gate_up_proj, down_proj, num_experts, top_k, score_func="softmax", norm_topk_prob=True, act="silu",
              score_bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, **kwargs):
    return torch.empty_like(x)


@_fake("moe_experts")
def _moe_experts_fake(x, ids, weights, gate_up_proj, down_proj, num_experts, top_k):
    return torch.empty_like(x)
