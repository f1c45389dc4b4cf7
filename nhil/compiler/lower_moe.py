"""Lowering of ``nhil::moe`` with data-dependent expert execution.

Per MoE layer (one token per step, ``x`` the [H] host buffer of the block input):

1. **Router** GEMV ``logits = router_weight @ x`` on PIM (``[E, H]`` matrix).
2. ``HOST moe_route``: softmax -> top-k -> renormalise (or DeepSeek-V3's sigmoid +
   bias-corrected grouped top-k, the bias a host image) on the host with
   :func:`nhil.compiler.primitives.moe_routing` (the reference kernel's own routing), writing
   ``route`` = ``[ids (as fp32) ..., weights ...]`` (``2*top_k`` values, slot order).
3. One **expert sub-program** per expert ``e``, each opened by a marker ``HOST moe_expert``
   (``attrs: layer, expert``): gate and up GEMVs of ``x`` (the two halves of
   ``gate_up_proj[e]``, placed as two matrices), ``HOST silu_mul``, down GEMV into
   ``y_e``, SYNC. Every expert's matrices are placed in the banks at compile time.
4. ``HOST moe_dispatch`` (``attrs: layer, experts`` = host-op indices of the E markers,
   ``top_k``, ``num_experts``): the runtime (``nhil.runtime.executor.Runner``) skips the
   expert sub-programs in the linear instruction stream and, at this op, runs the
   sub-programs of the experts named in ``route`` (slot order), then the host kernel
   combines ``sum_k w_k * y_{id_k}`` exactly as the reference kernel
   (``y * w[:, None]`` -> ``view(1, k, H).sum(1)``). Only the routed experts' GEMVs are
   issued. See ``docs/isa.md`` ("Runtime: data-dependent MoE dispatch").

**GPT-OSS** (``experts_layout='transposed_interleaved'``, ``act='swiglu_clamp'``): the
router bias is added on the host after the router GEMV, ``moe_route`` does top-k then
softmax; each expert's gate / up matrices are the even / odd columns of
``gate_up_proj[e]`` ([H, 2I]) transposed, its down matrix ``down_proj[e]ᵀ``; in the
sub-program ``HOST moe_swiglu_clamp`` adds the gate / up biases and applies the clamped
SwiGLU, and a ``HOST add`` adds the down bias after the down GEMV.

A **shared expert** (Qwen2-MoE) runs in the linear stream before the router, for every
token: gate / up GEMVs, ``HOST silu_mul``, down GEMV, and the [1,H] GEMV of its sigmoid
gate; the dispatch then writes the routed combine to ``{out}.moe.routed`` and
``HOST moe_shared_add`` forms ``out = routed + sigmoid(gate) * shared`` (the reference
kernel's ops, :func:`nhil.compiler.primitives.moe_ref`).

The builder's global-buffer tracking is reset at every sub-program boundary (what the GB
holds there depends on which experts ran). With a quantization plan the expert (and shared
expert) matrices are stored in the plan's formats, the router and the shared expert's
sigmoid gate stay bf16 (as llama.cpp keeps ``ffn_gate_inp`` unquantized: routing decisions
are the MoE's most format-sensitive step); every sub-program starts and ends with
W_FMT = bf16, so the CFR state is the same whichever experts ran.
"""

from __future__ import annotations

import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.compiler.lower_attention import lower_bias
from nhil.compiler.lowering import LowerCtx, lowering, numel, where
from nhil.errors import CompileError


SHARED_KEYS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate")
GPT_OSS_KEYS = ("router_bias", "gate_up_bias", "down_bias")


def lower_moe(b: ProgramBuilder, x_buf: str, out: str, weights: dict, attrs: dict, layer: int, quant=None, route: str | None = None) -> dict:
    """Emit one MoE layer (see the module docstring).

    Args:
        b: the program builder.
        x_buf: host buffer of the block input [H].
        out: host buffer for the block output [H] (declared here).
        weights: ``{"router": (name, [E,H]), "gate_up": (name, [E,2I,H]), "down": (name, [E,H,I])}``,
            optionally a shared expert ``"shared_gate_proj"`` / ``"shared_up_proj"`` ([I_s,H]),
            ``"shared_down_proj"`` ([H,I_s]) and its sigmoid gate ``"shared_expert_gate"`` ([1,H]).
            GPT-OSS: ``"router_bias"`` [E], ``"gate_up_bias"`` [E,2I], ``"down_bias"`` [E,H] with
            ``gate_up`` [E,H,2I] (interleaved gate/up columns) and ``down`` [E,I,H].
            DeepSeek-V3: ``"score_bias": (name, [E])`` for the sigmoid rule.
        attrs: ``num_experts``, ``top_k``, ``score_func``, ``norm_topk_prob``; optionally
            ``act`` (``silu`` / ``swiglu_clamp`` with ``swiglu_alpha``, ``swiglu_limit``),
            ``softmax_after_topk``, ``experts_layout`` (``concat`` / ``transposed_interleaved``);
            with ``score_bias``: ``n_group``, ``topk_group``, ``routed_scaling_factor``.
        layer: MoE layer ordinal (names buffers, recorded in host-op attrs).
        quant: optional :class:`nhil.compiler.quantize.QuantPlan` for the expert matrices.
        route: host buffer ``[ids (as fp32) ..., weights ...]`` (``2*top_k``) when the routing was
            computed elsewhere (``nhil::moe_experts``: host ATen routing); then there is no
            ``"router"`` weight and no ``moe_route``.
    Returns:
        metadata for ``program.info["moe"]``.
    Raises:
        CompileError: inconsistent shapes, an unknown weight key, or weight format state.
    """
    unknown = set(weights) - {"router", "gate_up", "down", "score_bias", *SHARED_KEYS, *GPT_OSS_KEYS}
    unknown_attrs = set(attrs) - {"num_experts", "top_k", "score_func", "norm_topk_prob", "act", "softmax_after_topk", "experts_layout", "swiglu_alpha", "swiglu_limit",
                                  "n_group", "topk_group", "routed_scaling_factor"}
    if unknown or unknown_attrs:
        raise CompileError(f"moe layer {layer}: no lowering for moe attributes {sorted(unknown | unknown_attrs)}")
    (gn, gu), (dn, dw) = weights["gate_up"], weights["down"]
    e_count, k = int(attrs["num_experts"]), int(attrs["top_k"])
    h = int(weights["router"][1].shape[1]) if route is None else int(gu.shape[2])
    gpt_oss = attrs.get("experts_layout", "concat") == "transposed_interleaved"
    if gpt_oss != (attrs.get("act", "silu") == "swiglu_clamp") or gpt_oss != ("gate_up_bias" in weights) or gpt_oss != ("down_bias" in weights):
        raise CompileError(f"moe layer {layer}: the transposed_interleaved layout goes with act='swiglu_clamp' and expert biases, and only with them")
    if gpt_oss:  # [E, H, 2I] interleaved -> per-expert gate / up [I, H]; down [E, I, H] -> [H, I]
        i2 = int(gu.shape[2])
        ok = tuple(gu.shape) == (e_count, h, i2) and tuple(dw.shape) == (e_count, i2 // 2, h) and tuple(weights["gate_up_bias"][1].shape) == (e_count, i2) \
            and tuple(weights["down_bias"][1].shape) == (e_count, h)
    else:
        i2 = int(gu.shape[1])
        ok = tuple(gu.shape) == (e_count, i2, h) and tuple(dw.shape) == (e_count, h, i2 // 2)
    if not ok or i2 % 2:
        raise CompileError(f"moe layer {layer}: inconsistent expert weights gate_up {tuple(gu.shape)}, down {tuple(dw.shape)}")
    pre = f"{out}.moe"
    place = lambda name, w: b.place_matrix(name, w, qt=quant.weight(name, w) if quant is not None else None)  # noqa: E731
    shared = _lower_shared_expert(b, x_buf, pre, weights, h, layer, place) if "shared_gate_proj" in weights else None
    if route is None:
        route, router_macs, route_attrs = _lower_router(b, x_buf, pre, weights, attrs, e_count, k)
    else:
        router_macs, route_attrs = 0, {}
    markers, ys, macs = _lower_experts(b, x_buf, pre, weights, attrs, e_count, k, h, layer, place, gpt_oss)
    routed = out if shared is None else b.buffer(f"{pre}.routed", h)
    b.buffer(out, h)
    b.host("moe_dispatch", [route, *ys], [routed], layer=layer, experts=markers, top_k=k, num_experts=e_count)
    info = {"layer": layer, "num_experts": e_count, "top_k": k, "score_func": str(attrs.get("score_func", "host ATen")),
            "norm_topk_prob": bool(attrs.get("norm_topk_prob", False)), "expert_markers": markers, "dispatch": len(b.host_ops) - 1,
            "mac_ab_per_expert": macs, "router_mac_ab": router_macs, **route_attrs}
    if shared is not None:
        ins = [routed, shared["y"]] + ([shared["gate"]] if shared["gate"] else [])
        b.host("moe_shared_add", ins, [out], gated=shared["gate"] is not None)
        info["shared_mac_ab"] = shared["mac_ab"]
        info["shared_gated"] = shared["gate"] is not None
    return info


def _lower_router(b: ProgramBuilder, x_buf: str, pre: str, weights: dict, attrs: dict, e_count: int, k: int) -> tuple[str, int, dict]:
    """Router GEMV (+ GPT-OSS bias) and ``HOST moe_route``; returns (route buffer, router MAC_AB count, routing attrs)."""
    rn, rw = weights["router"]
    pr = b.place_matrix(rn, rw)
    b.buffer(f"{pre}.logits", e_count)
    if "router_bias" in weights:  # GPT-OSS router bias, added on the host after RD_ACC (as a biased linear)
        b.gemv(pr, x_buf, f"{pre}.logits.acc")
        lower_bias(b, f"{pre}.logits.acc", weights["router_bias"][0], weights["router_bias"][1], f"{pre}.logits", e_count)
    else:
        b.gemv(pr, x_buf, f"{pre}.logits")
    b.buffer(f"{pre}.route", 2 * k)
    route_in, route_attrs = [f"{pre}.logits"], ({"softmax_after_topk": True} if attrs.get("softmax_after_topk") else {})
    if "score_bias" in weights:  # DeepSeek-V3 sigmoid rule: bias-corrected grouped top-k, routed scaling factor
        route_in.append(b.host_image(*weights["score_bias"]))
        route_attrs = {a: attrs[a] for a in ("n_group", "topk_group", "routed_scaling_factor")}
    b.host("moe_route", route_in, [f"{pre}.route"], top_k=k, norm_topk_prob=bool(attrs["norm_topk_prob"]), score_func=str(attrs["score_func"]), **route_attrs)
    return f"{pre}.route", sum(len(r) for r in pr.rows), route_attrs


def _lower_experts(b: ProgramBuilder, x_buf: str, pre: str, weights: dict, attrs: dict, e_count: int, k: int, h: int, layer: int, place, gpt_oss: bool):
    """One sub-program per expert (module docstring, step 3); returns (marker host-op indices, y buffers, MAC_AB per expert)."""
    (gn, gu), (dn, dw) = weights["gate_up"], weights["down"]
    inter = (int(gu.shape[2]) if gpt_oss else int(gu.shape[1])) // 2
    markers, ys, macs = [], [], []
    for e in range(e_count):
        if b._wfmt != 0:
            raise CompileError(f"moe layer {layer}: expert sub-programs must start with W_FMT = bf16")
        b.invalidate_gb()
        if gpt_oss:
            pg = place(f"{gn}.{e}.gate", gu[e, :, 0::2].t())
            pu = place(f"{gn}.{e}.up", gu[e, :, 1::2].t())
            pd = place(f"{dn}.{e}", dw[e].t())
            bname, gub = weights["gate_up_bias"]
            gb, ub = b.host_image(f"{bname}.{e}.gate", gub[e, 0::2]), b.host_image(f"{bname}.{e}.up", gub[e, 1::2])
            db = b.host_image(f"{weights['down_bias'][0]}.{e}", weights["down_bias"][1][e])
        else:
            pg = place(f"{gn}.{e}.gate", gu[e, :inter])
            pu = place(f"{gn}.{e}.up", gu[e, inter:])
            pd = place(f"{dn}.{e}", dw[e])
        b.host("moe_expert", [], [], layer=layer, expert=e)
        markers.append(len(b.host_ops) - 1)
        start = len(b.instrs)
        g, u, a, y = (b.buffer(f"{pre}.e{e}.{s}", n) for s, n in (("gate", inter), ("up", inter), ("act", inter), ("y", h)))
        b.gemv(pg, x_buf, g)
        b.gemv(pu, x_buf, u)
        if gpt_oss:  # biases + clamped SwiGLU on the host, down GEMV, down bias on the host
            b.host("moe_swiglu_clamp", [g, u, gb, ub], [a], alpha=float(attrs["swiglu_alpha"]), limit=float(attrs["swiglu_limit"]))
            b.gemv(pd, a, b.buffer(f"{y}.acc", h))
            b.host("add", [f"{y}.acc", db], [y])
        else:
            b.host("silu_mul", [g, u], [a])
            b.gemv(pd, a, y)
        if b._wfmt != 0:
            b.set_wfmt(0)  # the sub-program ends as it started, with W_FMT = bf16
        b.sync()
        macs.append(sum(1 for ins in b.instrs[start:] if ins.op.name == "MAC_AB"))
        ys.append(y)
    b.invalidate_gb()
    return markers, ys, macs


def _lower_shared_expert(b: ProgramBuilder, x_buf: str, pre: str, weights: dict, h: int, layer: int, place) -> dict:
    """The shared expert, in the linear stream (it runs for every token): gate and up GEMVs
    of ``x``, ``HOST silu_mul``, down GEMV into ``{pre}.shared.y``, and with a sigmoid gate
    its [1,H] GEMV into ``{pre}.shared.gate`` (the sigmoid itself is applied by
    ``HOST moe_shared_add`` after the routed combine). Returns buffer names and MAC count."""
    (gn, gw), (un, uw), (dn, dw) = weights["shared_gate_proj"], weights["shared_up_proj"], weights["shared_down_proj"]
    inter = int(gw.shape[0])
    if tuple(gw.shape) != (inter, h) or tuple(uw.shape) != (inter, h) or tuple(dw.shape) != (h, inter):
        raise CompileError(f"moe layer {layer}: inconsistent shared expert weights gate {tuple(gw.shape)}, up {tuple(uw.shape)}, down {tuple(dw.shape)}")
    start = len(b.instrs)
    g, u, a, y = (b.buffer(f"{pre}.shared.{s}", n) for s, n in (("g", inter), ("u", inter), ("act", inter), ("y", h)))
    b.gemv(place(gn, gw), x_buf, g)
    b.gemv(place(un, uw), x_buf, u)
    b.host("silu_mul", [g, u], [a])
    b.gemv(place(dn, dw), a, y)
    gate = None
    if "shared_expert_gate" in weights:
        sn, sw = weights["shared_expert_gate"]
        if tuple(sw.shape) != (1, h):
            raise CompileError(f"moe layer {layer}: shared expert gate {tuple(sw.shape)} is not [1, H={h}]")
        gate = b.buffer(f"{pre}.shared.gate", 1)
        b.gemv(b.place_matrix(sn, sw), x_buf, gate)
    return {"y": y, "gate": gate, "mac_ab": sum(1 for ins in b.instrs[start:] if ins.op.name == "MAC_AB")}


_MOE_POSITIONAL = ("score_func", "norm_topk_prob", "act", "score_bias", "n_group", "topk_group", "routed_scaling_factor")


@lowering("nhil::moe")
def _moe(cx: LowerCtx, node) -> None:
    """Router GEMV on PIM, routing on the host, only routed experts issued (:func:`lower_moe`).

    Raises:
        CompileError: an expert activation other than ``silu`` / ``swiglu_clamp``, or an output
            shape that differs from the input's.
    """
    x, rw, gu, dw, n_exp, top_k = node.args[:6]
    attrs = dict(zip(_MOE_POSITIONAL, node.args[6:]))
    if attrs.get("act", "silu") not in ("silu", "swiglu_clamp") or numel(node) != numel(x):
        raise CompileError(f"no lowering for this nhil::moe (act {attrs.get('act')}) at {where(node)}")
    w = {"router": (cx.const_name(rw), cx.const(rw)), "gate_up": (cx.const_name(gu), cx.const(gu)), "down": (cx.const_name(dw), cx.const(dw))}
    sb = attrs.pop("score_bias", None)
    if sb is not None:  # DeepSeek-V3 routing attributes (primitives.moe_routing)
        w["score_bias"] = (cx.const_name(sb), cx.const(sb))
        attrs.update(n_group=int(attrs.get("n_group", 1)), topk_group=int(attrs.get("topk_group", 1)),
                     routed_scaling_factor=float(attrs.get("routed_scaling_factor", 1.0)))
    else:
        for a in ("n_group", "topk_group", "routed_scaling_factor"):
            attrs.pop(a, None)
    for key, t in node.kwargs.items():  # keyword-only attributes: optional weights (None when absent) and variant attrs
        if isinstance(t, torch.fx.Node):
            w[key] = (cx.const_name(t), cx.const(t))
        elif t is not None:
            attrs[key] = t
    attrs = dict(attrs, num_experts=n_exp, top_k=top_k, score_func=attrs.get("score_func", "softmax"), norm_topk_prob=attrs.get("norm_topk_prob", True))
    cx.moe_info.append(lower_moe(cx.b, cx.arg(x), node.name, w, attrs, layer=len(cx.moe_info), quant=cx.quant))


@lowering("nhil::moe_experts")
def _moe_experts(cx: LowerCtx, node) -> None:
    """Experts on explicit routing (``nhil.compiler.primitives_moe``): ``HOST moe_pack`` forms the
    route buffer from the host-ATen ids and weights, then the expert sub-programs and the
    dispatch of :func:`lower_moe`.

    Raises:
        CompileError: more than one token (the decode step routes one).
    """
    x, ids, wts, gu, dw, n_exp, top_k = node.args
    if numel(node) != int(x.meta["val"].shape[-1]):
        raise CompileError(f"nhil::moe_experts at {where(node)} routes one token per decode step, got {tuple(x.meta['val'].shape)}")
    pre = f"{node.name}.moe"
    route = cx.b.buffer(f"{pre}.route", 2 * int(top_k))
    cx.b.host("moe_pack", [cx.arg(ids), cx.arg(wts)], [route], top_k=int(top_k))
    w = {"gate_up": (cx.const_name(gu), cx.const(gu)), "down": (cx.const_name(dw), cx.const(dw))}
    cx.moe_info.append(lower_moe(cx.b, cx.arg(x), node.name, w, {"num_experts": n_exp, "top_k": top_k}, layer=len(cx.moe_info), quant=cx.quant, route=route))
