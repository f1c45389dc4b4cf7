"""Region handlers of DeepSeek-V3: multi-head latent attention (decode) and its MoE router.

Sources (transformers 5.24, ``models/deepseek_v3/modeling_deepseek_v3.py``):
``DeepseekV3Attention.forward`` / ``expand_kv`` / ``apply_rotary_pos_emb_interleave`` and
``DeepseekV3TopkRouter.forward`` / ``DeepseekV3MoE.forward``; the op sequences are those
torch 2.13's ``torch.export`` records for the decode step with nhil's latent-shaped static
cache (``export._shape_mla_cache``).

MLA spans five regions in the decode export, visited in this order:

1. attention piece ``view/transpose/split`` of q (``q_b_proj`` output) and ``split`` of
   ``kv_a_proj_with_mqa``'s output -> ``nhil.narrow`` for the latent (consumed by the
   ``kv_a_layernorm`` RMSNorm region) and for the shared RoPE key; q halves -> Markers;
2. ``cumulative_length.add_(1)`` (the StaticCache's counter, dropped as for Llama);
3. attention piece: latent / k_rope views, interleaved RoPE of q_rot and k_rot, the two
   ``index_copy_`` latent-cache writes, ``cat(q_pass, q_rot)`` -> Markers;
4. ``kv_b_proj`` (a Linear region) applied to the whole latent cache -> Marker
   (:func:`h_mla_kv_b`, called by ``raise_handlers.h_linear``);
5. attention piece: split of the expanded K/V, key assembly (``new_empty`` + two
   ``copy_``), SDPA with the causal cache mask, output re-layout -> one ``nhil.mla_kv``.

Each piece checks that its inputs come from the same attention's earlier pieces. In the
prefill export (no cache) the pieces are: split + RoPE + query in one region (visited
before ``kv_a_layernorm`` thanks to ``RegionPartition._topological``), the latent view alone,
``kv_b_proj`` over the prompt's latents, and the same core -> one ``nhil.mla``.
"""

from __future__ import annotations

import operator

import torch

from nhil.compiler.raise_attention import h_attention
from nhil.compiler.raise_ctx import INT64_MAX, Ctx
from nhil.compiler.raise_match import ANY, Mismatch, V, match_any
from nhil.compiler.raise_moe import emit_moe
from nhil.compiler.raising import Marker, _val

aten = torch.ops.aten
nhil = torch.ops.nhil

MLA_SPLIT = [
    ("q_view", aten.view.default, (V("q"), [V("B"), V("S"), -1, V("qk")]), None),
    ("q_t", aten.transpose.int, (V("q_view"), 1, 2), None),
    ("q_split", aten.split_with_sizes.default, (V("q_t"), [V("nope"), V("rope")], -1), None),
    ("q_pass", operator.getitem, (V("q_split"), 0), None),
    ("q_rot", operator.getitem, (V("q_split"), 1), None),
    ("kv_split", aten.split_with_sizes.default, (V("ckv"), [V("r"), V("rope")], -1), None),
    ("kv_nope", operator.getitem, (V("kv_split"), 0), None),
    ("k_pe", operator.getitem, (V("kv_split"), 1), None),
]


def _interleave(p: str, src: str) -> list[tuple]:
    """apply_rotary_pos_emb_interleave of one tensor, after the shared slices (see MLA_ROPE)."""
    return [
        (f"{p}_mc", aten.mul.Tensor, (V(f"{p}1"), V("cos_u")), None),
        (f"{p}_ms", aten.mul.Tensor, (V(f"{p}2"), V("sin_u")), None),
        (f"{p}_sub", aten.sub.Tensor, (V(f"{p}_mc"), V(f"{p}_ms")), None),
        (f"{p}_mc2", aten.mul.Tensor, (V(f"{p}2"), V("cos_u")), None),
        (f"{p}_ms2", aten.mul.Tensor, (V(f"{p}1"), V("sin_u")), None),
        (f"{p}_add", aten.add.Tensor, (V(f"{p}_mc2"), V(f"{p}_ms2")), None),
        (f"{p}_emb", aten.cat.default, ([V(f"{p}_sub"), V(f"{p}_add")], -1), None),
    ]


LAT_VIEW = [("lat_view", aten.view.default, (V("lat"), [V("B"), 1, V("S"), V("r")]), None)]
MLA_ROPE = [
    ("k_view", aten.view.default, (V("k_pe"), [V("B"), 1, V("S"), V("rope")]), None),
    ("cos_h", aten.slice.Tensor, (V("cos"), 2, 0, V("half")), None),
    ("cos_u", aten.unsqueeze.default, (V("cos_h"), 1), None),
    ("sin_h", aten.slice.Tensor, (V("sin"), 2, 0, V("half")), None),
    ("sin_u", aten.unsqueeze.default, (V("sin_h"), 1), None),
    ("q1", aten.slice.Tensor, (V("q_rot"), 3, 0, INT64_MAX, 2), None),
    ("q2", aten.slice.Tensor, (V("q_rot"), 3, 1, INT64_MAX, 2), None),
    ("k1", aten.slice.Tensor, (V("k_view"), 3, 0, INT64_MAX, 2), None),
    ("k2", aten.slice.Tensor, (V("k_view"), 3, 1, INT64_MAX, 2), None),
    *_interleave("q", "q_rot"),
    *_interleave("k", "k_view"),
]
QUERY = [("query", aten.cat.default, ([V("q_pass"), V("q_emb")], -1), None)]
MLA_ROPE_CACHE = LAT_VIEW + MLA_ROPE + [
    ("pos_ar", aten.arange.default, (V("S"),), ANY),
    ("pos", aten.add.Tensor, (V("pos_ar"), V("cp0")), None),
    ("lc", aten.index_copy_.default, (V("lcache"), 2, V("pos"), V("lat_view")), None),
    ("rc", aten.index_copy_.default, (V("rcache"), 2, V("pos"), V("k_emb")), None),
] + QUERY
# prefill (no cache): the head/latent split, RoPE and query in one region; the latent view alone
MLA_PREFILL_FRONT = MLA_SPLIT + MLA_ROPE + QUERY

MLA_CORE = [
    ("kv_view", aten.view.default, (V("kv"), [V("B"), V("L"), -1, V("nv")]), None),
    ("kv_t", aten.transpose.int, (V("kv_view"), 1, 2), None),
    ("kv_split", aten.split_with_sizes.default, (V("kv_t"), [V("nope"), V("v")], -1), None),
    ("k_nope", operator.getitem, (V("kv_split"), 0), None),
    ("value", operator.getitem, (V("kv_split"), 1), None),
    ("k_rot", aten.expand.default, (V("rc"), [-1, V("H"), -1, -1]), None),
    ("key", aten.new_empty.default, (V("kv_t"), [V("B"), V("H"), V("L"), V("qk")]), ANY),
    ("key_lo", aten.slice.Tensor, (V("key"), 3, 0, V("nope")), None),
    ("copy_lo", aten.copy_.default, (V("key_lo"), V("k_nope")), None),
    ("key_hi", aten.slice.Tensor, (V("key"), 3, V("nope"), INT64_MAX), None),
    ("copy_hi", aten.copy_.default, (V("key_hi"), V("k_rot")), None),
    ("o", aten.scaled_dot_product_attention.default, (V("query"), V("key"), V("value"), V("mask")), {"scale": V("scale")}),
    ("o1", aten.reshape.default, (V("o"), [V("B"), -1, V("S"), V("v")]), None),
    ("o2", aten.transpose.int, (V("o1"), 1, 2), None),
    ("out", aten.reshape.default, (V("o2"), [V("B"), V("S"), -1]), None),
]


def _state(ctx: Ctx, old, kind: str, st: dict | None = None) -> dict:
    m = ctx.marker(old, kind)
    if st is not None and m.data is not st:
        raise Mismatch(ctx.nodes[0], f"input {old.name} belongs to another MLA attention")
    return m.data


def _q_lora_rank(q_old) -> int | None:
    """In-features of the Linear producing q (``q_b_proj``: q_lora_rank), when q comes from one."""
    if q_old.op == "call_function" and q_old.target == aten.linear.default:
        w = _val(q_old.args[1])
        if q_old.args[1].op == "placeholder" and "q_b_proj" in q_old.args[1].name and isinstance(w, torch.Tensor):
            return int(w.shape[1])
    return None


def _split_state(ctx: Ctx, b: dict) -> dict:
    """The q head split and the kv_a split (first piece): checks, ``nhil.narrow`` of the latent
    (its output feeds the kv_a_layernorm region) and of the shared RoPE key; the state dict."""
    qv, ckv = _val(b["q"]), _val(b["ckv"])
    nope, rope, r = b["nope"], b["rope"], b["r"]
    if qv.dim() != 3 or b["qk"] != nope + rope or qv.shape[-1] % b["qk"] or ckv.dim() != 3 or ckv.shape[-1] != r + rope:
        raise Mismatch(ctx.nodes[0], f"inconsistent MLA projections (q {tuple(qv.shape)}, kv_a {tuple(ckv.shape)}, nope/rope/r {nope}/{rope}/{r})")
    ckv_t = ctx.tensor(b["ckv"])
    st = {"q": ctx.tensor(b["q"]), "H": qv.shape[-1] // b["qk"], "nope": nope, "rope": rope, "r": r, "q_lora_rank": _q_lora_rank(ctx.r.canon(b["q"]))}
    st["k_pe"] = ctx.emit(nhil.narrow.default, ckv_t, r, rope)
    nar = ctx.emit(nhil.narrow.default, ckv_t, 0, r)
    ctx.r.__dict__.setdefault("mla_pending", {})[nar] = st
    ctx.set(b["kv_nope"], nar)
    return st


def _check_rope(ctx: Ctx, b: dict, st: dict) -> None:
    cos, sin = _val(b["cos"]), _val(b["sin"])
    if b["rope"] != st["rope"] or 2 * b["half"] != st["rope"] or cos.shape[-1] != st["rope"] or sin.shape[-1] != st["rope"]:
        raise Mismatch(ctx.nodes[0], f"MLA RoPE shapes do not fit (rope={b['rope']}, half={b['half']}, cos {tuple(cos.shape)})")
    st.update(cos=ctx.tensor(b["cos"]), sin=ctx.tensor(b["sin"]))


def _latent(ctx: Ctx, b: dict, st: dict | None) -> dict:
    """The normalised latent ``view(lat, [B, 1, S, r])``: lat must be kv_a_layernorm of the
    latent narrow of this attention's first piece."""
    lat = ctx.tensor(b["lat"])
    latv = _val(b["lat"])
    src = lat.args[0] if lat.op == "call_function" and lat.target == nhil.rms_norm.default else None
    found = ctx.r.__dict__.get("mla_pending", {}).get(src)
    if found is None or (st is not None and found is not st):
        raise Mismatch(ctx.nodes[0], "MLA latent view does not read the kv_a_layernorm of this attention's latent")
    if latv.dim() != 3 or latv.shape[-1] != found["r"] or b["r"] != found["r"]:
        raise Mismatch(ctx.nodes[0], f"MLA latent {tuple(latv.shape)} is not [B, S, kv_lora_rank={found['r']}]")
    found["lat"] = lat
    return found


def h_mla(ctx: Ctx) -> None:
    """DeepseekV3Attention pieces (see the module docstring) -> Markers, ``nhil.narrow``, one
    ``nhil.mla_kv`` (decode) or ``nhil.mla`` (prefill)."""
    first = ctx.nodes[0]
    if first.target == aten.add_.Tensor:
        h_attention(ctx)  # the StaticCache's cumulative_length.add_(1), checked as for Llama
        return
    i, b = match_any([MLA_SPLIT, MLA_ROPE_CACHE, MLA_CORE, MLA_PREFILL_FRONT, LAT_VIEW], ctx.nodes, ctx.r.canon)
    decode = ctx.r.kind == "decode"
    if i in (0, 1) and not decode or i in (3, 4) and decode:
        raise Mismatch(first, f"MLA {'decode' if i < 3 else 'prefill'} piece in a {ctx.r.kind} graph")
    if i == 0:  # decode: split only
        st = _split_state(ctx, b)
        ctx.set(b["k_pe"], Marker("mla_k_pe", st))
        ctx.set(b["q_pass"], Marker("mla_q_pass", st))
        ctx.set(b["q_rot"], Marker("mla_q_rot", st))
        return
    if i == 3:  # prefill: split + RoPE + query
        st = _split_state(ctx, b)
        _check_rope(ctx, b, st)
        ctx.set(b["k_emb"], Marker("mla_k_rot", st))
        ctx.set(b["query"], Marker("mla_query", st))
        return
    if i == 4:  # prefill: the latent view
        ctx.set(b["lat_view"], Marker("mla_latent", _latent(ctx, b, None)))
        return
    if i == 1:
        st = _state(ctx, b["k_pe"], "mla_k_pe")
        _state(ctx, b["q_rot"], "mla_q_rot", st)
        _state(ctx, b["q_pass"], "mla_q_pass", st)
        if b["S"] != 1:
            raise Mismatch(first, f"MLA decode takes one token, got S={b['S']}")
        _check_rope(ctx, b, st)
        _latent(ctx, b, st)
        lc, rc = ctx.param(b["lcache"]), ctx.param(b["rcache"])
        lcs, rcs = _val(b["lcache"]), _val(b["rcache"])
        if tuple(lcs.shape[:2]) != (1, 1) or lcs.shape[3] != st["r"] or tuple(rcs.shape) != (1, 1, lcs.shape[2], st["rope"]):
            raise Mismatch(b["lc"], f"MLA latent caches {tuple(lcs.shape)} / {tuple(rcs.shape)} are not [1,1,L,r] / [1,1,L,rope]")
        st.update(lc=lc, rc=rc, cp=ctx.marker(b["cp0"], "cache_pos0").data, L=int(lcs.shape[2]))
        ctx.set(b["lc"], Marker("mla_latent_cache", st))
        ctx.set(b["rc"], Marker("mla_rope_cache", st))
        ctx.set(b["query"], Marker("mla_query", st))
        return
    st = _state(ctx, b["kv"], "mla_kv")
    _state(ctx, b["rc"], "mla_rope_cache" if decode else "mla_k_rot", st)
    _state(ctx, b["query"], "mla_query", st)
    h, nope, v = st["H"], st["nope"], b["v"]
    seq = st["L"] if decode else b["S"]
    if (b["nope"] != nope or b["H"] != h or b["qk"] != nope + st["rope"] or b["nv"] != nope + v or b["L"] != seq
            or (decode and b["S"] != 1) or not isinstance(b["scale"], float) or tuple(st["wshape"]) != (h * (nope + v), st["r"])):
        raise Mismatch(first, f"inconsistent MLA core (H={b['H']}/{h}, nope={b['nope']}/{nope}, v={v}, L={b['L']}/{seq}, kv_b {tuple(st['wshape'])})")
    mask = ctx.marker(b["mask"], "causal_mask").data
    if mask[:3] != ("cache" if decode else "prefill", seq, None) or mask[3]:
        raise Mismatch(b["o"], f"MLA needs the boolean causal mask over {seq} keys, got {mask}")
    attrs = (h, st["r"], nope, st["rope"], v, b["scale"], True, st["q_lora_rank"])
    if decode:
        ctx.r.cache_names += [st["lc"].target, st["rc"].target]
        out = ctx.emit(nhil.mla_kv.default, st["q"], st["lat"], st["k_pe"], st["lc"], st["rc"], st["cp"], st["cos"], st["sin"], st["w"], *attrs)
    else:
        out = ctx.emit(nhil.mla.default, st["q"], st["lat"], st["k_pe"], st["cos"], st["sin"], st["w"], *attrs)
    ctx.set(b["out"], out)


def h_mla_kv_b(ctx: Ctx, b: dict) -> bool:
    """``kv_b_proj`` over the latent cache (decode) or the prompt's latents (prefill) (Linear
    region): -> Marker('mla_kv') carrying the weight. Returns False when the input is not an MLA latent cache (an ordinary Linear)."""
    xv = ctx.value(b["x"])
    if not (isinstance(xv, Marker) and xv.kind in ("mla_latent_cache", "mla_latent")):
        return False
    if "bias" in b:
        raise Mismatch(ctx.nodes[0], "kv_b_proj with a bias is not part of MLA")
    st = xv.data
    st.update(w=ctx.param(b["w"]), wshape=tuple(_val(b["w"]).shape))
    ctx.set(b["out"], Marker("mla_kv", st))
    return True


# ---------------------------------------------------------------- MoE (sigmoid, grouped top-k)

DS_ROUTER = [
    ("flat", aten.view.default, (V("tok"), [-1, V("H")]), None),
    ("logits", aten.linear.default, (V("flat"), V("rw")), None),
    ("scores", aten.sigmoid.default, (V("logits"),), None),
    ("choice", aten.add.Tensor, (V("scores"), V("bias")), None),
    ("gview", aten.view.default, (V("choice"), [-1, V("G"), V("EG")]), None),
    ("gtop", aten.topk.default, (V("gview"), 2), None),
    ("gtop_v", operator.getitem, (V("gtop"), 0), None),
    ("gsum", aten.sum.dim_IntList, (V("gtop_v"), [-1]), None),
    ("gsel", aten.topk.default, (V("gsum"), V("TG"), -1, True, False), None),
    ("gidx", operator.getitem, (V("gsel"), 1), None),
    ("gmask0", aten.zeros_like.default, (V("gsum"),), ANY),
    ("gmask", aten.scatter_.value, (V("gmask0"), 1, V("gidx"), 1), None),
    ("gm_u", aten.unsqueeze.default, (V("gmask"), -1), None),
    ("gm_e", aten.expand.default, (V("gm_u"), [-1, V("G"), V("EG")]), None),
    ("gm_r", aten.reshape.default, (V("gm_e"), [-1, V("E")]), None),
    ("gm_b", aten.to.dtype, (V("gm_r"), torch.bool), None),
    ("gm_n", aten.bitwise_not.default, (V("gm_b"),), None),
    ("masked", aten.masked_fill.Scalar, (V("choice"), V("gm_n"), float("-inf")), None),
    ("top", aten.topk.default, (V("masked"), V("k"), -1, True, False), None),
    ("ids", operator.getitem, (V("top"), 1), None),
    ("w", aten.gather.default, (V("scores"), 1, V("ids")), None),
]
DS_ROUTER_NORM = [
    ("wsum", aten.sum.dim_IntList, (V("w"), [-1], True), None),
    ("den", aten.add.Tensor, (V("wsum"), 1e-20), None),
    ("wn", aten.div_.Tensor, (V("w"), V("den")), None),
]
DS_ROUTER_PATTERNS = [
    DS_ROUTER + DS_ROUTER_NORM + [("ws", aten.mul.Tensor, (V("wn"), V("rsf")), None)],
    DS_ROUTER + [("ws", aten.mul.Tensor, (V("w"), V("rsf")), None)],
]


def h_ds_router(ctx: Ctx) -> None:
    """DeepseekV3TopkRouter (sigmoid, bias-corrected grouped top-k, routed scaling factor)
    -> Markers for the routing weights / expert ids; the block input is remembered so the
    block's own ``view(-1, H)`` (:func:`h_ds_moe_block`) hands the experts the same tokens."""
    i, b = match_any(DS_ROUTER_PATTERNS, ctx.nodes, ctx.r.canon)
    xv, rw, bias = _val(b["tok"]), _val(b["rw"]), _val(b["bias"])
    e = rw.shape[0] if isinstance(rw, torch.Tensor) and rw.dim() == 2 else -1
    ok = (isinstance(xv, torch.Tensor) and xv.dim() == 3 and xv.dtype == torch.float32 and b["H"] == xv.shape[-1]
          and rw.shape[1] == b["H"] and b["E"] == e and b["G"] * b["EG"] == e and b["EG"] >= 2
          and 0 < b["TG"] <= b["G"] and isinstance(b["k"], int) and 0 < b["k"] <= e
          and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (e,) and isinstance(b["rsf"], float))
    if not ok:
        raise Mismatch(ctx.nodes[0], f"inconsistent DeepSeek router (H={b['H']}, E={b['E']}, groups {b['G']}x{b['EG']}, topk_group={b['TG']}, k={b['k']})")
    tok = {"x": ctx.tensor(b["tok"]), "shape": tuple(xv.shape)}
    st = {"tok": tok, "rw": ctx.param(b["rw"]), "E": int(e), "k": int(b["k"]), "norm": i == 0, "score": "sigmoid",
          "extra": ("silu", ctx.param(b["bias"]), int(b["G"]), int(b["TG"]), float(b["rsf"]))}
    ctx.r.__dict__.setdefault("ds_moe_pending", {})[tok["x"]] = st
    ctx.set(b["ws"], Marker("moe_weights", st))
    ctx.set(b["ids"], Marker("moe_ids", st))


def h_ds_moe_block(ctx: Ctx) -> None:
    """DeepseekV3MoE glue: ``view(x, [-1, H])`` of the router's input -> Marker('moe_tokens');
    ``view(routed, orig_shape) + shared_experts(x)`` -> the ``nhil.moe`` node + ``nhil.add``
    (the shared expert is a DeepseekV3MLP, raised as linear / silu_mul / linear)."""
    n = ctx.nodes[0]
    if len(ctx.nodes) == 1:
        b = ctx.match([[("out", aten.view.default, (V("x"), [-1, V("H")]), None)]])
        st = ctx.r.__dict__.get("ds_moe_pending", {}).get(ctx.tensor(b["x"]))
        if st is None or b["H"] != st["tok"]["shape"][-1]:
            raise Mismatch(n, "DeepSeek MoE block input is not the input of a raised DeepSeek router")
        ctx.set(b["out"], Marker("moe_tokens", st["tok"]))
        return
    b = ctx.match([[("y", aten.view.default, (V("routed"), V("shape")), None), ("out", aten.add.Tensor, (V("y"), V("shared")), None)]])
    out = ctx.marker(b["routed"], "moe_out").data
    sv = _val(b["shared"])
    if list(b["shape"]) != list(out["shape"]) or not isinstance(sv, torch.Tensor) or tuple(sv.shape) != tuple(out["shape"]):
        raise Mismatch(n, f"DeepSeek MoE output view {b['shape']} / shared expert {tuple(getattr(sv, 'shape', ()))} do not fit {out['shape']}")
    ctx.set(b["out"], ctx.emit(nhil.add.default, emit_moe(ctx, out), ctx.tensor(b["shared"])))


DEEPSEEK_HANDLERS = {
    "DeepseekV3Attention": h_mla,
    "DeepseekV3TopkRouter": h_ds_router,
    "DeepseekV3MoE": h_ds_moe_block,
}
