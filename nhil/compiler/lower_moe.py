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

The builder's global-buffer tracking is reset at every sub-program boundary (what the GB
holds there depends on which experts ran), and sub-programs are bf16-only (W_FMT 0).
"""

from __future__ import annotations

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import CompileError


def lower_moe(b: ProgramBuilder, x_buf: str, out: str, weights: dict, attrs: dict, layer: int) -> dict:
    """Emit one MoE layer (see the module docstring).

    Args:
        b: the program builder.
        x_buf: host buffer of the block input [H].
        out: host buffer for the block output [H] (declared here).
        weights: ``{"router": (name, [E,H]), "gate_up": (name, [E,2I,H]), "down": (name, [E,H,I])}``,
            plus ``"score_bias": (name, [E])`` for the DeepSeek-V3 sigmoid rule.
        attrs: ``num_experts``, ``top_k``, ``score_func``, ``norm_topk_prob`` (and with
            ``score_bias``: ``n_group``, ``topk_group``, ``routed_scaling_factor``).
        layer: MoE layer ordinal (names buffers, recorded in host-op attrs).
    Returns:
        metadata for ``program.info["moe"]``.
    Raises:
        CompileError: inconsistent shapes or weight format state.
    """
    (rn, rw), (gn, gu), (dn, dw) = weights["router"], weights["gate_up"], weights["down"]
    e_count, k = int(attrs["num_experts"]), int(attrs["top_k"])
    h = int(rw.shape[1])
    i2 = int(gu.shape[1])
    if tuple(gu.shape) != (e_count, i2, h) or tuple(dw.shape) != (e_count, h, i2 // 2) or i2 % 2:
        raise CompileError(f"moe layer {layer}: inconsistent expert weights gate_up {tuple(gu.shape)}, down {tuple(dw.shape)}")
    inter = i2 // 2
    pre = f"{out}.moe"
    pr = b.place_matrix(rn, rw)
    b.buffer(f"{pre}.logits", e_count)
    b.gemv(pr, x_buf, f"{pre}.logits")
    b.buffer(f"{pre}.route", 2 * k)
    route_in, route_attrs = [f"{pre}.logits"], {}
    if "score_bias" in weights:  # DeepSeek-V3 sigmoid rule: bias-corrected grouped top-k, routed scaling factor
        route_in.append(b.host_image(*weights["score_bias"]))
        route_attrs = {a: attrs[a] for a in ("n_group", "topk_group", "routed_scaling_factor")}
    b.host("moe_route", route_in, [f"{pre}.route"], top_k=k, norm_topk_prob=bool(attrs["norm_topk_prob"]), score_func=str(attrs["score_func"]), **route_attrs)
    markers, ys, macs = [], [], []
    for e in range(e_count):
        if b._wfmt != 0:
            raise CompileError(f"moe layer {layer}: expert sub-programs must start with W_FMT = bf16")
        b.invalidate_gb()
        pg = b.place_matrix(f"{gn}.{e}.gate", gu[e, :inter])
        pu = b.place_matrix(f"{gn}.{e}.up", gu[e, inter:])
        pd = b.place_matrix(f"{dn}.{e}", dw[e])
        b.host("moe_expert", [], [], layer=layer, expert=e)
        markers.append(len(b.host_ops) - 1)
        start = len(b.instrs)
        g, u, a, y = (b.buffer(f"{pre}.e{e}.{s}", n) for s, n in (("gate", inter), ("up", inter), ("act", inter), ("y", h)))
        b.gemv(pg, x_buf, g)
        b.gemv(pu, x_buf, u)
        b.host("silu_mul", [g, u], [a])
        b.gemv(pd, a, y)
        b.sync()
        macs.append(sum(1 for ins in b.instrs[start:] if ins.op.name == "MAC_AB"))
        ys.append(y)
    b.invalidate_gb()
    b.buffer(out, h)
    b.host("moe_dispatch", [f"{pre}.route", *ys], [out], layer=layer, experts=markers, top_k=k, num_experts=e_count)
    return {"layer": layer, "num_experts": e_count, "top_k": k, "score_func": str(attrs["score_func"]),
            "norm_topk_prob": bool(attrs["norm_topk_prob"]), "expert_markers": markers, "dispatch": len(b.host_ops) - 1,
            "mac_ab_per_expert": macs, "router_mac_ab": sum(len(r) for r in pr.rows), **route_attrs}
