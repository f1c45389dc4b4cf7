"""MoE handlers: sparse MoE blocks (router, batched_mm experts, block glue, shared expert)
-> one ``nhil::moe`` carrying its routing rule.

transformers 5.24, experts_implementation="batched_mm": modeling_mixtral.MixtralSparseMoeBlock /
MixtralTopKRouter, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock / Qwen3MoeTopKRouter,
integrations/moe.batched_mm_experts_forward (+ _default_apply_gate). The block spans five
regions (block view, router, experts part 1, act_fn, experts part 2, block reshape); they
pass Markers along and the last experts piece emits one nhil.moe.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from nhil.compiler.raise_match import Mismatch, V, match_any
from nhil.compiler.raising import Marker, _val

from nhil.compiler.raise_ctx import INT64_MAX, Ctx, aten, nhil




def _moe_router_pattern(softmax_dtype: bool, norm: bool) -> list[tuple]:
    steps = [
        ("flat", aten.reshape.default, (V("tok"), [-1, V("H")]), None),
        ("logits", aten.linear.default, (V("flat"), V("rw")), None),
        ("probs", aten.softmax.int, (V("logits"), -1, torch.float32) if softmax_dtype else (V("logits"), -1), None),
        ("topk", aten.topk.default, (V("probs"), V("k")), None),
        ("w", operator.getitem, (V("topk"), 0), None),
        ("ids", operator.getitem, (V("topk"), 1), None),
    ]
    if norm:
        steps += [("wsum", aten.sum.dim_IntList, (V("w"), [-1], True), None), ("wn", aten.div_.Tensor, (V("w"), V("wsum")), None)]
    return steps


MOE_ROUTER_PATTERNS = [_moe_router_pattern(d, n) for n in (True, False) for d in (False, True)]
# GPT-OSS (modeling_gpt_oss.GptOssTopKRouter): biased linear on the block tokens -> topk -> softmax(top-k values)
MOE_ROUTER_TOPK_SOFTMAX = [
    ("logits", aten.linear.default, (V("tok"), V("rw"), V("rb")), None),
    ("topk", aten.topk.default, (V("logits"), V("k")), None),
    ("w", operator.getitem, (V("topk"), 0), None),
    ("ids", operator.getitem, (V("topk"), 1), None),
    ("wn", aten.softmax.int, (V("w"), 1, torch.float32), None),
]
MOE_EXPERTS_IN = [
    ("rep", aten.repeat_interleave.self_int, (V("tok"), V("k"), 0), None),
    ("wf", aten.reshape.default, (V("wts"), [-1]), None),
    ("idf", aten.reshape.default, (V("ids"), [-1]), None),
    ("gsel", aten.index.Tensor, (V("gu"), [V("idf")]), None),
    ("xu", aten.unsqueeze.default, (V("rep"), -1), None),
    ("gbmm", aten.bmm.default, (V("gsel"), V("xu")), None),
    ("gsq", aten.squeeze.dim, (V("gbmm"), -1), None),
    ("chunk", aten.chunk.default, (V("gsq"), 2, -1), None),
    ("gate", operator.getitem, (V("chunk"), 0), None),
    ("up", operator.getitem, (V("chunk"), 1), None),
]
MOE_EXPERTS_OUT = [
    ("m", aten.mul.Tensor, (V("a"), V("u")), None),
    ("dsel", aten.index.Tensor, (V("dn"), [V("idf")]), None),
    ("mu", aten.unsqueeze.default, (V("m"), -1), None),
    ("dbmm", aten.bmm.default, (V("dsel"), V("mu")), None),
    ("dsq", aten.squeeze.dim, (V("dbmm"), -1), None),
    ("wu", aten.unsqueeze.default, (V("wf"), -1), None),
    ("wy", aten.mul.Tensor, (V("dsq"), V("wu")), None),
    ("v", aten.view.default, (V("wy"), [V("T"), V("k"), V("H")]), None),
    ("out", aten.sum.dim_IntList, (V("v"), [1]), None),
]


# GPT-OSS experts (batched_mm, is_transposed=True, has_bias=True, GptOssExperts._apply_gate): one region
MOE_EXPERTS_GPT_OSS = [
    ("rep", aten.repeat_interleave.self_int, (V("tok"), V("k"), 0), None),
    ("wf", aten.reshape.default, (V("wts"), [-1]), None),
    ("idf", aten.reshape.default, (V("ids"), [-1]), None),
    ("gsel", aten.index.Tensor, (V("gu"), [V("idf")]), None),
    ("gbsel", aten.index.Tensor, (V("gub"), [V("idf")]), None),
    ("xu", aten.unsqueeze.default, (V("rep"), 1), None),
    ("gbmm", aten.bmm.default, (V("xu"), V("gsel")), None),
    ("gsq", aten.squeeze.dim, (V("gbmm"), 1), None),
    ("gadd", aten.add_.Tensor, (V("gsq"), V("gbsel")), None),
    ("gate", aten.slice.Tensor, (V("gadd"), 1, 0, INT64_MAX, 2), None),
    ("up", aten.slice.Tensor, (V("gadd"), 1, 1, INT64_MAX, 2), None),
    ("gc", aten.clamp.default, (V("gate"), None, V("limit")), None),
    ("uc", aten.clamp.default, (V("up"), V("neg_limit"), V("limit")), None),
    ("ga", aten.mul.Tensor, (V("gc"), V("alpha")), None),
    ("sg", aten.sigmoid.default, (V("ga"),), None),
    ("glu", aten.mul.Tensor, (V("gc"), V("sg")), None),
    ("u1", aten.add.Tensor, (V("uc"), 1), None),
    ("m", aten.mul.Tensor, (V("u1"), V("glu")), None),
    ("dsel", aten.index.Tensor, (V("dn"), [V("idf")]), None),
    ("dbsel", aten.index.Tensor, (V("dnb"), [V("idf")]), None),
    ("mu", aten.unsqueeze.default, (V("m"), 1), None),
    ("dbmm", aten.bmm.default, (V("mu"), V("dsel")), None),
    ("dsq", aten.squeeze.dim, (V("dbmm"), 1), None),
    ("dadd", aten.add_.Tensor, (V("dsq"), V("dbsel")), None),
    ("wu", aten.unsqueeze.default, (V("wf"), -1), None),
    ("wy", aten.mul.Tensor, (V("dadd"), V("wu")), None),
    ("v", aten.view.default, (V("wy"), [V("T"), V("k"), V("H")]), None),
    ("out", aten.sum.dim_IntList, (V("v"), [1]), None),
]


def _moe_marker(ctx: Ctx, old: fx.Node, kind: str, state: dict | None = None) -> dict:
    m = ctx.marker(old, kind)
    if state is not None and m.data is not state:
        raise Mismatch(ctx.nodes[0], f"input {old.name} belongs to another MoE block")
    return m.data


MOE_TAIL = [("out", aten.reshape.default, (V("y"), V("shape")), None)]
# Qwen2-MoE: ``expert_output + sigmoid(shared_expert_gate(x)) * shared_expert(x)``, then reshape
MOE_TAIL_SHARED_GATED = [
    ("sig", aten.sigmoid.default, (V("gl"),), None),
    ("sm", aten.mul.Tensor, (V("sig"), V("sh")), None),
    ("sum", aten.add.Tensor, (V("y"), V("sm")), None),
    ("out", aten.reshape.default, (V("sum"), V("shape")), None),
]


def _moe_shared_linear(ctx: Ctx, b: dict, xv: Marker) -> None:
    """A Linear inside a MoE block: on the block tokens -> Marker('moe_lin') (shared expert
    gate_proj / up_proj, or the shared_expert_gate); on the shared expert's gated product
    -> Marker('moe_shared') (its down_proj). Bias-free only (Qwen2-MoE)."""
    if "bias" in b:
        raise Mismatch(ctx.nodes[0], "MoE shared expert: biased projections are not supported")
    w = _val(b["w"])
    if xv.kind == "moe_tokens":
        if w.dim() != 2 or w.shape[1] != xv.data["shape"][-1]:
            raise Mismatch(ctx.nodes[0], f"MoE shared-expert projection weight {tuple(w.shape)} does not take H={xv.data['shape'][-1]}")
        ctx.set(b["out"], Marker("moe_lin", {"tok": xv.data, "w": ctx.param(b["w"]), "shape": tuple(w.shape)}))
        return
    h = xv.data["tok"]["shape"][-1]
    if tuple(w.shape) != (h, xv.data["shape"][0]):
        raise Mismatch(ctx.nodes[0], f"MoE shared expert down_proj {tuple(w.shape)} is not [H={h}, I={xv.data['shape'][0]}]")
    ctx.set(b["out"], Marker("moe_shared", dict(xv.data, down=ctx.param(b["w"]))))


def emit_moe(ctx: Ctx, st: dict, **shared) -> fx.Node:
    """The ``nhil.moe`` node of a raised MoE block from its experts Marker data: router,
    experts, routing rule (``score``, ``norm``; ``extra`` = act + DeepSeek routing
    attributes from ``raise_deepseek.h_ds_router``, else ``act``) and keyword attributes
    (``kw``: GPT-OSS; ``shared``: Qwen2-MoE's shared expert)."""
    pos = st.get("extra") or (st.get("act", "silu"),)
    return ctx.emit(nhil.moe.default, st["tok"]["x"], st["rw"], st["gu"], st["dn"], st["E"], st["k"], st["score"], st["norm"], *pos, **shared, **st.get("kw", {}))


def h_moe_block(ctx: Ctx) -> None:
    """SparseMoeBlock glue: ``hidden.view(-1, H)`` -> Marker('moe_tokens'); the block tail
    -> the nhil.moe node: ``reshape(routed, [B, S, H])`` (Mixtral, Qwen3-MoE) or
    ``reshape(routed + sigmoid(gate(x)) * shared(x), [B, S, H])`` (Qwen2-MoE's
    sigmoid-gated shared expert, :data:`MOE_TAIL_SHARED_GATED`)."""
    n = ctx.nodes[0]
    head = len(ctx.nodes) == 1 and (n.target == aten.view.default or (n.target == aten.reshape.default and n.args[1] == [-1, _val(n.args[0]).shape[-1]] and _val(n.args[0]).dim() == 3))
    if head:  # view (SparseMoeBlock) or reshape (GptOssMLP)
        b = ctx.match([[("out", aten.view.default, (V("x"), [-1, V("H")]), None)], [("out", aten.reshape.default, (V("x"), [-1, V("H")]), None)]])
        xv = _val(b["x"])
        if xv.dim() != 3 or b["H"] != xv.shape[-1] or xv.dtype != torch.float32:
            raise Mismatch(n, "MoE block input must be an fp32 [B, S, H] tensor viewed as [-1, H]")
        ctx.set(b["out"], Marker("moe_tokens", {"x": ctx.tensor(b["x"]), "shape": tuple(xv.shape)}))
        return
    i, b = match_any([MOE_TAIL, MOE_TAIL_SHARED_GATED], ctx.nodes, ctx.r.canon)
    st = ctx.marker(b["y"], "moe_out").data
    if list(b["shape"]) != list(st["shape"]):
        raise Mismatch(ctx.nodes[-1], f"MoE block output reshape {b['shape']} is not the input shape {st['shape']}")
    shared: dict = {}
    if i == 1:
        sh = ctx.marker(b["sh"], "moe_shared").data
        gl = ctx.marker(b["gl"], "moe_lin").data
        h = st["tok"]["shape"][-1]
        if sh["tok"] is not st["tok"] or gl["tok"] is not st["tok"] or gl["shape"] != (1, h):
            raise Mismatch(n, f"MoE shared expert / its gate {gl['shape']} do not belong to this block (H={h})")
        shared = {"shared_gate_proj": sh["gate"], "shared_up_proj": sh["up"], "shared_down_proj": sh["down"], "shared_expert_gate": gl["w"]}
    node = emit_moe(ctx, st, **shared)
    ctx.set(b["out"], node)


def h_moe_router(ctx: Ctx) -> None:
    """TopKRouter ``linear -> softmax(fp32) -> topk -> [w /= w.sum()]`` -> Markers for the
    routing weights and expert ids (consumed by the experts pattern)."""
    i, b = match_any(MOE_ROUTER_PATTERNS + [MOE_ROUTER_TOPK_SOFTMAX], ctx.nodes, ctx.r.canon)
    tok = ctx.marker(b["tok"], "moe_tokens").data
    rw = _val(b["rw"])
    topk_softmax = i == len(MOE_ROUTER_PATTERNS)
    if topk_softmax:
        b["H"] = tok["shape"][-1]
    if not (isinstance(b["k"], int) and isinstance(b["H"], int) and b["H"] == tok["shape"][-1] and rw.dim() == 2 and rw.shape[1] == b["H"] and 0 < b["k"] <= rw.shape[0]):
        raise Mismatch(ctx.nodes[0], f"inconsistent MoE router shapes (router weight {tuple(rw.shape)}, k={b['k']}, H={b['H']})")
    st = {"tok": tok, "rw": ctx.param(b["rw"]), "E": int(rw.shape[0]), "k": int(b["k"]), "norm": "wn" in b and not topk_softmax, "score": "softmax", "kw": {}}
    if topk_softmax:
        if tuple(_val(b["rb"]).shape) != (rw.shape[0],):
            raise Mismatch(ctx.nodes[0], f"MoE router bias {tuple(_val(b['rb']).shape)} is not [E={rw.shape[0]}]")
        st["kw"] = {"router_bias": ctx.param(b["rb"]), "softmax_after_topk": True}
        st["norm"] = True  # the schema default: norm_topk_prob does not apply after a top-k softmax
    ctx.set(b["wn"] if "wn" in b else b["w"], Marker("moe_weights", st))
    ctx.set(b["ids"], Marker("moe_ids", st))


def _moe_experts_gpt_oss(ctx: Ctx) -> None:
    """GPT-OSS experts in one region (:data:`MOE_EXPERTS_GPT_OSS`) -> Marker('moe_out') with the
    transposed interleaved biased weights and the clamped-SwiGLU constants."""
    b = ctx.match([MOE_EXPERTS_GPT_OSS])
    st = _moe_marker(ctx, b["wts"], "moe_weights")
    _moe_marker(ctx, b["ids"], "moe_ids", st)
    if ctx.marker(b["tok"], "moe_tokens").data is not st["tok"] or b["k"] != st["k"] or not st["kw"].get("softmax_after_topk"):
        raise Mismatch(ctx.nodes[0], "GPT-OSS experts do not consume a top-k-softmax router's tokens / top-k")
    e, shape = st["E"], st["tok"]["shape"]
    h = shape[-1]
    gu, gub, dn, dnb = (_val(b[n]) for n in ("gu", "gub", "dn", "dnb"))
    i2 = gu.shape[-1] if gu.dim() == 3 else -1
    ok = (tuple(gu.shape) == (e, h, i2) and i2 % 2 == 0 and tuple(gub.shape) == (e, i2) and tuple(dn.shape) == (e, i2 // 2, h)
          and tuple(dnb.shape) == (e, h) and b["H"] == h and b["T"] == shape[0] * shape[1])
    lim, alpha = b["limit"], b["alpha"]
    if not ok or not (isinstance(lim, float) and isinstance(alpha, float) and b["neg_limit"] == -lim and lim > 0):
        raise Mismatch(ctx.nodes[0], f"GPT-OSS experts: gate_up {tuple(gu.shape)}, down {tuple(dn.shape)}, limit {lim}, alpha {alpha} do not fit the block (H={h}, E={e})")
    kw = dict(st["kw"], gate_up_bias=ctx.param(b["gub"]), down_bias=ctx.param(b["dnb"]), experts_layout="transposed_interleaved",
              swiglu_alpha=alpha, swiglu_limit=lim)
    ctx.set(b["out"], Marker("moe_out", dict(st, gu=ctx.param(b["gu"]), dn=ctx.param(b["dn"]), shape=shape, kw=kw, act="swiglu_clamp")))


def h_moe_experts(ctx: Ctx) -> None:
    """batched_mm experts: the gather + bmm of gate_up (-> Markers for gate / up), then
    ``silu(gate) * up`` -> bmm of down -> × routing weight -> sum over the k slots ->
    one nhil.moe carrying the routing rule and the 3-D expert weights."""
    if len(ctx.nodes) == len(MOE_EXPERTS_GPT_OSS):
        _moe_experts_gpt_oss(ctx)
        return
    if ctx.nodes[0].target == aten.repeat_interleave.self_int:
        b = ctx.match([MOE_EXPERTS_IN])
        if not isinstance(ctx.value(b["wts"]), Marker):  # routing ran as host ATen: experts on explicit ids / weights
            _prerouted_experts_in(ctx, b)
            return
        st = _moe_marker(ctx, b["wts"], "moe_weights")
        _moe_marker(ctx, b["ids"], "moe_ids", st)
        if ctx.marker(b["tok"], "moe_tokens").data is not st["tok"] or b["k"] != st["k"]:
            raise Mismatch(ctx.nodes[0], "MoE experts do not consume the router's tokens / top-k")
        gu = _val(b["gu"])
        h = st["tok"]["shape"][-1]
        if gu.dim() != 3 or gu.shape[0] != st["E"] or gu.shape[2] != h or gu.shape[1] % 2:
            raise Mismatch(ctx.nodes[0], f"gate_up_proj {tuple(gu.shape)} is not [E={st['E']}, 2I, H={h}]")
        st = dict(st, gu=ctx.param(b["gu"]))
        for name, kind in (("wf", "moe_wflat"), ("idf", "moe_idflat"), ("gate", "moe_gate"), ("up", "moe_up")):
            ctx.set(b[name], Marker(kind, st))
        return
    b = ctx.match([MOE_EXPERTS_OUT])
    st = _moe_marker(ctx, b["a"], "moe_act")
    if st.get("prerouted"):
        _prerouted_experts_out(ctx, b, st)
        return
    _moe_marker(ctx, b["u"], "moe_up", st)
    _moe_marker(ctx, b["idf"], "moe_idflat", st)
    _moe_marker(ctx, b["wf"], "moe_wflat", st)
    dn, shape = _val(b["dn"]), st["tok"]["shape"]
    gu_shape = tuple(ctx.r.attrs[st["gu"].target].shape)
    t = shape[0] * shape[1]
    if dn.dim() != 3 or tuple(dn.shape) != (st["E"], shape[-1], gu_shape[1] // 2) or b["k"] != st["k"] or b["H"] != shape[-1] or b["T"] != t:
        raise Mismatch(ctx.nodes[0], f"down_proj {tuple(dn.shape)} / combine view [{b['T']}, {b['k']}, {b['H']}] do not fit the MoE block")
    ctx.set(b["out"], Marker("moe_out", dict(st, dn=ctx.param(b["dn"]), shape=shape)))


def _prerouted_experts_in(ctx: Ctx, b: dict) -> None:
    """Experts part 1 when the routing is host ATen (no router pattern raised it): the ids and
    weights are graph-IR tensors; the state carries them to part 2 (``nhil::moe_experts``)."""
    from nhil.compiler.host_aten import materialise

    gu, tv, iv, wv = _val(b["gu"]), _val(b["tok"]), _val(b["ids"]), _val(b["wts"])
    k = b["k"]
    if not (isinstance(k, int) and tv.dim() == 2 and gu.dim() == 3 and gu.shape[2] == tv.shape[1] and gu.shape[1] % 2 == 0
            and tuple(iv.shape) == (tv.shape[0], k) == tuple(wv.shape) and iv.dtype == torch.int64 and wv.dtype == torch.float32):
        raise Mismatch(ctx.nodes[0], f"MoE experts: tokens {tuple(tv.shape)}, ids {tuple(iv.shape)}, weights {tuple(wv.shape)}, gate_up {tuple(gu.shape)} do not fit")
    st = {"prerouted": True, "x": materialise(ctx, b["tok"]), "ids": materialise(ctx, b["ids"]), "wts": materialise(ctx, b["wts"]),
          "gu": ctx.param(b["gu"]), "E": int(gu.shape[0]), "k": k, "T": int(tv.shape[0]), "H": int(tv.shape[1])}
    for name, kind in (("wf", "moe_wflat"), ("idf", "moe_idflat"), ("gate", "moe_gate"), ("up", "moe_up")):
        ctx.set(b[name], Marker(kind, st))


def _prerouted_experts_out(ctx: Ctx, b: dict, st: dict) -> None:
    """Experts part 2 of :func:`_prerouted_experts_in` -> one ``nhil::moe_experts`` ([T, H], a tensor)."""
    _moe_marker(ctx, b["u"], "moe_up", st)
    _moe_marker(ctx, b["idf"], "moe_idflat", st)
    _moe_marker(ctx, b["wf"], "moe_wflat", st)
    dn = _val(b["dn"])
    i2 = ctx.r.attrs[st["gu"].target].shape[1]
    if tuple(dn.shape) != (st["E"], st["H"], i2 // 2) or b["k"] != st["k"] or b["H"] != st["H"] or b["T"] != st["T"]:
        raise Mismatch(ctx.nodes[0], f"down_proj {tuple(dn.shape)} / combine view [{b['T']}, {b['k']}, {b['H']}] do not fit the MoE experts")
    ctx.set(b["out"], ctx.emit(nhil.moe_experts.default, st["x"], st["ids"], st["wts"], st["gu"], ctx.param(b["dn"]), st["E"], st["k"]))
