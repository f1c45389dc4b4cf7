"""Region handlers: one per module class, each an exact ATen pattern -> nhil primitives.

Sources of the patterns: transformers 5.24 ``models/llama/modeling_llama.py`` (RMSNorm,
rotary embedding, ``apply_rotary_pos_emb``, ``repeat_kv``, attention, MLP, decoder layer),
``integrations/sdpa_attention.py``, ``masking_utils.py`` (causal mask), ``cache_utils.py``
(StaticCache ``index_copy_``) and ``integrations/executorch.py`` (decode wrapper); the
op sequences are those torch 2.13's ``torch.export`` records for them.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from nhil.compiler.raise_match import ANY, Mismatch, V, match_any
from nhil.compiler.raising import Marker, Raiser, Region, _is_transparent, _val

aten = torch.ops.aten
nhil = torch.ops.nhil
INT64_MAX = 9223372036854775807


class Ctx:
    """What a handler sees: the region, value lookup, emission into the new graph."""

    def __init__(self, raiser: Raiser, region: Region):
        self.r, self.region = raiser, region
        self.nodes, self.path = region.nodes, region.path
        self.members = set(region.nodes)
        self.created: list[fx.Node] = []
        self.set_keys: list[fx.Node] = []

    def match(self, patterns: list[list[tuple]]) -> dict:
        """Bindings of the first pattern matching the whole region exactly (raises Mismatch)."""
        return match_any(patterns, self.nodes, self.r.canon)[1]

    def value(self, old: fx.Node):
        """New-graph value (node or Marker) of an old node; parameters become get_attr."""
        old = self.r.canon(old)
        if old in self.r.env:
            return self.r.env[old]
        if old.op == "placeholder" and old.name in self.r.fqn:
            return self.param(old)
        raise Mismatch(self.nodes[0], f"input {old.name} comes from a region that was not raised")

    def param(self, old: fx.Node) -> fx.Node:
        """get_attr node (original state-dict name) for a parameter/buffer placeholder."""
        old = self.r.canon(old)
        if old.op != "placeholder" or old.name not in self.r.fqn:
            raise Mismatch(self.nodes[0], f"{old.name} should be a parameter or buffer")
        fqn = self.r.fqn[old.name]
        return self.r.get_attr(fqn, self.r.state_tensor(fqn))

    def const(self, name: str, tensor: torch.Tensor) -> fx.Node:
        """get_attr node for a constant folded out of the exported graph."""
        return self.r.get_attr(name, tensor)

    def marker(self, old: fx.Node, kind: str) -> Marker:
        v = self.value(old)
        if not isinstance(v, Marker) or v.kind != kind:
            raise Mismatch(self.nodes[0], f"input {old.name} is not a {kind}")
        return v

    def tensor(self, old: fx.Node) -> fx.Node:
        v = self.value(old)
        if not isinstance(v, fx.Node):
            raise Mismatch(self.nodes[0], f"input {old.name} is not a tensor of the graph IR")
        return v

    def emit(self, op, *args) -> fx.Node:
        n = self.r.g.call_function(op, tuple(args))
        n.meta["nn_module_stack_path"] = self.path
        n.meta["stack_trace"] = self.nodes[-1].meta.get("stack_trace")
        self.created.append(n)
        return n

    def set(self, old: fx.Node, val) -> None:
        self.r.env[old] = val
        self.set_keys.append(old)

    # -- bookkeeping ----------------------------------------------------------
    def outside_users(self, n: fx.Node) -> list[fx.Node]:
        out, stack = [], list(n.users)
        while stack:
            u = stack.pop()
            if u in self.members:
                continue
            if _is_transparent(u):
                stack.extend(u.users)
            elif u.op != "call_function" or u in self.r.live:
                out.append(u)
        return out

    def check_outputs_mapped(self) -> None:
        for n in self.nodes:
            if n not in self.r.env and self.outside_users(n):
                raise Mismatch(n, f"{n.name} is used outside its region but the pattern does not produce it")

    def undo(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.r.g.erase_node(n)
        for k in self.set_keys:
            self.r.env.pop(k, None)
        self.created, self.set_keys = [], []

    def fallback_aten(self) -> None:
        """Non-strict mode: copy the region's ATen nodes verbatim (when all inputs are real nodes)."""
        local: dict[fx.Node, fx.Node] = {}

        def look(a: fx.Node) -> fx.Node:
            a = self.r.canon(a)
            if a in local:
                return local[a]
            v = self.value(a)
            if not isinstance(v, fx.Node):
                raise Mismatch(a, "implicit value")
            return v

        try:
            for n in self.nodes:
                new = self.r.g.call_function(n.target, fx.node.map_arg(n.args, look), fx.node.map_arg(n.kwargs, look))
                new.meta["nn_module_stack_path"] = self.path
                new.meta["stack_trace"] = n.meta.get("stack_trace")
                self.created.append(new)
                local[n] = new
        except Mismatch:
            self.undo()
            return
        for n, new in local.items():
            self.set(n, new)


# ------------------------------------------------------------------ handlers


def _one(target, args, name="out", kwargs=None):
    return [(name, target, args, kwargs)]


def h_static_cache_wrapper(ctx: Ctx) -> None:
    """``cumulative_length.copy_(cache_position[0])`` per layer -> Marker('cache_pos0')."""
    b = ctx.match([[("sel", aten.select.int, (V("cp"), 0, 0), None), ("copy", aten.copy_.default, (V("buf"), V("sel")), None)]])
    cp = b["cp"]
    if cp.op != "placeholder" or cp.name != "cache_position" or b["buf"].name not in ctx.r.fqn:
        raise Mismatch(ctx.nodes[0], "expected cumulative_length.copy_(cache_position[0])")
    ctx.set(b["copy"], Marker("cache_pos0", ctx.value(cp)))


def h_embedding(ctx: Ctx) -> None:
    b = ctx.match([_one(aten.embedding.default, (V("table"), V("ids"))), _one(aten.embedding.default, (V("table"), V("ids"), V("pad")))])
    ctx.set(b["out"], ctx.emit(nhil.embedding.default, ctx.param(b["table"]), ctx.tensor(b["ids"])))


def h_linear(ctx: Ctx) -> None:
    b = ctx.match([_one(aten.linear.default, (V("x"), V("w"))), _one(aten.linear.default, (V("x"), V("w"), V("bias")))])
    bias = ctx.param(b["bias"]) if "bias" in b else None
    ctx.set(b["out"], ctx.emit(nhil.linear.default, ctx.tensor(b["x"]), ctx.param(b["w"]), bias))


RMS_NORM = [
    ("pow", aten.pow.Tensor_Scalar, (V("x"), 2), None),
    ("mean", aten.mean.dim, (V("pow"), [-1], True), None),
    ("add", aten.add.Tensor, (V("mean"), V("eps")), None),
    ("rsqrt", aten.rsqrt.default, (V("add"),), None),
    ("mul", aten.mul.Tensor, (V("x"), V("rsqrt")), None),
    ("out", aten.mul.Tensor, (V("w"), V("mul")), None),
]


def h_rms_norm(ctx: Ctx) -> None:
    """LlamaRMSNorm (the fp32 casts are identities for fp32 models and were removed)."""
    b = ctx.match([RMS_NORM])
    if _val(b["x"]).dtype != torch.float32 or not isinstance(b["eps"], float):
        raise Mismatch(ctx.nodes[0], "RMSNorm input must be fp32 with a float eps")
    ctx.set(b["out"], ctx.emit(nhil.rms_norm.default, ctx.tensor(b["x"]), ctx.param(b["w"]), b["eps"]))


ROPE_COS_SIN = [
    ("pos_u", aten.unsqueeze.default, (V("pos"), 2), None),
    ("pos_f", aten.to.dtype, (V("pos_u"), torch.float32), None),
    ("freqs", aten.mul.Tensor, (V("pos_f"), V("inv")), None),
    ("emb", aten.cat.default, ([V("freqs"), V("freqs")], -1), None),
    ("cos", aten.cos.default, (V("emb"),), None),
    ("cos_s", aten.mul.Tensor, (V("cos"), V("scale")), None),
    ("sin", aten.sin.default, (V("emb"),), None),
    ("sin_s", aten.mul.Tensor, (V("sin"), V("scale")), None),
]


def h_rotary(ctx: Ctx) -> None:
    """LlamaRotaryEmbedding (default rope) -> nhil.rope_cos_sin + 2 getitem."""
    b = ctx.match([ROPE_COS_SIN])
    if not isinstance(b["scale"], float):
        raise Mismatch(ctx.nodes[0], "attention_scaling must be a float constant")
    cs = ctx.emit(nhil.rope_cos_sin.default, ctx.tensor(b["pos"]), ctx.param(b["inv"]), b["scale"])
    cos = ctx.r.g.call_function(operator.getitem, (cs, 0))
    sin = ctx.r.g.call_function(operator.getitem, (cs, 1))
    for n in (cos, sin):
        n.meta["nn_module_stack_path"] = ctx.path
        ctx.created.append(n)
    ctx.set(b["cos_s"], cos)
    ctx.set(b["sin_s"], sin)


def h_act(ctx: Ctx) -> None:
    """SiLUActivation -> Marker('silu') consumed by the MLP's gating multiply."""
    b = ctx.match([_one(aten.silu.default, (V("g"),))])
    ctx.set(b["out"], Marker("silu", ctx.tensor(b["g"])))


def h_mlp(ctx: Ctx) -> None:
    """LlamaMLP body ``act_fn(gate) * up`` -> nhil.silu_mul (projections are Linear regions)."""
    b = ctx.match([_one(aten.mul.Tensor, (V("s"), V("u")))])
    gate = ctx.marker(b["s"], "silu").data
    ctx.set(b["out"], ctx.emit(nhil.silu_mul.default, gate, ctx.tensor(b["u"])))


def h_residual(ctx: Ctx) -> None:
    """LlamaDecoderLayer residual ``residual + h`` -> nhil.add."""
    b = ctx.match([_one(aten.add.Tensor, (V("a"), V("b")))])
    va, vb = _val(b["a"]), _val(b["b"])
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and va.dtype == vb.dtype == torch.float32):
        raise Mismatch(ctx.nodes[0], "residual add needs two fp32 tensors of the same shape")
    ctx.set(b["out"], ctx.emit(nhil.add.default, ctx.tensor(b["a"]), ctx.tensor(b["b"])))


INDEX_OPS = {
    aten.arange.default, aten.arange.start, aten.add.Tensor, aten.sub.Tensor, aten.unsqueeze.default,
    aten.slice.Tensor, aten.diff.default, aten.ne.Scalar, aten.cumsum.default, aten.expand.default,
    aten.new_ones.default, aten.index.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor,
    aten.gt.Tensor, aten.eq.Tensor, aten.__and__.Tensor, aten.__or__.Tensor, aten.view.default, aten.select.int,
}
# bool -> additive float mask (masking_utils.eager_mask: where(mask, 0, finfo.min))
FLOAT_MASK_OPS = {aten.zeros.default, aten.where.ScalarOther, aten.where.self, aten.scalar_tensor.default}


def _window_of(t: torch.Tensor, p: int) -> int | None:
    """Sliding window W implied by the last query row of mask ``t`` at cache position p (None: plain causal)."""
    q_last = p + t.shape[2] - 1
    row = t[0, 0, -1]
    vis = int(row.sum()) if row.dtype == torch.bool else int((row == 0).sum())
    return vis if vis < min(q_last + 1, t.shape[3]) else None


def h_index_arith(ctx: Ctx) -> None:
    """Position ids and causal / sliding-window masks built by the Model / masking_utils.

    The region must be pure integer/bool arithmetic over constants and cache_position[0]
    (plus the bool -> additive-float conversion of eager attention); it is evaluated
    exhaustively (every cache position when it depends on one) and each output must equal
    a causal mask, optionally restricted to a sliding window W (``j > i - W``; W read off
    the mask and then checked at every position), bool or additive (0 / finfo.min),
    -> Marker('causal_mask', (kind, kv_len, window, additive)); or the position ids
    (decode: the ``cache_position`` input, S == 1; prefill: a folded constant
    ``position_ids``).
    """
    for n in ctx.nodes:
        v = _val(n)
        if not isinstance(v, torch.Tensor) or v.dtype.is_complex:
            raise Mismatch(n, "not integer/bool index arithmetic of a position or causal-mask pattern")
        if n.target in FLOAT_MASK_OPS:
            continue
        if n.target not in INDEX_OPS or v.dtype.is_floating_point:
            raise Mismatch(n, "not integer/bool index arithmetic of a position or causal-mask pattern")
    externals = []
    for n in ctx.nodes:
        for a in n.all_input_nodes:
            a = ctx.r.canon(a)
            if a not in ctx.members and a not in externals:
                externals.append(a)
    markers = [ctx.marker(a, "cache_pos0") for a in externals]
    outputs = [n for n in ctx.nodes if ctx.outside_users(n)]

    def evaluate(p: int) -> dict:
        vals = {a: torch.full(_val(a).shape, p, dtype=_val(a).dtype) for a in externals}
        look = lambda a: vals[ctx.r.canon(a)]  # noqa: E731
        for n in ctx.nodes:
            vals[n] = n.target(*fx.node.map_arg(n.args, look), **fx.node.map_arg(n.kwargs, look))
        return vals

    positions = range(ctx.r.cache_len) if externals else [0]
    kinds: dict[fx.Node, str] = {}
    windows: dict[fx.Node, int | None] = {}
    if externals:  # read each mask's window at the last cache position, check it everywhere
        last = evaluate(ctx.r.cache_len - 1)
        for o in outputs:
            t = last[o]
            if t.dim() == 4 and t.shape[1] == 1 and (t.dtype == torch.bool or t.dtype.is_floating_point):
                windows[o] = _window_of(t, ctx.r.cache_len - 1)
    for p in positions:
        vals = evaluate(p)
        for o in outputs:
            t = vals[o]
            if t.dim() == 4 and t.shape[1] == 1 and (t.dtype == torch.bool or t.dtype == torch.float32):
                s, k = t.shape[2], t.shape[3]
                if o not in windows:
                    windows[o] = _window_of(t, p)
                from nhil.compiler.primitives import visible_mask

                want = visible_mask(p + torch.arange(s), k, windows[o])[None, None].expand(t.shape)
                if t.dtype == torch.float32:
                    want = torch.where(want, torch.zeros((), dtype=t.dtype), torch.finfo(t.dtype).min)
                ok = torch.equal(t, want) and (externals or k == s)
                kinds[o] = "mask"
            elif t.dtype == torch.int64 and t.dim() == 2 and t.shape[0] == 1:
                ok = torch.equal(t, p + torch.arange(t.shape[1])[None]) and (not externals or t.shape[1] == 1)
                kinds[o] = "pos"
            else:
                ok = False
            if not ok:
                raise Mismatch(o, f"{o.name} is not a causal / sliding-window mask or position ids (checked at cache position {p})")
    vals = evaluate(0)
    for o in outputs:
        t = vals[o]
        if kinds[o] == "mask":
            ctx.set(o, Marker("causal_mask", ("cache" if externals else "prefill", t.shape[3], windows[o], t.dtype.is_floating_point)))
        elif externals:
            ctx.set(o, markers[0].data)  # the cache_position input, [S] == [1]
        else:
            ctx.set(o, ctx.const("position_ids", t.clone()))


def _proj(p):
    return [
        (f"{p}_view", aten.view.default, (V(f"{p}_lin"), [V("B"), V("S"), -1, V("hd")]), None),
        (f"{p}_t", aten.transpose.int, (V(f"{p}_view"), 1, 2), None),
    ]


def _rope(p):
    return [
        (f"{p}_mc", aten.mul.Tensor, (V(f"{p}_t"), V("cos_u")), None),
        (f"{p}_lo", aten.slice.Tensor, (V(f"{p}_t"), 3, 0, V("half")), None),
        (f"{p}_hi", aten.slice.Tensor, (V(f"{p}_t"), 3, V("half"), INT64_MAX), None),
        (f"{p}_neg", aten.neg.default, (V(f"{p}_hi"),), None),
        (f"{p}_cat", aten.cat.default, ([V(f"{p}_neg"), V(f"{p}_lo")], -1), None),
        (f"{p}_ms", aten.mul.Tensor, (V(f"{p}_cat"), V("sin_u")), None),
        (f"{p}_rot", aten.add.Tensor, (V(f"{p}_mc"), V(f"{p}_ms")), None),
    ]


def _repeat(p, src):
    return [
        (f"{p}_u", aten.unsqueeze.default, (V(src), 2), None),
        (f"{p}_e", aten.expand.default, (V(f"{p}_u"), [V("B"), V("Hkv"), V("nrep"), V("L"), V("hd")]), None),
        (f"{p}_r", aten.reshape.default, (V(f"{p}_e"), [V("B"), V("Hq"), V("L"), V("hd")]), None),
    ]


_HEAD = (
    _proj("q") + _proj("k") + _proj("v")
    + [("cos_u", aten.unsqueeze.default, (V("cos"), 1), None), ("sin_u", aten.unsqueeze.default, (V("sin"), 1), None)]
    + _rope("q") + _rope("k")
)
_TAIL = [
    ("o", aten.scaled_dot_product_attention.default, (V("q_rot"), V("k_r"), V("v_r"), V("mask")), {"scale": V("scale")}),
    ("o1", aten.reshape.default, (V("o"), [V("B"), -1, V("S"), V("hd")]), None),
    ("o2", aten.transpose.int, (V("o1"), 1, 2), None),
    ("out", aten.reshape.default, (V("o2"), [V("B"), V("S"), -1]), None),
]
ATTENTION_DECODE = _HEAD + [
    ("pos_ar", aten.arange.default, (V("S"),), ANY),
    ("pos", aten.add.Tensor, (V("pos_ar"), V("cp0")), None),
    ("kc", aten.index_copy_.default, (V("kcache"), 2, V("pos"), V("k_rot")), None),
    ("vc", aten.index_copy_.default, (V("vcache"), 2, V("pos"), V("v_t")), None),
] + _repeat("k", "kc") + _repeat("v", "vc") + _TAIL
ATTENTION_PREFILL = _HEAD + _repeat("k", "k_rot") + _repeat("v", "v_t") + _TAIL
CACHE_LEN_INC = [("inc", aten.add_.Tensor, (V("cl"), 1), None)]


def _extra(window, softcap) -> tuple:
    """Trailing optional attention args: omitted when default, so Llama graphs keep their shape."""
    if softcap is not None:
        return (window, softcap)
    return (window,) if window is not None else ()


def h_attention(ctx: Ctx) -> None:
    """LlamaAttention core (after q/k/v_proj, before o_proj) -> nhil.rope x2 + attention[_kv].

    Also accepts the StaticCache's ``cumulative_length.add_(1)`` (dropped: the decode
    wrapper overwrites it with cache_position[0] before any read, checked here).
    """
    b = ctx.match([ATTENTION_DECODE, ATTENTION_PREFILL, CACHE_LEN_INC])
    if "inc" in b:
        ctx.marker(b["cl"], "cache_pos0")
        inc = b["inc"]
        readers = [u for u in ctx.outside_users(b["cl"]) if u is not inc] + [u for u in b["cl"].users if u is not inc]
        if any(ctx.r.index[u] > ctx.r.index[inc] and u.op == "call_function" and not _is_transparent(u) for u in readers):
            raise Mismatch(inc, "cumulative_length is read after it is incremented")
        return
    hd, half, hq, hkv, nrep, s = b["hd"], b["half"], b["Hq"], b["Hkv"], b["nrep"], b["S"]
    ok = (
        isinstance(b["scale"], float) and 2 * half == hd and hq == hkv * nrep
        and _val(b["q_lin"]).shape[-1] == hq * hd and _val(b["k_lin"]).shape[-1] == hkv * hd
        and _val(b["v_lin"]).shape[-1] == hkv * hd
    )
    if not ok:
        raise Mismatch(ctx.nodes[0], f"inconsistent attention shapes (hd={hd}, half={half}, Hq={hq}, Hkv={hkv}, n_rep={nrep})")
    mask = ctx.marker(b["mask"], "causal_mask").data
    cos, sin = ctx.tensor(b["cos"]), ctx.tensor(b["sin"])
    q = ctx.emit(nhil.rope.default, ctx.tensor(b["q_lin"]), cos, sin, hd)
    k = ctx.emit(nhil.rope.default, ctx.tensor(b["k_lin"]), cos, sin, hd)
    v = ctx.tensor(b["v_lin"])
    if "kc" in b:
        cp = ctx.marker(b["cp0"], "cache_pos0").data
        if mask[:2] != ("cache", b["L"]) or mask[3] or s != 1:
            raise Mismatch(b["o"], f"decode attention needs a causal cache mask over L={b['L']} and one token, got {mask}, S={s}")
        kc, vc = ctx.param(b["kcache"]), ctx.param(b["vcache"])
        ctx.r.cache_names += [kc.target, vc.target]
        out = ctx.emit(nhil.attention_kv.default, q, k, v, kc, vc, cp, hq, hkv, b["scale"], *_extra(mask[2], None))
    else:
        if mask[:2] != ("prefill", s) or mask[3]:
            raise Mismatch(b["o"], f"prefill attention needs a causal mask over S={s}, got {mask}")
        out = ctx.emit(nhil.attention.default, q, k, v, hq, hkv, b["scale"], *_extra(mask[2], None))
    ctx.set(b["out"], out)


HANDLERS: dict[str, Callable[[Ctx], None]] = {
    "TorchExportableModuleWithStaticCache": h_static_cache_wrapper,
    "Embedding": h_embedding,
    "Linear": h_linear,
    "LlamaRMSNorm": h_rms_norm,
    "LlamaRotaryEmbedding": h_rotary,
    "SiLUActivation": h_act,
    "LlamaMLP": h_mlp,
    "LlamaDecoderLayer": h_residual,
    "LlamaModel": h_index_arith,
    "LlamaAttention": h_attention,
}

# Module classes of other families whose code is the Llama code under another name are
# dispatched by the role suffix of their class name (``MistralRMSNorm`` -> ``RMSNorm``).
# This is safe because every handler still matches the region op by op and the raised
# graph is checked bit-exact; a class whose code differs simply fails to match.
ROLE_SUFFIXES: list[tuple[str, str]] = [
    ("RMSNorm", "LlamaRMSNorm"),
    ("RotaryEmbedding", "LlamaRotaryEmbedding"),
    ("Attention", "LlamaAttention"),
    ("MLP", "LlamaMLP"),
    ("DecoderLayer", "LlamaDecoderLayer"),
    ("Model", "LlamaModel"),
]


def handler_for(cls: str, path: str = "") -> Callable[[Ctx], None] | None:
    """Handler of a module class: exact class name first, then by role suffix."""
    if cls in HANDLERS:
        return HANDLERS[cls]
    for suffix, base in ROLE_SUFFIXES:
        if cls.endswith(suffix):
            return HANDLERS[base]
    return None
