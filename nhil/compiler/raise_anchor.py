"""Attention recognised by its anchors, whatever code surrounds them.

The PIM-bound part of an attention layer is small and fixed: the static-cache writes
``k_cache.index_copy_(2, cache_position, k)`` / ``v_cache.index_copy_(...)`` and the core
``scaled_dot_product_attention(q, repeat_kv(k_cache), repeat_kv(v_cache), causal mask)``.
Everything around it (how q/k/v are cut into heads, QK-norms, every RoPE variant:
rotate-half, interleaved, partial, ``cat``/``slice`` forms; scalar multipliers; the output
re-layout) is the model's own code, and varies by family. :func:`h_attention_anchor` finds
the anchors in a region by data flow, raises them to ``nhil::attention_kv`` (decode) /
``nhil::attention`` (prefill), and keeps the rest as host ATen
(``nhil.compiler.host_aten.emit_host``): exact by construction, with no per-family code.

What must hold (else Mismatch, and the region is reported): one SDPA with dropout 0 and
no ``is_causal``; k/v reach it straight from the cache writes, optionally through
``repeat_kv`` (unsqueeze, expand, reshape) or ``enable_gqa``; the cache index evaluates to
the cache position at every position; the mask is the causal / sliding-window mask
``h_index_arith`` recognised (a named rule; a new mask rule needs a new pattern); one
query token in decode. Source of the anchors: transformers 5.24 ``cache_utils.StaticCache``
(``index_copy_``), ``modeling_llama.repeat_kv``, ``integrations/sdpa_attention.py``.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from nhil.compiler.host_aten import _emit, _new_group, emit_host
from nhil.compiler.raise_match import Mismatch
from nhil.compiler.raising import Marker, _val

aten = torch.ops.aten
nhil = torch.ops.nhil
SDPA = aten.scaled_dot_product_attention.default


def _through_repeat_kv(ctx, x: fx.Node) -> tuple[fx.Node, list[fx.Node], int]:
    """(source [B,Hkv,L,hd], the repeat_kv nodes, n_rep) of an SDPA key/value operand."""
    x = ctx.r.canon(x)
    if x.target in (aten.reshape.default, aten.view.default) and x in ctx.members:
        e = ctx.r.canon(x.args[0])
        if e.target == aten.expand.default and e in ctx.members:
            u = ctx.r.canon(e.args[0])
            if u.target == aten.unsqueeze.default and u.args[1] == 2 and u in ctx.members:
                src = ctx.r.canon(u.args[0])
                sv, xv, sizes = _val(src), _val(x), list(e.args[1])
                b, hkv, L, hd = sv.shape
                if len(sizes) == 5 and sizes[:2] == [b, hkv] and sizes[3:] == [L, hd] and isinstance(sizes[2], int) and tuple(xv.shape) == (b, hkv * sizes[2], L, hd):
                    return src, [x, e, u], sizes[2]
                raise Mismatch(x, f"repeat_kv of {src.name} has shapes {tuple(sv.shape)} -> {tuple(xv.shape)} (expand {sizes})")
    return x, [], 1


def _index_slice(ctx, pos: fx.Node) -> list[fx.Node]:
    """The region's nodes that compute cache index ``pos`` (graph order)."""
    out, stack = set(), [ctx.r.canon(pos)]
    while stack:
        n = stack.pop()
        if n in ctx.members and n not in out:
            out.add(n)
            stack.extend(ctx.r.canon(a) for a in n.all_input_nodes)
    return [n for n in ctx.nodes if n in out]


def _check_cache_index(ctx, pos: fx.Node, nodes: list[fx.Node]) -> None:
    """``pos`` must equal ``[p]`` at every cache position p (evaluated exhaustively)."""
    pos = ctx.r.canon(pos)
    ext = [] if pos in nodes else [pos]
    for n in nodes:
        for a in n.all_input_nodes:
            a = ctx.r.canon(a)
            if a not in nodes and a not in ext:
                ext.append(a)
    for p in range(ctx.r.cache_len):
        vals = {}
        for a in ext:
            v = ctx.r.env.get(a)
            if isinstance(v, Marker) and v.kind == "cache_pos0":
                vals[a] = torch.full(_val(a).shape, p, dtype=_val(a).dtype)
            elif a.op == "placeholder" and a.name == "cache_position":
                vals[a] = torch.tensor([p])
            else:
                raise Mismatch(pos, f"the cache index {pos.name} reads {a.name}, which is not the cache position")
        look = lambda a: vals[ctx.r.canon(a)]  # noqa: E731
        for n in nodes:
            vals[n] = n.target(*fx.node.map_arg(n.args, look), **fx.node.map_arg(n.kwargs, look))
        got = vals[pos]
        if not (isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.tolist() == [p]):
            raise Mismatch(pos, f"the cache index {pos.name} is not the cache position (at position {p}: {got})")


def _cache_writes(ctx, kw: fx.Node, vw: fx.Node) -> tuple:
    """(k cache, v cache, new k heads, new v heads, the nodes computing the cache index) of the two static-cache
    writes ``kw`` / ``vw`` (``index_copy_(cache, 2, pos, heads)``), their index checked at every position.

    Raises:
        Mismatch: a write along another dim than the sequence dim 2, or an index that is not the cache position.
    """
    (kcache, kdim, kpos, k_h), (vcache, vdim, vpos, v_h) = kw.args, vw.args
    if kdim != 2 or vdim != 2:
        raise Mismatch(kw, "static-cache writes must index the sequence dim 2")
    k_idx, v_idx = _index_slice(ctx, kpos), _index_slice(ctx, vpos)
    _check_cache_index(ctx, kpos, k_idx)
    _check_cache_index(ctx, vpos, v_idx)
    idx = k_idx + [n for n in v_idx if n not in k_idx]
    return kcache, vcache, k_h, v_h, idx


def _flat(ctx, x: fx.Node, shape, old: fx.Node) -> fx.Node:
    """[B,H,S,hd] heads -> [B,S,H*hd] (host ATen transpose + reshape: exact re-layout)."""
    b, h, s, hd = shape
    t = _emit(ctx, aten.transpose.int, (x, 1, 2), {}, old)
    return _emit(ctx, aten.reshape.default, (t, [b, s, h * hd]), {}, old)


def _flat_qkv(ctx, done: dict, heads, old: fx.Node) -> list[fx.Node]:
    """The graph-IR [B,S,H*hd] forms of the q / k / v heads (old nodes ``heads``): emitted by the glue
    (``done``) or recomputed, in the exported shape, then flattened (host ATen, exact re-layout)."""
    from nhil.compiler.host_aten import _exported_shape, materialise

    news = [done[x] if x in done else _exported_shape(ctx, materialise(ctx, x), x) for x in heads]
    _new_group(ctx)
    return [_flat(ctx, n, _val(x).shape, old) for n, x in zip(news, heads)]


def _cache_position(ctx) -> fx.Node:
    """The graph IR's ``cache_position`` input."""
    return next(v for k, v in ctx.r.env.items() if k.op == "placeholder" and k.name == "cache_position")


def _heads_out(ctx, att: fx.Node, shape, old: fx.Node, done: dict) -> None:
    """Map the exported core output ``old`` ([B,Hq,S,hd]) to the primitive's [B,S,Hq*hd] output viewed back."""
    b, hq, s, hd = shape
    _new_group(ctx)
    r = _emit(ctx, aten.reshape.default, (att, [b, s, hq, hd]), {}, old)
    oh = _emit(ctx, aten.transpose.int, (r, 1, 2), {}, old)
    if _val(old).dim() == 3:  # a bmm core's [B*Hq, S, hd]
        oh = _emit(ctx, aten.reshape.default, (oh, list(_val(old).shape)), {}, old)
    ctx.set(old, oh)
    done[old] = oh


def h_attention_anchor(ctx) -> None:
    """Any attention layer: anchors -> ``nhil::attention_kv`` / ``nhil::attention``, the rest host ATen.

    Raises:
        Mismatch: no single SDPA core, k/v not straight from the caches, a mask that is
            not a recognised causal rule, inconsistent head shapes, or PIM-bound work in
            the glue (a weight product that is not a plain linear).
    """
    sdpas = [n for n in ctx.nodes if n.target == SDPA]
    if len(sdpas) != 1:
        raise Mismatch(ctx.nodes[0], f"an attention region needs one scaled_dot_product_attention, found {len(sdpas)}")
    o = sdpas[0]
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    a = dict(zip(names, o.args)) | dict(o.kwargs)
    if a.get("dropout_p", 0.0) != 0.0 or a.get("is_causal", False):
        raise Mismatch(o, "SDPA with dropout or is_causal=True is not a recognised attention core")
    q_h = ctx.r.canon(a["query"])
    k_src, k_path, nrep_k = _through_repeat_kv(ctx, a["key"])
    v_src, v_path, nrep_v = _through_repeat_kv(ctx, a["value"])
    qv, kv, vv = _val(q_h), _val(a["key"]), _val(a["value"])
    b, hq, s, hd = qv.shape
    gqa = bool(a.get("enable_gqa", False))
    writes = [n for n in ctx.nodes if n.target == aten.index_copy_.default]
    core = {o, *k_path, *v_path}
    decode = bool(writes)
    if decode:
        if sorted(writes, key=ctx.r.index.get) != sorted([k_src, v_src], key=ctx.r.index.get) or k_src is v_src:
            raise Mismatch(o, "decode attention: key and value must come straight from two static-cache writes (index_copy_)")
        kcache, vcache, k_h, v_h, idx_nodes = _cache_writes(ctx, k_src, v_src)
        core |= {k_src, v_src, *idx_nodes}
        for n in idx_nodes:
            if any(u not in core for u in n.users if u.op == "call_function"):
                raise Mismatch(n, f"{n.name} computes the cache index and is also used elsewhere")
        cache_shape = tuple(_val(kcache).shape)
        if tuple(_val(vcache).shape) != cache_shape:
            raise Mismatch(v_src, f"k/v caches differ in shape: {cache_shape} vs {tuple(_val(vcache).shape)}")
    else:
        k_h, v_h = k_src, v_src
    k_h, v_h = ctx.r.canon(k_h), ctx.r.canon(v_h)
    kh_v, vh_v = _val(k_h), _val(v_h)
    hkv = kh_v.shape[1]
    # (MQA by SDPA broadcasting, Falcon's one KV head without repeat_kv, is not accepted: the
    # repeat_kv form nhil::attention_kv computes differs from the broadcast in the last bit, measured)
    nrep = hq // hkv if gqa else nrep_k
    ok = (kh_v.dim() == vh_v.dim() == 4 and tuple(kh_v.shape) == tuple(vh_v.shape) == (b, hkv, s, hd) and nrep_k == nrep_v
          and hkv * nrep == hq and kv.shape[-1] == vv.shape[-1] == hd and qv.dtype == kh_v.dtype == vh_v.dtype == torch.float32)
    if decode:
        ok = ok and cache_shape[:2] == (b, hkv) and cache_shape[3] == hd and s == 1
    if not ok:
        raise Mismatch(o, f"attention shapes do not fit: q {tuple(qv.shape)}, k {tuple(kh_v.shape)}, v {tuple(vh_v.shape)}, n_rep {nrep_k}/{nrep_v}, gqa {gqa}")
    mask = ctx.value(a["attn_mask"]) if a.get("attn_mask") is not None else None
    if not (isinstance(mask, Marker) and mask.kind == "causal_mask" and not mask.data[3]):
        raise Mismatch(o, "the SDPA mask is not a recognised boolean causal / sliding-window mask (a new mask rule needs a pattern)")
    kind, kv_len, window, _ = mask.data
    if decode and (kind, kv_len) != ("cache", cache_shape[2]):
        raise Mismatch(o, f"decode attention needs a causal cache mask over L={cache_shape[2]}, got {mask.data}")
    if not decode and (kind, kv_len) != ("prefill", s):
        raise Mismatch(o, f"prefill attention needs a causal mask over S={s}, got {mask.data}")
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if not isinstance(scale, float):
        raise Mismatch(o, f"SDPA scale must be a constant, got {scale!r}")

    rest = [n for n in ctx.nodes if n not in core]
    need = {q_h, k_h, v_h}
    pre_set: set[fx.Node] = set()
    stack = [n for n in need if n in ctx.members]
    while stack:
        n = stack.pop()
        if n in pre_set or n in core:
            continue
        pre_set.add(n)
        stack.extend(ctx.r.canon(x) for x in n.all_input_nodes if ctx.r.canon(x) in ctx.members)
    pre = [n for n in rest if n in pre_set]
    post = [n for n in rest if n not in pre_set]
    done = emit_host(ctx, pre)
    qf, kf, vf = _flat_qkv(ctx, done, (q_h, k_h, v_h), o)
    extra = (window,) if window is not None else ()
    if decode:
        cp = _cache_position(ctx)
        kc, vc = ctx.param(kcache), ctx.param(vcache)
        att = ctx.emit(nhil.attention_kv.default, qf, kf, vf, kc, vc, cp, hq, hkv, float(scale), *extra)
        ctx.set(k_src, Marker("cache_write", kc))
        ctx.set(v_src, Marker("cache_write", vc))
    else:
        att = ctx.emit(nhil.attention.default, qf, kf, vf, hq, hkv, float(scale), *extra)
    _heads_out(ctx, att, qv.shape, o, done)
    emit_host(ctx, post, done)
    if decode:
        ctx.r.cache_names += [kc.target, vc.target]
