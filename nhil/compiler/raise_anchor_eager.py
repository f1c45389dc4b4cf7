"""Eager attention recognised by its anchors: the two static-cache writes, ``q @ Kᵀ`` and ``p @ V``
as ``matmul`` (Llama ``attn_implementation="eager"``, BERT-era models), ``bmm`` over [B*H, L, hd]
merges (XGLM) or ``baddbmm`` adding a bias (BLOOM's ALiBi). The two products are PIM primitives
(``nhil::attention_scores`` / ``nhil::attention_values``); the score transform between them (scale,
bias, mask, soft-cap, softmax) and the glue stay host ATen. The cache writes, the cache index and
the q/k/v re-layouts are shared with the SDPA anchors (``raise_anchor``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nhil.compiler.host_aten import _emit, _new_group, emit_host
from nhil.compiler.raise_anchor import _cache_position, _cache_writes, _flat_qkv, _heads_out, _through_repeat_kv
from nhil.compiler.raise_match import Mismatch
from nhil.compiler.raising import Marker, _val

aten = torch.ops.aten
nhil = torch.ops.nhil

__all__ = ["h_attention_eager", "EAGER_PRODUCTS"]


def _through_transpose(ctx, x: fx.Node) -> fx.Node | None:
    """``y`` when ``x`` is ``y`` with its last two dims swapped (``transpose(2, 3)`` of [B,H,L,hd],
    ``transpose(1, 2)`` of a bmm's [B*H, L, hd]) inside the region."""
    x = ctx.r.canon(x)
    if x.target == aten.transpose.int and x in ctx.members:
        nd = _val(x).dim()
        if {a % nd for a in x.args[1:3]} == {nd - 2, nd - 1}:
            return ctx.r.canon(x.args[0])
    return None


EAGER_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.baddbmm.default)


def _operands(m: fx.Node) -> tuple:
    """(left, right) of a product: ``baddbmm(bias, a, b)`` multiplies its 2nd and 3rd arguments."""
    return (m.args[1], m.args[2]) if m.target == aten.baddbmm.default else (m.args[0], m.args[1])


def _baddbmm_epilogue(ctx, s_mm: fx.Node, scores: fx.Node, done: dict) -> fx.Node:
    """``beta * bias + alpha * (q @ kᵀ)`` after the PIM product, as host ATen in the order ATen's CPU
    ``baddbmm`` rounds it (``self * beta + alpha * acc``; aten/src/ATen/native/LinearAlgebra.cpp
    ``baddbmm_cpu_kernel``). The raise check compares it bit for bit with the exported ``baddbmm``.

    Raises:
        Mismatch: non-float ``alpha`` / ``beta``.
    """
    from nhil.compiler.host_aten import _exported_shape, materialise

    alpha, beta = s_mm.kwargs.get("alpha", 1), s_mm.kwargs.get("beta", 1)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, beta)):
        raise Mismatch(s_mm, f"baddbmm with alpha {alpha!r} / beta {beta!r}: not scalars")
    src = ctx.r.canon(s_mm.args[0])
    b = done[src] if src in done else _exported_shape(ctx, materialise(ctx, src), src)
    _new_group(ctx)
    prod = _emit(ctx, aten.mul.Tensor, (scores, alpha), {}, s_mm)
    if beta == 0:
        return prod
    return _emit(ctx, aten.add.Tensor, (_emit(ctx, aten.mul.Tensor, (b, beta), {}, s_mm), prod), {}, s_mm)


def _heads4(ctx, x: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the [B,H,L,hd] value, [the merge node]) when ``x`` is its reshape to a bmm's [B*H, L, hd] inside the
    region (XGLM / BERT-era ``torch.bmm`` attention), else (``x``, [])."""
    x = ctx.r.canon(x)
    if x.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default) and x in ctx.members:
        src = ctx.r.canon(x.args[0])
        sv, xv = _val(src), _val(x)
        if sv.dim() == 4 and xv.dim() == 3 and tuple(xv.shape) == (sv.shape[0] * sv.shape[1], sv.shape[2], sv.shape[3]):
            return src, [x]
    return x, []


def _descendants(ctx, start: fx.Node) -> set[fx.Node]:
    """Region nodes that read ``start``, directly or through identity casts."""
    from nhil.compiler.raising import _is_transparent

    out, stack, seen = set(), [start], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if _is_transparent(u):
                stack.append(u)
            elif u in ctx.members:
                out.add(u)
                stack.append(u)
    return out


def _ancestors(ctx, targets, stop: set) -> set[fx.Node]:
    out, stack = set(), [ctx.r.canon(t) for t in targets]
    while stack:
        n = stack.pop()
        if n in out or n in stop or n not in ctx.members:
            continue
        out.add(n)
        stack.extend(ctx.r.canon(a) for a in n.all_input_nodes)
    return out


def h_attention_eager(ctx) -> None:
    """Eager decode attention: ``matmul(q, repeat_kv(k_cache)ᵀ)`` -> the model's score transform
    -> ``matmul(p, repeat_kv(v_cache))``. The products become ``nhil::attention_scores`` /
    ``nhil::attention_values`` (PIM); the transform (scale, mask, bias, soft-cap, softmax) and the
    glue stay host ATen (``nhil.compiler.primitives_attention``).

    Raises:
        Mismatch: not two static-cache writes feeding exactly one scores product and one values
            product, a transform that reads the cache, or inconsistent head shapes.
    """
    writes = [n for n in ctx.nodes if n.target == aten.index_copy_.default]
    mms = [n for n in ctx.nodes if n.target in EAGER_PRODUCTS]
    if len(writes) != 2 or len(mms) != 2:
        raise Mismatch(ctx.nodes[0], f"eager attention needs two cache writes and two matmuls, found {len(writes)} and {len(mms)}")
    s_mm = p_mm = None
    for m in mms:
        kt = _through_transpose(ctx, _operands(m)[1])
        if kt is not None and _through_repeat_kv(ctx, _heads4(ctx, kt)[0])[0] in writes:
            s_mm = m
        elif m.target != aten.baddbmm.default and _through_repeat_kv(ctx, _heads4(ctx, m.args[1])[0])[0] in writes:
            p_mm = m
    if s_mm is None or p_mm is None or s_mm is p_mm:
        raise Mismatch(mms[0], "eager attention: no matmul(q, Kᵀ) and matmul(p, V) over the two cache writes")
    s_q, s_k = _operands(s_mm)
    k4, k_merge = _heads4(ctx, _through_transpose(ctx, s_k))
    v4, v_merge = _heads4(ctx, p_mm.args[1])
    q4, q_merge = _heads4(ctx, s_q)
    if any(set(m.users) != {u} for m, u in zip(q_merge + k_merge + v_merge, [s_mm] * len(q_merge) + [ctx.r.canon(s_k)] * len(k_merge) + [p_mm] * len(v_merge))):
        raise Mismatch(s_mm, "eager attention: a bmm operand's [B*H, L, hd] merge is also used elsewhere")
    kc, k_path, nrep_k = _through_repeat_kv(ctx, k4)
    vc, v_path, nrep_v = _through_repeat_kv(ctx, v4)
    if kc is vc:
        raise Mismatch(s_mm, "eager attention: scores and values read the same cache")
    kcache, vcache, k_h, v_h, idx = _cache_writes(ctx, kc, vc)
    q_h, k_h, v_h = q4, ctx.r.canon(k_h), ctx.r.canon(v_h)
    qv, kh_v, vh_v, cache = _val(q_h), _val(k_h), _val(v_h), tuple(_val(kcache).shape)
    b, hq, s, hd = qv.shape
    hkv = kh_v.shape[1]
    ok = (tuple(kh_v.shape) == tuple(vh_v.shape) == (b, hkv, s, hd) and nrep_k == nrep_v and hkv * nrep_k == hq and s == 1
          and cache[:2] == (b, hkv) and cache[3] == hd and tuple(_val(vcache).shape) == cache and qv.dtype == torch.float32)
    if not ok:
        raise Mismatch(s_mm, f"eager attention shapes do not fit: q {tuple(qv.shape)}, k {tuple(kh_v.shape)}, v {tuple(vh_v.shape)}, cache {cache}, n_rep {nrep_k}/{nrep_v}")
    core = {kc, vc, ctx.r.canon(s_k), s_mm, p_mm, *k_path, *v_path, *idx, *q_merge, *k_merge, *v_merge}
    for n in idx:
        if any(u not in core for u in n.users if u.op == "call_function"):
            raise Mismatch(n, f"{n.name} computes the cache index and is also used elsewhere")
    mid_set = _descendants(ctx, s_mm) & _ancestors(ctx, [p_mm.args[0]], core)
    probs = ctx.r.canon(p_mm.args[0])
    if probs not in mid_set:
        raise Mismatch(p_mm, "eager attention: the probabilities are not computed from the scores")
    # before the scores: what q / k / v need, and what the transform reads that does not depend on the scores
    # (XGLM's ``torch.full((), finfo.min)`` clamp bound)
    bias = [s_mm.args[0]] if s_mm.target == aten.baddbmm.default else []  # BLOOM's ALiBi, added by baddbmm
    pre_set = _ancestors(ctx, [q_h, k_h, v_h, *bias], core) | (_ancestors(ctx, list(mid_set), core) - mid_set)
    rest = [n for n in ctx.nodes if n not in core]
    pre = [n for n in rest if n in pre_set]
    mid = [n for n in rest if n in mid_set]
    if set(pre) & set(mid):
        raise Mismatch(s_mm, "eager attention: the query depends on the scores")
    post = [n for n in rest if n not in pre_set and n not in mid_set]
    done = emit_host(ctx, pre)
    qf, kf, vf = _flat_qkv(ctx, done, (q_h, k_h, v_h), s_mm)
    cp = _cache_position(ctx)
    kcn, vcn = ctx.param(kcache), ctx.param(vcache)
    scores = ctx.emit(nhil.attention_scores.default, qf, kf, kcn, cp, hq, hkv)  # [B,Hq,S,L]
    _new_group(ctx)
    if _val(s_mm).dim() == 3:  # a bmm core: the transform reads [B*Hq, S, L]
        scores = _emit(ctx, aten.reshape.default, (scores, list(_val(s_mm).shape)), {}, s_mm)
    if bias:
        scores = _baddbmm_epilogue(ctx, s_mm, scores, done)
    ctx.set(s_mm, scores)
    done[s_mm] = scores
    done.update(emit_host(ctx, mid, done))
    pr = done[probs]
    if _val(probs).dim() == 3:
        _new_group(ctx)
        pr = _emit(ctx, aten.reshape.default, (pr, [b, hq, s, cache[2]]), {}, p_mm)
    att = ctx.emit(nhil.attention_values.default, pr, vf, vcn, cp, hq, hkv)
    _heads_out(ctx, att, qv.shape, p_mm, done)
    ctx.set(kc, Marker("cache_write", kcn))
    ctx.set(vc, Marker("cache_write", vcn))
    emit_host(ctx, post, done)
    ctx.r.cache_names += [kcn.target, vcn.target]
