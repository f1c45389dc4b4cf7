"""Attention handlers: the exact ATen sequence of each transformers attention core
(projections' head views, RoPE variants, static-cache writes, ``repeat_kv``, SDPA / eager
soft-capped / sinks tails) -> ``nhil::attention_kv`` (decode) / ``nhil::attention`` (prefill).

Sources: transformers 5.24 ``models/llama/modeling_llama.py`` (``apply_rotary_pos_emb``,
``repeat_kv``, ``LlamaAttention``), ``integrations/sdpa_attention.py``, ``cache_utils.py``
(StaticCache ``index_copy_``); variants: Qwen3/Gemma3/OLMo-2 QK-norm, Phi-3 fused QKV and
partial rotary, Gemma 2 soft-cap, GPT-2 RoPE-less MHA (``GPT2Attention``), GPT-OSS sinks and
split-half RoPE (``modeling_gpt_oss.eager_attention_forward``, ``_apply_rotary_emb``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from nhil.compiler.raise_match import ANY, Mismatch, V
from nhil.compiler.raising import Marker, _is_transparent, _val

from nhil.compiler.raise_ctx import INT64_MAX, Ctx, aten, nhil


def _proj(p, normed=False):
    """q/k/v split into heads: ``view(lin, [B,S,-1,hd]).transpose(1,2)``; when already split
    into heads and normalised per head (QK-norm of Qwen3 / Gemma3), only the transpose."""
    if normed == "post":  # Gemma3: view+transpose, then the per-head norm on [B,H,S,hd]
        return []
    if normed:
        return [(f"{p}_t", aten.transpose.int, (V(f"{p}_lin"), 1, 2), None)]
    return [
        (f"{p}_view", aten.view.default, (V(f"{p}_lin"), [V("B"), V("S"), -1, V("hd")]), None),
        (f"{p}_t", aten.transpose.int, (V(f"{p}_view"), 1, 2), None),
    ]


def _rope(p, src=None, out=None):
    """Rotate-half RoPE of ``src`` (default ``{p}_t``) into ``out`` (default ``{p}_rot``)."""
    src, out = src or f"{p}_t", out or f"{p}_rot"
    return [
        (f"{p}_mc", aten.mul.Tensor, (V(src), V("cos_u")), None),
        (f"{p}_lo", aten.slice.Tensor, (V(src), 3, 0, V("half")), None),
        (f"{p}_hi", aten.slice.Tensor, (V(src), 3, V("half"), INT64_MAX), None),
        (f"{p}_neg", aten.neg.default, (V(f"{p}_hi"),), None),
        (f"{p}_cat", aten.cat.default, ([V(f"{p}_neg"), V(f"{p}_lo")], -1), None),
        (f"{p}_ms", aten.mul.Tensor, (V(f"{p}_cat"), V("sin_u")), None),
        (out, aten.add.Tensor, (V(f"{p}_mc"), V(f"{p}_ms")), None),
    ]


def _rope_split_half(p, src=None, out=None):
    """GPT-OSS ``_apply_rotary_emb``: chunk, ``x1*cos - x2*sin``, ``x2*cos + x1*sin``, cat (half tables)."""
    src, out = src or f"{p}_t", out or f"{p}_rot"
    return [
        (f"{p}_ch", aten.chunk.default, (V(src), 2, -1), None),
        (f"{p}_x1", operator.getitem, (V(f"{p}_ch"), 0), None),
        (f"{p}_x2", operator.getitem, (V(f"{p}_ch"), 1), None),
        (f"{p}_a", aten.mul.Tensor, (V(f"{p}_x1"), V("cos_u")), None),
        (f"{p}_b", aten.mul.Tensor, (V(f"{p}_x2"), V("sin_u")), None),
        (f"{p}_first", aten.sub.Tensor, (V(f"{p}_a"), V(f"{p}_b")), None),
        (f"{p}_c", aten.mul.Tensor, (V(f"{p}_x2"), V("cos_u")), None),
        (f"{p}_d", aten.mul.Tensor, (V(f"{p}_x1"), V("sin_u")), None),
        (f"{p}_second", aten.add.Tensor, (V(f"{p}_c"), V(f"{p}_d")), None),
        (out, aten.cat.default, ([V(f"{p}_first"), V(f"{p}_second")], -1), None),
    ]


def _repeat(p, src):
    return [
        (f"{p}_u", aten.unsqueeze.default, (V(src), 2), None),
        (f"{p}_e", aten.expand.default, (V(f"{p}_u"), [V("B"), V("Hkv"), V("nrep"), V("L"), V("hd")]), None),
        (f"{p}_rr", aten.reshape.default, (V(f"{p}_e"), [V("B"), V("Hq"), V("L"), V("hd")]), None),
    ]


_COS_SIN = [("cos_u", aten.unsqueeze.default, (V("cos"), 1), None), ("sin_u", aten.unsqueeze.default, (V("sin"), 1), None)]
# fused qkv_proj (Phi-3): slices of one projection along the feature dim
_FUSED = [
    ("q_lin", aten.slice.Tensor, (V("qkv"), 2, 0, V("q_end")), None),
    ("k_lin", aten.slice.Tensor, (V("qkv"), 2, V("q_end"), V("k_end")), None),
    ("v_lin", aten.slice.Tensor, (V("qkv"), 2, V("k_end"), INT64_MAX), None),
]
# partial rotary (Phi-3 partial_rotary_factor): rotate the first rd dims, pass the rest
_PARTIAL_SPLIT = [
    ("q_r", aten.slice.Tensor, (V("q_t"), 3, 0, V("rd")), None),
    ("q_p", aten.slice.Tensor, (V("q_t"), 3, V("rd"), INT64_MAX), None),
    ("k_r", aten.slice.Tensor, (V("k_t"), 3, 0, V("rd")), None),
    ("k_p", aten.slice.Tensor, (V("k_t"), 3, V("rd"), INT64_MAX), None),
]
HEADS_VIEW = [("out", aten.view.default, (V("x"), [V("B"), V("S"), -1, V("hd")]), None)]
HEADS_VIEW_T = [("view", aten.view.default, (V("x"), [V("B"), V("S"), -1, V("hd")]), None), ("out", aten.transpose.int, (V("view"), 1, 2), None)]
_SDPA_TAIL = [
    ("o", aten.scaled_dot_product_attention.default, (V("q_rot"), V("k_rr"), V("v_rr"), V("mask")), {"scale": V("scale")}),
    ("o1", aten.reshape.default, (V("o"), [V("B"), -1, V("S"), V("hd")]), None),
    ("o2", aten.transpose.int, (V("o1"), 1, 2), None),
    ("out", aten.reshape.default, (V("o2"), [V("B"), V("S"), -1]), None),
]
# eager attention with logit soft-capping (modeling_gemma2.eager_attention_forward)
_SOFTCAP_TAIL = [
    ("kT", aten.transpose.int, (V("k_rr"), 2, 3), None),
    ("o", aten.matmul.default, (V("q_rot"), V("kT")), None),
    ("sc", aten.mul.Tensor, (V("o"), V("scale")), None),
    ("cd", aten.div.Tensor, (V("sc"), V("cap")), None),
    ("ct", aten.tanh.default, (V("cd"),), None),
    ("cm", aten.mul.Tensor, (V("ct"), V("cap")), None),
    ("am", aten.add.Tensor, (V("cm"), V("mask")), None),
    ("sm", aten.softmax.int, (V("am"), -1, torch.float32), None),
    ("dr", aten.dropout.default, (V("sm"), 0.0, False), None),
    ("pv", aten.matmul.default, (V("dr"), V("v_rr")), None),
    ("o2", aten.transpose.int, (V("pv"), 1, 2), None),
    ("out", aten.reshape.default, (V("o2"), [V("B"), V("S"), -1]), None),
]
# eager attention with sinks (modeling_gpt_oss.eager_attention_forward)
_SINKS_TAIL = [
    ("kT", aten.transpose.int, (V("k_rr"), 2, 3), None),
    ("o", aten.matmul.default, (V("q_rot"), V("kT")), None),
    ("sc", aten.mul.Tensor, (V("o"), V("scale")), None),
    ("am", aten.add.Tensor, (V("sc"), V("mask")), None),
    ("sk_r", aten.reshape.default, (V("sinks"), [1, -1, 1, 1]), None),
    ("sk_e", aten.expand.default, (V("sk_r"), [V("B"), -1, V("S"), -1]), None),
    ("comb", aten.cat.default, ([V("am"), V("sk_e")], -1), None),
    ("mx", aten.max.dim, (V("comb"), -1, True), None),
    ("mxv", operator.getitem, (V("mx"), 0), None),
    ("cs", aten.sub.Tensor, (V("comb"), V("mxv")), None),
    ("sm", aten.softmax.int, (V("cs"), -1, torch.float32), None),
    ("drop_sink", aten.slice.Tensor, (V("sm"), 3, 0, -1), None),
    ("dr", aten.dropout.default, (V("drop_sink"), 0.0, False), None),
    ("pv", aten.matmul.default, (V("dr"), V("v_rr")), None),
    ("o2", aten.transpose.int, (V("pv"), 1, 2), None),
    ("out", aten.reshape.default, (V("o2"), [V("B"), V("S"), -1]), None),
]


# fused projection split with aten.split (GPT-2 ``c_attn(x).split(split_size, dim=2)``)
_FUSED_SPLIT = [
    ("qkv_s", aten.split.Tensor, (V("qkv"), V("split_w"), 2), None),
    ("q_lin", operator.getitem, (V("qkv_s"), 0), None),
    ("k_lin", operator.getitem, (V("qkv_s"), 1), None),
    ("v_lin", operator.getitem, (V("qkv_s"), 2), None),
]


def _renamed(steps: list[tuple], names: dict[str, str]) -> list[tuple]:
    """``steps`` with pattern variables renamed (``V(old)`` -> ``V(new)``) in their arguments."""

    def sub(a):
        if isinstance(a, V):
            return V(names.get(a.name, a.name))
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    return [(name, tgt, sub(args), sub(kw)) for name, tgt, args, kw in steps]


def _norope_attention_pattern(decode: bool, fused, softcap: bool, order: str) -> list[tuple]:
    """RoPE-less MHA core (GPT-2 with learned absolute positions): per-head views in
    ``order`` (GPT2Attention: k, v, then q), static-cache writes of the unrotated k/v, no
    ``repeat_kv`` (it returns early for n_rep == 1), SDPA or the eager soft-capped tail."""
    steps = (list(_FUSED_SPLIT) if fused == "split" else list(_FUSED)) if fused else []
    proj = {p: _proj(p) for p in "qkv"}
    steps += [st for p in order for st in proj[p]]
    if decode:
        steps += [
            ("pos_ar", aten.arange.default, (V("S"),), ANY),
            ("pos", aten.add.Tensor, (V("pos_ar"), V("cp0")), None),
            ("kc", aten.index_copy_.default, (V("kcache"), 2, V("pos"), V("k_t")), None),
            ("vc", aten.index_copy_.default, (V("vcache"), 2, V("pos"), V("v_t")), None),
        ]
    kv = {"k_rr": "kc", "v_rr": "vc"} if decode else {"k_rr": "k_t", "v_rr": "v_t"}
    return steps + _renamed(_SOFTCAP_TAIL if softcap else _SDPA_TAIL, {"q_rot": "q_t", **kv})


def attention_pattern(decode: bool, qknorm: bool, fused: bool, partial: bool, softcap: bool, rope: bool = True, order: str = "qkv", sinks: bool = False, split_half: bool = False) -> list[tuple]:
    """The exact ATen sequence of one transformers attention core for the given variant.

    ``rope=False``: no rotary embedding and no ``repeat_kv`` (MHA; :func:`_norope_attention_pattern`),
    with ``fused`` False / True (slices) / ``"split"`` (aten.split) and the per-head views in ``order``.
    ``sinks``: GPT-OSS eager attention with sinks; ``split_half``: GPT-OSS rope.
    """
    if not rope:
        if qknorm or partial:
            raise ValueError("RoPE-less attention patterns have no QK-norm / partial-rotary variant")
        return _norope_attention_pattern(decode, fused, softcap, order)
    steps = list(_FUSED) if fused else []
    steps += _proj("q", qknorm) + _proj("k", qknorm) + _proj("v") + _COS_SIN
    if partial:
        steps += _PARTIAL_SPLIT
        steps += _rope("q", "q_r", "q_rr") + [("q_rot", aten.cat.default, ([V("q_rr"), V("q_p")], -1), None)]
        steps += _rope("k", "k_r", "k_rr0") + [("k_rot", aten.cat.default, ([V("k_rr0"), V("k_p")], -1), None)]
    elif split_half:
        steps += _rope_split_half("q") + _rope_split_half("k")
    else:
        steps += _rope("q") + _rope("k")
    if decode:
        steps += [
            ("pos_ar", aten.arange.default, (V("S"),), ANY),
            ("pos", aten.add.Tensor, (V("pos_ar"), V("cp0")), None),
            ("kc", aten.index_copy_.default, (V("kcache"), 2, V("pos"), V("k_rot")), None),
            ("vc", aten.index_copy_.default, (V("vcache"), 2, V("pos"), V("v_t")), None),
        ]
        steps += _repeat("k", "kc") + _repeat("v", "vc")
    else:
        steps += _repeat("k", "k_rot") + _repeat("v", "v_t")
    if sinks:
        return steps + _SINKS_TAIL
    return steps + (_SOFTCAP_TAIL if softcap else _SDPA_TAIL)


ATTENTION_PATTERNS = [
    attention_pattern(d, qn, f, pr, sc)
    for d in (True, False) for qn in (False, True, "post") for f in (False, True) for pr in (False, True) for sc in (False, True)
]
ATTENTION_PATTERNS += [
    attention_pattern(d, False, f, False, sc, rope=False, order=o)
    for d in (True, False) for f in (False, True, "split") for sc in (False, True) for o in ("kvq", "qkv")
]
ATTENTION_PATTERNS += [attention_pattern(d, False, False, False, False, sinks=True, split_half=True) for d in (True, False)]
# legacy names (Llama)
ATTENTION_DECODE = attention_pattern(True, False, False, False, False)
ATTENTION_PREFILL = attention_pattern(False, False, False, False, False)
CACHE_LEN_INC = [("inc", aten.add_.Tensor, (V("cl"), 1), None)]


def _width(n: fx.Node, hd: int) -> int:
    """Flat feature width of a projection ([B,S,F]) or of its per-head view ([B,S,H,hd])."""
    v = _val(n)
    if v.dim() == 4:
        return v.shape[2] * v.shape[3] if v.shape[3] == hd else -1
    return v.shape[-1]


def _extra(window, softcap) -> tuple:
    """Trailing optional attention args: omitted when default, so Llama graphs keep their shape."""
    if softcap is not None:
        return (window, softcap)
    return (window,) if window is not None else ()


def h_attention(ctx: Ctx) -> None:
    """Attention core (after q/k/v_proj, before o_proj) -> nhil.rope x2 + attention[_kv].

    Variants (:func:`attention_pattern`): per-head QK-norm before the head transpose,
    fused QKV projection (slices), partial rotary, eager soft-capped attention. The
    sliding window comes from the mask (a structured Marker, see :func:`h_index_arith`).
    Also accepts the StaticCache's ``cumulative_length.add_(1)`` (dropped: the decode
    wrapper overwrites it with cache_position[0] before any read, checked here).
    """
    if len(ctx.nodes) <= 2 and ctx.nodes[0].target == aten.view.default:
        # q/k split into heads before a per-head QK-norm: the graph IR keeps the flat projection
        b = ctx.match([HEADS_VIEW, HEADS_VIEW_T])
        if not isinstance(b["hd"], int) or _val(b["x"]).dim() != 3:
            raise Mismatch(ctx.nodes[0], "expected view(x, [B, S, -1, head_dim]) of a projection")
        ctx.set(b["out"], Marker("heads", (ctx.tensor(b["x"]), b["hd"])))
        return
    b = ctx.match(ATTENTION_PATTERNS + [CACHE_LEN_INC])
    if "inc" in b:
        ctx.marker(b["cl"], "cache_pos0")
        inc = b["inc"]
        readers = [u for u in ctx.outside_users(b["cl"]) if u is not inc] + [u for u in b["cl"].users if u is not inc]
        if any(ctx.r.index[u] > ctx.r.index[inc] and u.op == "call_function" and not _is_transparent(u) for u in readers):
            raise Mismatch(inc, "cumulative_length is read after it is incremented")
        return
    if "cos_u" not in b:  # attention_pattern(rope=False)
        _h_attention_norope(ctx, b)
        return
    split_half = "q_ch" in b  # GPT-OSS rope: half tables, chunk form
    if split_half:
        b["half"] = _val(b["cos"]).shape[-1]  # the table width; must be hd / 2 (checked below)
    hd, half, hq, hkv, nrep, s = b["hd"], b["half"], b["Hq"], b["Hkv"], b["nrep"], b["S"]
    rd = b.get("rd")
    widths = {}
    for p in ("q", "k"):
        if f"{p}_lin" not in b:  # QK-norm applied on the [B,H,S,hd] heads (Gemma3)
            b[f"{p}_lin"] = b[f"{p}_t"]
            t = _val(b[f"{p}_t"])
            widths[p] = t.shape[1] * t.shape[3] if t.dim() == 4 and t.shape[3] == hd and t.shape[2] == s else -1
    ok = (
        isinstance(b["scale"], float) and hq == hkv * nrep
        and (2 * half == hd if rd is None else (2 * half == rd and 0 < rd < hd))
        and widths.get("q", _width(b["q_lin"], hd)) == hq * hd and widths.get("k", _width(b["k_lin"], hd)) == hkv * hd
        and _width(b["v_lin"], hd) == hkv * hd
    )
    if "qkv" in b:
        ok = ok and b["q_end"] == hq * hd and b["k_end"] == (hq + hkv) * hd and _val(b["qkv"]).shape[-1] == (hq + 2 * hkv) * hd
    if "cap" in b:
        ok = ok and isinstance(b["cap"], float)
    if "sinks" in b:
        sv = _val(b["sinks"])
        ok = ok and isinstance(sv, torch.Tensor) and tuple(sv.shape) == (hq,) and sv.dtype == torch.float32
    if not ok:
        raise Mismatch(ctx.nodes[0], f"inconsistent attention shapes (hd={hd}, half={half}, Hq={hq}, Hkv={hkv}, n_rep={nrep}, rotary_dim={rd})")
    mask = ctx.marker(b["mask"], "causal_mask").data
    if mask[3] != ("cap" in b or "sinks" in b):
        raise Mismatch(b["o"], "eager attention (soft-capped / with sinks) needs the additive mask, SDPA the boolean one")
    cos, sin = ctx.tensor(b["cos"]), ctx.tensor(b["sin"])
    if "qkv" in b:
        qkv = ctx.tensor(b["qkv"])
        qf = ctx.emit(nhil.narrow.default, qkv, 0, hq * hd)
        kf = ctx.emit(nhil.narrow.default, qkv, hq * hd, hkv * hd)
        v = ctx.emit(nhil.narrow.default, qkv, (hq + hkv) * hd, hkv * hd)
    else:
        qf, kf, v = ctx.tensor(b["q_lin"]), ctx.tensor(b["k_lin"]), ctx.tensor(b["v_lin"])
    rope_extra = (rd,) if rd is not None else ()
    rope_kw = {"style": "split_half"} if split_half else {}
    q = ctx.emit(nhil.rope.default, qf, cos, sin, hd, *rope_extra, **rope_kw)
    k = ctx.emit(nhil.rope.default, kf, cos, sin, hd, *rope_extra, **rope_kw)
    cap = b.get("cap")
    attn_kw = {"sinks": ctx.param(b["sinks"])} if "sinks" in b else {}
    if "kc" in b:
        cp = ctx.marker(b["cp0"], "cache_pos0").data
        if mask[:2] != ("cache", b["L"]) or s != 1:
            raise Mismatch(b["o"], f"decode attention needs a causal cache mask over L={b['L']} and one token, got {mask}, S={s}")
        kc, vc = ctx.param(b["kcache"]), ctx.param(b["vcache"])
        ctx.r.cache_names += [kc.target, vc.target]
        out = ctx.emit(nhil.attention_kv.default, q, k, v, kc, vc, cp, hq, hkv, b["scale"], *_extra(mask[2], cap), **attn_kw)
    else:
        if mask[:2] != ("prefill", s):
            raise Mismatch(b["o"], f"prefill attention needs a causal mask over S={s}, got {mask}")
        out = ctx.emit(nhil.attention.default, q, k, v, hq, hkv, b["scale"], *_extra(mask[2], cap), **attn_kw)
    ctx.set(b["out"], out)


def _h_attention_norope(ctx: Ctx, b: dict) -> None:
    """Emit a matched RoPE-less MHA core (GPT-2) -> [nhil.narrow x3] + attention[_kv] with
    num_heads == num_kv_heads (no repeat_kv: n_rep is 1)."""
    hd, s = b["hd"], b["S"]
    qw = _width(b["q_lin"], hd)
    hq = qw // hd if isinstance(hd, int) and hd > 0 else -1
    ok = isinstance(b["scale"], float) and hq > 0 and qw == hq * hd and _width(b["k_lin"], hd) == qw and _width(b["v_lin"], hd) == qw
    if "q_end" in b:
        ok = ok and b["q_end"] == qw and b["k_end"] == 2 * qw and _val(b["qkv"]).shape[-1] == 3 * qw
    if "split_w" in b:
        ok = ok and b["split_w"] == qw and _val(b["qkv"]).shape[-1] == 3 * qw
    if "cap" in b:
        ok = ok and isinstance(b["cap"], float)
    if "kc" in b:
        kshape = tuple(_val(b["kcache"]).shape)
        ok = ok and len(kshape) == 4 and kshape[1] == hq and kshape[3] == hd and tuple(_val(b["vcache"]).shape) == kshape
    if not ok:
        raise Mismatch(ctx.nodes[0], f"inconsistent RoPE-less attention shapes (hd={hd}, q width {qw}, k width {_width(b['k_lin'], hd)}, v width {_width(b['v_lin'], hd)})")
    mask = ctx.marker(b["mask"], "causal_mask").data
    if mask[3] != ("cap" in b):
        raise Mismatch(b["o"], "eager soft-capped attention needs the additive mask, SDPA the boolean one")
    if "qkv" in b:
        qkv = ctx.tensor(b["qkv"])
        q, k, v = (ctx.emit(nhil.narrow.default, qkv, i * qw, qw) for i in range(3))
    else:
        q, k, v = ctx.tensor(b["q_lin"]), ctx.tensor(b["k_lin"]), ctx.tensor(b["v_lin"])
    cap = b.get("cap")
    if "kc" in b:
        cp = ctx.marker(b["cp0"], "cache_pos0").data
        if mask[:2] != ("cache", kshape[2]) or s != 1:
            raise Mismatch(b["o"], f"decode attention needs a causal cache mask over L={kshape[2]} and one token, got {mask}, S={s}")
        kc, vc = ctx.param(b["kcache"]), ctx.param(b["vcache"])
        ctx.r.cache_names += [kc.target, vc.target]
        out = ctx.emit(nhil.attention_kv.default, q, k, v, kc, vc, cp, hq, hq, b["scale"], *_extra(mask[2], cap))
    else:
        if mask[:2] != ("prefill", s):
            raise Mismatch(b["o"], f"prefill attention needs a causal mask over S={s}, got {mask}")
        out = ctx.emit(nhil.attention.default, q, k, v, hq, hq, b["scale"], *_extra(mask[2], cap))
    ctx.set(b["out"], out)
