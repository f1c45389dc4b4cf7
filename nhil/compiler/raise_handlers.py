"""Region handlers: one per module class, each an exact ATen pattern -> nhil primitives.

Sources of the patterns: transformers 5.24 ``models/llama/modeling_llama.py`` (RMSNorm,
rotary embedding, ``apply_rotary_pos_emb``, ``repeat_kv``, attention, MLP, decoder layer),
``integrations/sdpa_attention.py``, ``masking_utils.py`` (causal mask), ``cache_utils.py``
(StaticCache ``index_copy_``) and ``integrations/executorch.py`` (decode wrapper); GPT-2:
``models/gpt2/modeling_gpt2.py`` (GPT2Model positions, GPT2Attention, GPT2Block),
``pytorch_utils.Conv1D``, ``activations.NewGELUActivation``, ``torch.nn.LayerNorm``; the
op sequences are those torch 2.13's ``torch.export`` records for them.
"""

from __future__ import annotations

import math
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

    def emit(self, op, *args, **kwargs) -> fx.Node:
        """Append ``op(*args, **kwargs)`` to the new graph (kwargs: keyword-only schema attributes)."""
        n = self.r.g.call_function(op, tuple(args), kwargs or None)
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


def _is_position_ids(v) -> bool:
    """Whether graph-IR value ``v`` is the position ids :func:`h_index_arith` maps them to
    (decode: the ``cache_position`` input; prefill: the folded ``position_ids`` constant)."""
    return isinstance(v, fx.Node) and ((v.op == "placeholder" and v.target == "cache_position") or (v.op == "get_attr" and v.target == "position_ids"))


def h_embedding(ctx: Ctx) -> None:
    """nn.Embedding -> nhil.embedding; a lookup of the *position ids* (GPT-2 ``wpe``) becomes
    Marker('pos_embedding', (table, position_ids)), consumed by the Model's add
    (:func:`h_gpt2_model` -> nhil.pos_embedding)."""
    b = ctx.match([_one(aten.embedding.default, (V("table"), V("ids"))), _one(aten.embedding.default, (V("table"), V("ids"), V("pad")))])
    ids = ctx.tensor(b["ids"])
    if _is_position_ids(ids):
        if "pad" in b and b["pad"] != -1:
            raise Mismatch(ctx.nodes[0], "a position embedding with a padding index is not supported")
        ctx.set(b["out"], Marker("pos_embedding", (ctx.param(b["table"]), ids)))
        return
    ctx.set(b["out"], ctx.emit(nhil.embedding.default, ctx.param(b["table"]), ids))


CONV1D = [
    ("x2", aten.view.default, (V("x"), [-1, V("K")]), None),
    ("mm", aten.addmm.default, (V("bias"), V("x2"), V("w")), None),
    ("out", aten.view.default, (V("mm"), V("shape")), None),
]


def h_conv1d(ctx: Ctx) -> None:
    """GPT-2 ``Conv1D`` (pytorch_utils.Conv1D: ``addmm(bias, x.view(-1, K), W).view(..., N)``,
    W [K,N]) -> nhil.linear(x, Wᵀ, bias).

    Wᵀ is the transposed *view* of the [K,N] parameter (no copy; constant
    ``<state-dict name>_t``), which makes ``F.linear`` issue Conv1D's exact addmm (see
    ``primitives.linear_ref``); the raised graph stays bit-exact.
    """
    b = ctx.match([CONV1D])
    xv, wv, bv = _val(b["x"]), _val(b["w"]), _val(b["bias"])
    if not (isinstance(b["K"], int) and xv.dtype == torch.float32 and xv.shape[-1] == b["K"] and wv.dim() == 2 and wv.shape[0] == b["K"]
            and bv is not None and bv.dim() == 1 and bv.shape[0] == wv.shape[1] and list(b["shape"]) == [*xv.shape[:-1], wv.shape[1]]):
        raise Mismatch(ctx.nodes[0], f"Conv1D shapes do not fit: x {tuple(xv.shape)}, weight {tuple(wv.shape)}, output view {b['shape']}")
    w = ctx.r.canon(b["w"])
    if w.op != "placeholder" or w.name not in ctx.r.fqn:
        raise Mismatch(ctx.nodes[0], "Conv1D weight must be a parameter")
    fqn = ctx.r.fqn[w.name]
    wt = ctx.const(f"{fqn}_t", torch.nn.Parameter(ctx.r.state_tensor(fqn).t(), requires_grad=False))
    ctx.set(b["out"], ctx.emit(nhil.linear.default, ctx.tensor(b["x"]), wt, ctx.param(b["bias"])))


def h_linear(ctx: Ctx) -> None:
    """nn.Linear -> nhil.linear; inside a MoE block (input a MoE Marker) -> a shared-expert Marker."""
    b = ctx.match([_one(aten.linear.default, (V("x"), V("w"))), _one(aten.linear.default, (V("x"), V("w"), V("bias")))])
    from nhil.compiler.raise_deepseek import h_mla_kv_b

    if h_mla_kv_b(ctx, b):  # MLA kv_b_proj over the latent cache (part of nhil.mla_kv)
        return
    xv = ctx.value(b["x"])
    if isinstance(xv, Marker) and xv.kind in ("moe_tokens", "moe_shared_h"):
        _moe_shared_linear(ctx, b, xv)
        return
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


RMS_NORM_UNIT_OFFSET = RMS_NORM[:5] + [
    ("w1", aten.add.Tensor, (V("w"), 1.0), None),
    ("out", aten.mul.Tensor, (V("mul"), V("w1")), None),
]


def h_rms_norm(ctx: Ctx) -> None:
    """RMSNorm -> nhil.rms_norm (the fp32 casts are identities for fp32 models and were removed).

    Llama form ``w * norm(x)`` or Gemma form ``norm(x) * (1 + w)`` (``unit_offset``). When
    the input is a per-head view of a projection (Marker 'heads', QK-norm of Qwen3 /
    Gemma3), the primitive normalises each head of the flat projection (``head_dim``).
    """
    i, b = match_any([RMS_NORM, RMS_NORM_UNIT_OFFSET], ctx.nodes, ctx.r.canon)
    if _val(b["x"]).dtype != torch.float32 or not isinstance(b["eps"], float):
        raise Mismatch(ctx.nodes[0], "RMSNorm input must be fp32 with a float eps")
    w = ctx.param(b["w"])
    if _val(b["w"]).dim() != 1 or _val(b["w"]).shape[0] != _val(b["x"]).shape[-1]:
        raise Mismatch(ctx.nodes[0], "RMSNorm weight must be 1-D over the normalised dim")
    xv = ctx.value(b["x"])
    extra: tuple = ()
    if isinstance(xv, Marker) and xv.kind == "heads":
        x, hd = xv.data
        extra = (hd,)
    else:
        x = ctx.tensor(b["x"])
    if i == 1:
        extra = (extra[0] if extra else None, True)
    ctx.set(b["out"], ctx.emit(nhil.rms_norm.default, x, w, b["eps"], *extra))


LAYER_NORM = _one(aten.layer_norm.default, (V("x"), [V("H")], V("w"), V("bias"), V("eps"), False))


def h_layer_norm(ctx: Ctx) -> None:
    """torch.nn.LayerNorm (one ``aten.layer_norm``) -> nhil.layer_norm (GPT-2 ln_1 / ln_2 / ln_f)."""
    b = ctx.match([LAYER_NORM])
    xv = _val(b["x"])
    if xv.dtype != torch.float32 or not isinstance(b["eps"], float) or b["H"] != xv.shape[-1]:
        raise Mismatch(ctx.nodes[0], "LayerNorm must normalise the last dim of an fp32 input with a float eps")
    args = []
    for k in ("w", "bias"):
        if b[k] is None:
            args.append(None)
            continue
        t = _val(b[k])
        if t.dim() != 1 or t.shape[0] != b["H"]:
            raise Mismatch(ctx.nodes[0], f"LayerNorm {k} must be 1-D over the normalised dim")
        args.append(ctx.param(b[k]))
    ctx.set(b["out"], ctx.emit(nhil.layer_norm.default, ctx.tensor(b["x"]), *args, b["eps"]))


# transformers activations.NewGELUActivation ("gelu_new"), as torch.export records it
GELU_NEW = [
    ("half", aten.mul.Tensor, (V("x"), 0.5), None),
    ("cube", aten.pow.Tensor_Scalar, (V("x"), 3.0), None),
    ("kc", aten.mul.Tensor, (V("cube"), 0.044715), None),
    ("inner", aten.add.Tensor, (V("x"), V("kc")), None),
    ("scaled", aten.mul.Tensor, (V("inner"), V("c")), None),
    ("t", aten.tanh.default, (V("scaled"),), None),
    ("t1", aten.add.Tensor, (V("t"), 1.0), None),
    ("out", aten.mul.Tensor, (V("half"), V("t1")), None),
]


def h_gelu_new(ctx: Ctx) -> None:
    """NewGELUActivation (spelled-out tanh GELU) -> nhil.gelu(x, 'gelu_new'); the constant
    must be exactly ``math.sqrt(2.0 / math.pi)``."""
    b = ctx.match([GELU_NEW])
    if b["c"] != math.sqrt(2.0 / math.pi) or _val(b["x"]).dtype != torch.float32:
        raise Mismatch(ctx.nodes[4], f"gelu_new needs an fp32 input and the constant sqrt(2/pi), got {b['c']}")
    ctx.set(b["out"], ctx.emit(nhil.gelu.default, ctx.tensor(b["x"]), "gelu_new"))


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


# GPT-OSS: half tables, ``emb = freqs`` (no cat) (modeling_gpt_oss.GptOssRotaryEmbedding.forward)
ROPE_COS_SIN_HALF = ROPE_COS_SIN[:3] + [
    ("cos", aten.cos.default, (V("freqs"),), None),
    ("cos_s", aten.mul.Tensor, (V("cos"), V("scale")), None),
    ("sin", aten.sin.default, (V("freqs"),), None),
    ("sin_s", aten.mul.Tensor, (V("sin"), V("scale")), None),
]


def h_rotary(ctx: Ctx) -> None:
    """RotaryEmbedding -> nhil.rope_cos_sin + 2 getitem: Llama form (``cat(freqs, freqs)``) or
    GPT-OSS half tables (``half=True``). The inv_freq buffer carries the scaling type
    (default / linear / llama3 / YaRN) and ``attention_scaling`` YaRN's mscale."""
    i, b = match_any([ROPE_COS_SIN, ROPE_COS_SIN_HALF], ctx.nodes, ctx.r.canon)
    if not isinstance(b["scale"], float):
        raise Mismatch(ctx.nodes[0], "attention_scaling must be a float constant")
    cs = ctx.emit(nhil.rope_cos_sin.default, ctx.tensor(b["pos"]), ctx.param(b["inv"]), b["scale"], **({"half": True} if i == 1 else {}))
    cos = ctx.r.g.call_function(operator.getitem, (cs, 0))
    sin = ctx.r.g.call_function(operator.getitem, (cs, 1))
    for n in (cos, sin):
        n.meta["nn_module_stack_path"] = ctx.path
        ctx.created.append(n)
    ctx.set(b["cos_s"], cos)
    ctx.set(b["sin_s"], sin)


def h_act(ctx: Ctx) -> None:
    """SiLUActivation / GELUTanh -> Marker('silu' / 'gelu_tanh') consumed by the MLP's gating multiply."""
    i, b = match_any([_one(aten.silu.default, (V("g"),)), _one(aten.gelu.default, (V("g"),), kwargs={"approximate": "tanh"})], ctx.nodes, ctx.r.canon)
    gv = ctx.value(b["g"])
    if isinstance(gv, Marker) and gv.kind == "moe_gate":  # the experts' act_fn inside a MoE block
        if i != 0:
            raise Mismatch(ctx.nodes[0], "MoE experts: only the SiLU (SwiGLU) activation is supported")
        ctx.set(b["out"], Marker("moe_act", gv.data))
        return
    if isinstance(gv, Marker) and gv.kind == "moe_lin":  # the shared expert's act_fn (Qwen2-MoE)
        if i != 0:
            raise Mismatch(ctx.nodes[0], "MoE shared expert: only the SiLU (SwiGLU) activation is supported")
        ctx.set(b["out"], Marker("moe_shared_act", gv.data))
        return
    ctx.set(b["out"], Marker(("silu", "gelu_tanh")[i], ctx.tensor(b["g"])))


MLP_CHUNK = [
    ("chunk", aten.chunk.default, (V("x"), 2, -1), None),
    ("gate", operator.getitem, (V("chunk"), 0), None),
    ("up", operator.getitem, (V("chunk"), 1), None),
]


def h_mlp(ctx: Ctx) -> None:
    """MLP body ``act_fn(gate) * up`` (either operand order) -> nhil.silu_mul / nhil.gelu_mul
    (projections are Linear regions). Also the split of a fused ``gate_up_proj``
    (Phi-3: ``chunk(2, -1)``) -> two nhil.narrow."""
    if ctx.nodes[0].target == aten.chunk.default:
        b = ctx.match([MLP_CHUNK])
        x = ctx.tensor(b["x"])
        n = _val(b["x"]).shape[-1]
        if n % 2:
            raise Mismatch(ctx.nodes[0], "fused gate_up width must be even")
        ctx.set(b["gate"], ctx.emit(nhil.narrow.default, x, 0, n // 2))
        ctx.set(b["up"], ctx.emit(nhil.narrow.default, x, n // 2, n // 2))
        return
    b = ctx.match([_one(aten.mul.Tensor, (V("s"), V("u")))])
    sv, uv = ctx.value(b["s"]), ctx.value(b["u"])
    if isinstance(sv, Marker) and sv.kind == "moe_shared_act":  # shared expert of a MoE block
        if not (isinstance(uv, Marker) and uv.kind == "moe_lin" and uv.data["tok"] is sv.data["tok"]):
            raise Mismatch(ctx.nodes[0], f"MoE shared expert: {b['u'].name} is not the up projection of the same block's tokens")
        if uv.data["shape"] != sv.data["shape"]:
            raise Mismatch(ctx.nodes[0], f"MoE shared expert: gate {sv.data['shape']} and up {uv.data['shape']} projections differ in shape")
        ctx.set(b["out"], Marker("moe_shared_h", {"tok": sv.data["tok"], "gate": sv.data["w"], "up": uv.data["w"], "shape": sv.data["shape"]}))
        return
    if not isinstance(sv, Marker) and isinstance(uv, Marker):
        sv, uv, b["u"] = uv, sv, b["s"]
    if not isinstance(sv, Marker) or sv.kind not in ("silu", "gelu_tanh"):
        raise Mismatch(ctx.nodes[0], f"input {b['s'].name} is not a silu / gelu_tanh activation")
    up = ctx.tensor(b["u"])
    if sv.kind == "silu":
        ctx.set(b["out"], ctx.emit(nhil.silu_mul.default, sv.data, up))
    else:
        ctx.set(b["out"], ctx.emit(nhil.gelu_mul.default, sv.data, up, "tanh"))


def h_dropout(ctx: Ctx) -> None:
    """Dropout in eval mode (``train=False``) is the identity."""
    b = ctx.match([_one(aten.dropout.default, (V("x"), V("p"), False))])
    ctx.set(b["out"], ctx.value(b["x"]))


SCALED_EMBEDDING = [
    ("emb", aten.embedding.default, (V("table"), V("ids"), V("pad")), None),
    ("out", aten.mul.Tensor, (V("emb"), V("scale")), None),
]


def h_scaled_embedding(ctx: Ctx) -> None:
    """Gemma's ``embedding(ids) * embed_scale`` (embed_scale: a 0-d fp32 buffer) -> nhil.embedding(scale=)."""
    b = ctx.match([SCALED_EMBEDDING])
    sc = b["scale"]
    if not (isinstance(sc, fx.Node) and sc.op == "placeholder" and sc.name in ctx.r.fqn):
        raise Mismatch(ctx.nodes[-1], "embedding scale must be a buffer")
    t = ctx.r.state_tensor(ctx.r.fqn[sc.name])
    if t.dim() != 0 or t.dtype != torch.float32:
        raise Mismatch(ctx.nodes[-1], "embedding scale must be a 0-d fp32 buffer")
    ctx.set(b["out"], ctx.emit(nhil.embedding.default, ctx.param(b["table"]), ctx.tensor(b["ids"]), float(t)))


FINAL_SOFTCAP = [
    ("d", aten.div.Tensor, (V("x"), V("cap")), None),
    ("t", aten.tanh.default, (V("d"),), None),
    ("out", aten.mul.Tensor, (V("t"), V("cap")), None),
]


def h_causal_lm(ctx: Ctx) -> None:
    """ForCausalLM tail: final-logit soft-capping ``tanh(logits / c) * c`` (Gemma 2) -> nhil.softcap."""
    b = ctx.match([FINAL_SOFTCAP])
    if not isinstance(b["cap"], float):
        raise Mismatch(ctx.nodes[0], "soft-cap must be a float constant")
    ctx.set(b["out"], ctx.emit(nhil.softcap.default, ctx.tensor(b["x"]), b["cap"]))


def h_residual(ctx: Ctx) -> None:
    """Decoder-layer residual adds ``residual + h`` -> nhil.add, one per add.

    One add (pre-norm: Llama, ...) or a chain of them in one region (post-norm OLMo-2,
    where the second residual add consumes the first directly).
    """
    for n in ctx.nodes:
        if n.target != aten.add.Tensor or len(n.args) != 2 or n.kwargs:
            raise Mismatch(n, f"expected a residual aten.add.Tensor, found {n.target}")
        a, c = n.args
        va, vb = _val(a), _val(c)
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and va.dtype == vb.dtype == torch.float32):
            raise Mismatch(n, "residual add needs two fp32 tensors of the same shape")
        ctx.set(n, ctx.emit(nhil.add.default, ctx.tensor(a), ctx.tensor(c)))


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


def h_gpt2_model(ctx: Ctx) -> None:
    """GPT2Model glue (modeling_gpt2.GPT2Model.forward): the shape-identity views
    ``input_ids.view(-1, S)`` and ``hidden.view(output_shape)`` (-> the input value), the
    learned-position add ``inputs_embeds + wpe(position_ids)`` (-> nhil.pos_embedding; the
    ``wpe`` lookup is a Marker from :func:`h_embedding`), and otherwise the position / mask
    index arithmetic (:func:`h_index_arith`)."""
    n = ctx.nodes[0]
    if len(ctx.nodes) == 1 and n.target == aten.view.default:
        b = ctx.match([_one(aten.view.default, (V("x"), V("shape")))])
        if tuple(_val(b["x"]).shape) != tuple(_val(b["out"]).shape):
            raise Mismatch(n, f"view {b['shape']} changes the shape {tuple(_val(b['x']).shape)}")
        ctx.set(b["out"], ctx.value(b["x"]))
        return
    if len(ctx.nodes) == 1 and n.target == aten.add.Tensor and isinstance(n.args[1], fx.Node) and isinstance(ctx.value(n.args[1]), Marker):
        b = ctx.match([_one(aten.add.Tensor, (V("x"), V("pe")))])
        table, pos = ctx.marker(b["pe"], "pos_embedding").data
        xv, pv = _val(b["x"]), _val(b["pe"])
        if not (xv.dtype == pv.dtype == torch.float32 and xv.dim() == 3 and tuple(xv.shape) == tuple(pv.shape)):
            raise Mismatch(n, f"position-embedding add needs two fp32 [B,S,H] tensors, got {tuple(xv.shape)} + {tuple(pv.shape)}")
        ctx.set(b["out"], ctx.emit(nhil.pos_embedding.default, ctx.tensor(b["x"]), table, pos))
        return
    h_index_arith(ctx)


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


# ---------------------------------------------------------------- MoE (batched_mm experts)
# transformers 5.24, experts_implementation="batched_mm": modeling_mixtral.MixtralSparseMoeBlock /
# MixtralTopKRouter, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock / Qwen3MoeTopKRouter,
# integrations/moe.batched_mm_experts_forward (+ _default_apply_gate). The block spans five
# regions (block view, router, experts part 1, act_fn, experts part 2, block reshape); they
# pass Markers along and the last experts piece emits one nhil.moe.


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
    _moe_marker(ctx, b["u"], "moe_up", st)
    _moe_marker(ctx, b["idf"], "moe_idflat", st)
    _moe_marker(ctx, b["wf"], "moe_wflat", st)
    dn, shape = _val(b["dn"]), st["tok"]["shape"]
    gu_shape = tuple(ctx.r.attrs[st["gu"].target].shape)
    t = shape[0] * shape[1]
    if dn.dim() != 3 or tuple(dn.shape) != (st["E"], shape[-1], gu_shape[1] // 2) or b["k"] != st["k"] or b["H"] != shape[-1] or b["T"] != t:
        raise Mismatch(ctx.nodes[0], f"down_proj {tuple(dn.shape)} / combine view [{b['T']}, {b['k']}, {b['H']}] do not fit the MoE block")
    ctx.set(b["out"], Marker("moe_out", dict(st, dn=ctx.param(b["dn"]), shape=shape)))


HANDLERS: dict[str, Callable[[Ctx], None]] = {
    "TorchExportableModuleWithStaticCache": h_static_cache_wrapper,
    "TorchExportableModuleWithHybridCache": h_static_cache_wrapper,
    "Dropout": h_dropout,
    "GELUTanh": h_act,
    "Embedding": h_embedding,
    "Linear": h_linear,
    "LlamaRMSNorm": h_rms_norm,
    "LlamaRotaryEmbedding": h_rotary,
    "SiLUActivation": h_act,
    "LlamaMLP": h_mlp,
    "LlamaDecoderLayer": h_residual,
    "LlamaModel": h_index_arith,
    "LlamaAttention": h_attention,
    "ScaledWordEmbedding": h_scaled_embedding,
    "ForCausalLM": h_causal_lm,
    "LayerNorm": h_layer_norm,
    "Conv1D": h_conv1d,
    "NewGELUActivation": h_gelu_new,
    "GPT2Model": h_gpt2_model,
    "GPT2Block": h_residual,
    "MixtralSparseMoeBlock": h_moe_block,
    "MixtralTopKRouter": h_moe_router,
    "MixtralExperts": h_moe_experts,
    "GptOssMLP": h_moe_block,  # a MoE block under the MLP role name
}

# Module classes of other families whose code is the Llama code under another name are
# dispatched by the role suffix of their class name (``MistralRMSNorm`` -> ``RMSNorm``).
# This is safe because every handler still matches the region op by op and the raised
# graph is checked bit-exact; a class whose code differs simply fails to match.
ROLE_SUFFIXES: list[tuple[str, str]] = [
    ("ScaledWordEmbedding", "ScaledWordEmbedding"),
    ("ForCausalLM", "ForCausalLM"),
    ("RMSNorm", "LlamaRMSNorm"),
    ("RotaryEmbedding", "LlamaRotaryEmbedding"),
    ("Attention", "LlamaAttention"),
    ("MLP", "LlamaMLP"),
    ("DecoderLayer", "LlamaDecoderLayer"),
    ("Model", "LlamaModel"),
    ("SparseMoeBlock", "MixtralSparseMoeBlock"),
    ("TopKRouter", "MixtralTopKRouter"),
    ("Experts", "MixtralExperts"),
]


_FAMILIES_LOADED = False


def _load_families() -> None:
    """Register the handlers of families kept in their own modules (exact class names)."""
    global _FAMILIES_LOADED
    from nhil.compiler.raise_deepseek import DEEPSEEK_HANDLERS

    HANDLERS.update(DEEPSEEK_HANDLERS)
    _FAMILIES_LOADED = True


def handler_for(cls: str, path: str = "") -> Callable[[Ctx], None] | None:
    """Handler of a module class: exact class name first, then by role suffix."""
    if not _FAMILIES_LOADED:
        _load_families()
    if cls in HANDLERS:
        return HANDLERS[cls]
    for suffix, base in ROLE_SUFFIXES:
        if cls.endswith(suffix):
            return HANDLERS[base]
    return None
