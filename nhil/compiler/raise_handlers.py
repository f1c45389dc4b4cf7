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

from nhil.compiler.raise_match import Mismatch, V, match_any
from nhil.compiler.raising import Marker, _val

from nhil.compiler.raise_attention import h_attention
from nhil.compiler.raise_ctx import Ctx, _one, aten, nhil
from nhil.compiler.raise_deepseek import DEEPSEEK_HANDLERS, h_mla_kv_b
from nhil.compiler.raise_moe import _moe_shared_linear, h_moe_block, h_moe_experts, h_moe_router



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
    if not (isinstance(ids, fx.Node) and ids.op == "placeholder"):
        # a lookup by computed ids (BART-family learned positions at cache_position + offset): host ATen
        raise Mismatch(ctx.nodes[0], "embedding lookup by computed ids is not the token embedding")
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
        shape = _val(b["x"]).shape
        if shape.numel() != shape[-1]:  # a host-side [1, H, 1, hd] value (HunYuan's QK-norm after RoPE): per row
            extra = (int(shape[-1]),)
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
    ids = ctx.tensor(b["ids"])
    if ids.op != "placeholder":  # ids computed in the graph (Gemma 3's image-token substitution): host ATen
        raise Mismatch(ctx.nodes[0], "embedding lookup by computed ids is not the token embedding")
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
    aten.to.device, aten.to.dtype,  # a padding mask moved / cast (bool or int: floats are refused below)
}
# bool -> additive float mask (masking_utils.eager_mask: where(mask, 0, finfo.min))
FLOAT_MASK_OPS = {aten.zeros.default, aten.where.ScalarOther, aten.where.self, aten.scalar_tensor.default}


def _window_of(t: torch.Tensor, p: int) -> int | None:
    """Sliding window W implied by the last query row of mask ``t`` at cache position p (None: plain causal)."""
    q_last = p + t.shape[2] - 1
    row = t[0, 0, -1]
    vis = int(row.sum()) if row.dtype == torch.bool else int((row == 0).sum())
    return vis if vis < min(q_last + 1, t.shape[3]) else None


CONSTANT_FILLS = {aten.ones.default, aten.zeros.default, aten.full.default}


def _constant_of(a: fx.Node) -> torch.Tensor | None:
    """The value of ``a`` when it is a fill of constants only (the all-ones padding mask the
    export hands BioGPT-like models, ``nhil.compiler.export._positions_from_cache``), else None."""
    if a.op != "call_function" or a.target not in CONSTANT_FILLS or a.all_input_nodes:
        return None
    return a.target(*a.args, **a.kwargs)


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
    consts = {a: _constant_of(a) for a in externals}
    consts = {a: t for a, t in consts.items() if t is not None}
    externals = [a for a in externals if a not in consts]
    markers = [ctx.marker(a, "cache_pos0") for a in externals]
    outputs = [n for n in ctx.nodes if ctx.outside_users(n)]

    def evaluate(p: int) -> dict:
        vals = {a: torch.full(_val(a).shape, p, dtype=_val(a).dtype) for a in externals} | consts
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


def _recurrent() -> dict:
    """The recurrent-layer patterns (``raise_recurrent``), each offered only to programs that keep a
    recurrent state (``conv_state_<i>`` / ``ssm_state_<i>`` buffers): their pieces are short and
    would otherwise claim look-alike regions of other models (a MoE block's head reshape)."""
    from nhil.compiler.raise_delta import DELTA_HANDLERS  # gated DeltaNet (linear attention)
    from nhil.compiler.raise_recurrent import RECURRENT_HANDLERS  # state-space / short-conv layers

    def guarded(h):
        def run(ctx: Ctx) -> None:
            if not any(str(f).startswith(("conv_state_", "ssm_state_")) for f in ctx.r.fqn.values()):
                raise Mismatch(ctx.nodes[0], "no recurrent state in this program")
            h(ctx)

        return run

    return {k: guarded(h) for k, h in {**RECURRENT_HANDLERS, **DELTA_HANDLERS}.items()}


RECURRENT = _recurrent()


# Raising by pattern: every region is offered to the patterns whose anchor ops it contains, in
# this order (the most specific first); the first that matches the whole region exactly wins.
# Module class names play no part: they only name regions in reports. A region no pattern
# raises becomes an attention core by its anchors (raise_anchor) or, when it holds no
# PIM-bound work, host ATen (host_aten): the exported ops themselves.
_INDEX = INDEX_OPS | FLOAT_MASK_OPS
PATTERNS: list[tuple[str, Callable[[Ctx], None], frozenset | None]] = [
    ("static-cache position", h_static_cache_wrapper, frozenset({aten.copy_.default})),
    ("dropout (eval)", h_dropout, frozenset({aten.dropout.default})),
    ("embedding", h_embedding, frozenset({aten.embedding.default})),
    ("scaled embedding", h_scaled_embedding, frozenset({aten.embedding.default})),
    ("linear", h_linear, frozenset({aten.linear.default})),
    ("Conv1D linear", h_conv1d, frozenset({aten.addmm.default})),
    ("RMSNorm", h_rms_norm, frozenset({aten.rsqrt.default})),
    ("LayerNorm", h_layer_norm, frozenset({aten.layer_norm.default})),
    ("RoPE tables", h_rotary, frozenset({aten.cos.default})),
    ("gated activation", h_act, frozenset({aten.silu.default, aten.gelu.default})),
    ("gelu_new", h_gelu_new, frozenset({aten.tanh.default})),
    ("logit soft-cap", h_causal_lm, frozenset({aten.tanh.default})),
    ("gated MLP", h_mlp, frozenset({aten.mul.Tensor, aten.chunk.default})),
    ("positions / causal mask", h_gpt2_model, frozenset(_INDEX)),
    ("residual add", h_residual, frozenset({aten.add.Tensor})),
    ("attention", h_attention, frozenset({aten.scaled_dot_product_attention.default, aten.index_copy_.default, aten.matmul.default, aten.view.default, aten.add_.Tensor})),
    ("MLA attention", DEEPSEEK_HANDLERS["DeepseekV3Attention"], None),
    # recurrent layers (raise_recurrent: shared conv / state-update / delta-rule / gated-norm pieces)
    ("Mamba-2 mixer", RECURRENT["Mamba2Mixer"], None),  # its pieces (convex regions) need not hold the state write
    ("gated short conv", RECURRENT["Lfm2ShortConv"], None),  # its pieces (convex regions) need not hold the state write
    ("gated DeltaNet", RECURRENT["OlmoHybridGatedDeltaNet"], None),  # its pieces (convex regions) need not hold the state write
    ("gated RMSNorm", RECURRENT["MambaRMSNormGated"], frozenset({aten.rsqrt.default})),
    ("RMSNorm before gate", RECURRENT["OlmoHybridRMSNormGated"], frozenset({aten.rsqrt.default})),
    ("inline SwiGLU", RECURRENT["Lfm2MLP"], frozenset({aten.silu.default})),
    ("DeepSeek router", DEEPSEEK_HANDLERS["DeepseekV3TopkRouter"], None),
    ("DeepSeek MoE block", DEEPSEEK_HANDLERS["DeepseekV3MoE"], None),  # needs a raised DeepSeek router: before the generic block
    ("MoE router", h_moe_router, None),
    ("MoE experts", h_moe_experts, None),
    ("MoE block", h_moe_block, None),
]




def candidates(ops: set) -> list[tuple[str, Callable[[Ctx], None]]]:
    """The patterns to try on a region whose ATen ops are ``ops`` (see ``PATTERNS``)."""
    return [(name, h) for name, h, anchor in PATTERNS if anchor is None or anchor & ops]


def raise_region(ctx: Ctx) -> str:
    """Raise one region: the first pattern that matches it exactly, else the attention anchors,
    else host ATen. Returns the name of what raised it (``"host ATen"`` for the fallback).

    Raises:
        Mismatch: nothing raised it; the reason names the PIM-bound op that kept it off the
            host, or else the first pattern's mismatch.
    """
    from nhil.compiler.host_aten import h_host_aten
    from nhil.compiler.raise_anchor import h_attention_anchor, h_attention_eager

    ops = {n.target for n in ctx.nodes}
    first: Mismatch | None = None
    tried: set[str] = set()
    tries = candidates(ops)
    if aten.scaled_dot_product_attention.default in ops:
        tries.append(("attention (anchors)", h_attention_anchor))
    elif aten.index_copy_.default in ops and (aten.matmul.default in ops or aten.bmm.default in ops):
        tries.append(("attention (anchors)", h_attention_eager))
    tries.append(("host ATen", h_host_aten))
    for name, h in tries:
        try:
            try:
                h(ctx)
            except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
                # a pattern written for other regions met arguments of another kind (a scalar
                # where it expects a tensor, ...): it does not fit this region
                raise Mismatch(ctx.nodes[0], f"the {name} pattern does not fit: {type(e).__name__}: {e}") from None
            ctx.check_outputs_mapped()
            return name
        except Mismatch as m:
            ctx.undo()
            # report what says most: the attention anchors' reason when they were tried (the region is an
            # attention), else host ATen's refusal of PIM-bound work, else the first pattern's mismatch
            if first is None or name == "attention (anchors)" or (name == "host ATen" and "anchors" not in tried and ("PIM-bound" in m.reason or "writes into" in m.reason)):
                first = m
            tried.add("anchors" if name == "attention (anchors)" else name)
    raise first if first is not None else Mismatch(ctx.nodes[0], "no pattern")
