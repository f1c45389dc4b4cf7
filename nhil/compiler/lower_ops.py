"""Lowerings of the dense primitives: linear (GEMV on PIM) and the host kernels.

Each function is one entry of the lowering table (``nhil.compiler.lowering``). The host
kernels (``nhil.runtime.host_kernels``) call the same ``nhil::*`` reference kernels the
graph IR runs, so host numerics equal the graph IR's; the host-op attributes written
here are what those kernels read.
"""

from __future__ import annotations

import re

from nhil.compiler.lower_attention import lower_bias
from nhil.compiler.lowering import LowerCtx, lowering, numel


@lowering("nhil::embedding")
def _embedding(cx: LowerCtx, node) -> None:
    table, ids = node.args[:2]
    cx.image(table)
    out = cx.out(node)
    attrs = {"scale": float(node.args[2])} if len(node.args) > 2 and node.args[2] is not None else {}
    cx.b.host("embedding", [cx.const_name(table), cx.arg(ids)], [out], **attrs)
    # the token embedding is the first lookup (Gemma 3n / 4 look up per-layer inputs in a second table after it)
    cx.outputs.setdefault("act.model.embed_tokens", out)


@lowering("nhil::rms_norm")
def _rms_norm(cx: LowerCtx, node) -> None:
    x, w, eps = node.args[:3]
    cx.image(w)
    out = cx.out(node)
    attrs = dict(zip(("head_dim", "unit_offset"), node.args[3:]))  # QK-norm per head, Gemma (1+w)
    cx.b.host("rms_norm", [cx.arg(x), cx.const_name(w)], [out], eps=float(eps), **attrs)


@lowering("nhil::linear")
def _linear(cx: LowerCtx, node) -> None:
    """GEMV on PIM (``ProgramBuilder.gemv``); the weight's format comes from the quant plan; a bias is a host add."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    b, wn = cx.b, cx.const_name(w)
    qt = cx.quant.weight(wn, cx.const(w)) if cx.quant is not None else None
    p = b.place_matrix(wn, cx.const(w), qt=qt)  # formats and bytes are counted over every placement in lower.py
    out = cx.out(node)
    b.gemv(p, cx.arg(x), out if bias is None else f"{out}.acc")
    if bias is not None:  # bias added on the host (fp32) after RD_ACC: lower_attention.lower_bias
        lower_bias(b, f"{out}.acc", cx.const_name(bias), cx.const(bias), out, numel(node))
    cx.linear_count += 1


@lowering("nhil::rope_cos_sin")
def _rope_cos_sin(cx: LowerCtx, node) -> None:
    """cos / sin tables of ``$pos`` into ``<node>.0`` / ``<node>.1`` (read through ``getitem``)."""
    _pos, inv_freq, scaling = node.args
    cx.image(inv_freq)
    out = node.name
    hd = int(node.meta["val"][0].shape[-1])
    cx.b.buffer(f"{out}.0", hd)
    cx.b.buffer(f"{out}.1", hd)
    attrs = {"half": True} if node.kwargs.get("half") else {}  # GPT-OSS half tables
    cx.b.host("rope_cos_sin", ["$pos", cx.const_name(inv_freq)], [f"{out}.0", f"{out}.1"], attention_scaling=float(scaling), **attrs)


@lowering("nhil::rope")
def _rope(cx: LowerCtx, node) -> None:
    x, cos, sin, hd = node.args[:4]
    out = cx.out(node)
    attrs = {"rotary_dim": int(node.args[4])} if len(node.args) > 4 and node.args[4] is not None else {}
    if node.kwargs.get("style", "rotate_half") != "rotate_half":
        attrs["style"] = str(node.kwargs["style"])
    cx.b.host("rope", [cx.arg(x), cx.arg(cos), cx.arg(sin)], [out], head_dim=int(hd), **attrs)


@lowering("nhil::narrow")
def _narrow(cx: LowerCtx, node) -> None:
    """Split of a fused projection: host copy of a buffer slice."""
    x, start, length = node.args
    out = cx.out(node)
    cx.b.host("narrow", [cx.arg(x)], [out], start=int(start), length=int(length))


@lowering("nhil::gelu_mul")
def _gelu_mul(cx: LowerCtx, node) -> None:
    """GeGLU gating on the host."""
    g, u = node.args[:2]
    out = cx.out(node)
    cx.b.host("gelu_mul", [cx.arg(g), cx.arg(u)], [out], approximate=str(node.args[2]) if len(node.args) > 2 else "tanh")


@lowering("nhil::layer_norm")
def _layer_norm(cx: LowerCtx, node) -> None:
    """LayerNorm on the host (GPT-2); weight and bias are optional host images. A norm over
    less than the whole token (a per-head QK-norm, Persimmon) records its ``width``."""
    x, w, bias, eps = node.args
    ins = [cx.arg(x)] + [cx.image(t) for t in (w, bias) if t is not None]
    out = cx.out(node)
    shape = x.meta["val"].shape
    width = {"width": int(shape[-1])} if int(shape[-1]) != numel(x) // int(shape[0]) else {}
    cx.b.host("layer_norm", ins, [out], eps=float(eps), has_weight=w is not None, has_bias=bias is not None, **width)


@lowering("nhil::gelu")
def _gelu(cx: LowerCtx, node) -> None:
    """GELU (no gating) on the host."""
    out = cx.out(node)
    cx.b.host("gelu", [cx.arg(node.args[0])], [out], variant=str(node.args[1]) if len(node.args) > 1 else "gelu_new")


@lowering("nhil::pos_embedding")
def _pos_embedding(cx: LowerCtx, node) -> None:
    """Learned absolute positions: ``x + table[$pos]`` on the host."""
    x, table, _pos = node.args
    cx.image(table)
    out = cx.out(node)
    cx.b.host("pos_embedding", [cx.arg(x), cx.const_name(table), "$pos"], [out])


@lowering("nhil::softcap")
def _softcap(cx: LowerCtx, node) -> None:
    """Final-logit soft-cap ``cap * tanh(x / cap)`` on the host."""
    x, cap = node.args
    out = cx.out(node)
    cx.b.host("softcap", [cx.arg(x)], [out], cap=float(cap))


@lowering("nhil::silu_mul")
def _silu_mul(cx: LowerCtx, node) -> None:
    g, u = node.args
    out = cx.out(node)
    cx.b.host("silu_mul", [cx.arg(g), cx.arg(u)], [out])


_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)$")  # decoder layer l (GPT-2: transformer.h.l)


@lowering("nhil::add")
def _add(cx: LowerCtx, node) -> None:
    """Residual add on the host; the add that ends decoder layer ``l`` is output ``act.model.layers.<l>``."""
    a1, a2 = node.args
    out = cx.out(node)
    cx.b.host("add", [cx.arg(a1), cx.arg(a2)], [out])
    m = _LAYER.search(node.meta.get("nn_module_stack_path", ""))
    if m:
        cx.layer_out[int(m.group(1))] = out
