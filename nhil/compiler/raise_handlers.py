"""Region handlers for the non-attention pieces, each an exact ATen pattern -> nhil primitives:
embeddings, linears, norms, activations, MLPs, residuals, logit soft-cap (positions and masks:
``raise_positions``; the pattern table and dispatch: ``raise_patterns``).

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

import torch
import torch.fx as fx

from nhil.compiler.raise_match import Mismatch, V, match_any
from nhil.compiler.raising import Marker, _val

from nhil.compiler.raise_ctx import Ctx, _one, aten, nhil
from nhil.compiler.raise_deepseek import h_mla_kv_b
from nhil.compiler.raise_moe import _moe_shared_linear
from nhil.compiler.raise_positions import _is_position_ids



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
