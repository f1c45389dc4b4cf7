"""Lowering: graph IR (raised FX graph of ``nhil::*`` primitives) -> PIM program.

Partition (CENT / AttAcc / NeuPIMs): every ``nhil::linear`` (decode GEMV, incl. the LM
head) and decode attention's q·Kᵀ and p·V run on the PIM device (MLA in absorbed form over
its latent cache: ``lower_mla``); embedding (and learned position embeddings), RMSNorm /
LayerNorm, RoPE, softmax, SwiGLU / GELU and residual adds run as host kernels
(``nhil.runtime.host_kernels``), which call the same ``nhil::*`` reference kernels the
graph IR runs, so host numerics equal the graph IR's.

The program is one decode step for one token at position ``$pos``; the runtime runs it
for every prompt token (prefill as per-token GEMVs) and every generated token.
Every graph value becomes one fp32 host buffer named after its node (SSA: written
once per step).
"""

from __future__ import annotations

import operator
import re

import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.compiler.lower_attention import lower_bias, lower_decode_attention, place_kv
from nhil.errors import CompileError
from nhil.isa.device import DeviceConfig
from nhil.isa.program import Program

HOST_ELEMENTWISE = {"rms_norm", "rope", "silu_mul", "add"}


def _numel(node) -> int:
    val = node.meta.get("val")
    if val is None:
        raise CompileError(f"node {node.name} has no shape metadata (meta['val']); run FakeTensorProp after raising")
    return int(val.numel())


def _where(node) -> str:
    path = node.meta.get("nn_module_stack_path", "?")
    trace = node.meta.get("stack_trace") or ""
    m = re.findall(r'File "([^"]+)", line (\d+)', trace)
    src = f"{m[-1][0]}:{m[-1][1]}" if m else "unknown source line"
    return f"{path} ({src})"


def lower_decode_graph(gm: torch.fx.GraphModule, device: DeviceConfig, model_name: str = "?", weight_format: str = "bf16", quant=None) -> Program:
    """Lower a raised decode-step graph (one token, static KV cache) to a Program.

    Args:
        gm: graph IR from ``nhil.compiler.raising.raise_graph(ep, "decode")``.
        device: the device to compile for (``nhil.isa.DEVICE_PRESETS``).
        model_name: recorded in ``program.info``.
        weight_format: storage format of PIM weights (``bf16`` in ISA v0).
        quant: optional :class:`nhil.compiler.quantize.QuantPlan`: gives each linear's
            weight (by its graph constant name) a format (``QTensor``) or ``None`` (bf16).
            Only ``linear`` lowering reads it; the program's ``info["weight_formats"]``
            then lists every format used.
    Returns:
        The validated Program; ``io["outputs"]`` maps ``logits`` and ``act.<module>`` to buffers.
    Raises:
        CompileError: an op without a lowering (names op, module path, source line), or
            the model does not fit the device.
    """
    if weight_format != "bf16" and quant is None:
        raise CompileError(f"weight format {weight_format!r} is not supported by ISA v0 lowering (bf16 only); see the quantization issue")
    b = ProgramBuilder(device)
    buf: dict[str, str] = {}  # node name -> host buffer / image / "$input"
    consts: dict[str, torch.Tensor] = {}
    kv_layouts: dict[int, object] = {}
    outputs: dict[str, str] = {}
    layer_out: dict[int, str] = {}
    linear_count = attn_count = 0
    formats_used: dict[str, int] = {}
    weight_bytes = 0
    moe_info: list[dict] = []

    def arg_buf(a) -> str:
        if a.name not in buf:
            raise CompileError(f"value {a.name} is used before it is lowered")
        return buf[a.name]

    def const_name(a) -> str:
        return a.target if a.op == "get_attr" else a.name

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            nm = node.target
            if nm in ("input_ids", "tokens") or "input_ids" in nm:
                buf[node.name] = "$token"
            elif "cache_position" in nm:
                buf[node.name] = "$pos"
            else:
                raise CompileError(f"unexpected graph input {nm!r}; a decode step takes input_ids and cache_position")
            continue
        if node.op == "get_attr":
            t = gm
            for part in node.target.split("."):
                t = getattr(t, part)
            consts[node.name] = t
            buf[node.name] = node.target
            continue
        if node.op == "output":
            (res,) = node.args
            res = res[0] if isinstance(res, (tuple, list)) else res
            outputs["logits"] = arg_buf(res)
            continue
        if node.op != "call_function":
            raise CompileError(f"cannot lower {node.op} node {node.name} at {_where(node)}")
        tgt = node.target
        if tgt is operator.getitem:
            src, i = node.args
            buf[node.name] = f"{arg_buf(src)}.{i}"
            b.buffer(buf[node.name], _numel(node))
            continue
        ns = getattr(tgt, "namespace", None)
        op = getattr(tgt, "_opname", None) or str(tgt)
        if ns != "nhil":
            raise CompileError(f"no lowering for {tgt} at {_where(node)}: only nhil primitives can be lowered (the op was not raised)")
        out = node.name
        path = node.meta.get("nn_module_stack_path", "")
        if op == "embedding":
            table, ids = node.args[:2]
            b.host_image(const_name(table), consts[table.name])
            b.buffer(out, _numel(node))
            emb_attrs = {"scale": float(node.args[2])} if len(node.args) > 2 and node.args[2] is not None else {}
            b.host("embedding", [const_name(table), arg_buf(ids)], [out], **emb_attrs)
            outputs["act.model.embed_tokens"] = out
        elif op == "rms_norm":
            x, w, eps = node.args[:3]
            b.host_image(const_name(w), consts[w.name])
            b.buffer(out, _numel(node))
            norm_attrs = dict(zip(("head_dim", "unit_offset"), node.args[3:]))  # QK-norm per head, Gemma (1+w)
            b.host("rms_norm", [arg_buf(x), const_name(w)], [out], eps=float(eps), **norm_attrs)
        elif op == "linear":
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            qt = quant.weight(const_name(w), consts[w.name]) if quant is not None else None
            new = const_name(w) not in b.placements
            p = b.place_matrix(const_name(w), consts[w.name], qt=qt)
            if new:
                formats_used[p.fmt] = formats_used.get(p.fmt, 0) + 1
                weight_bytes += p.nbytes
            b.buffer(out, _numel(node))
            b.gemv(p, arg_buf(x), out if bias is None else f"{out}.acc")
            if bias is not None:  # bias added on the host (fp32) after RD_ACC: lower_attention.lower_bias
                lower_bias(b, f"{out}.acc", const_name(bias), consts[bias.name], out, _numel(node))
            linear_count += 1
        elif op == "rope_cos_sin":
            pos, inv_freq, scaling = node.args
            b.host_image(const_name(inv_freq), consts[inv_freq.name])
            hd = int(node.meta["val"][0].shape[-1])
            b.buffer(f"{out}.0", hd)
            b.buffer(f"{out}.1", hd)
            half_attrs = {"half": True} if node.kwargs.get("half") else {}  # GPT-OSS half tables
            b.host("rope_cos_sin", ["$pos", const_name(inv_freq)], [f"{out}.0", f"{out}.1"], attention_scaling=float(scaling), **half_attrs)
            buf[node.name] = out
            continue
        elif op == "rope":
            x, cos, sin, hd = node.args[:4]
            b.buffer(out, _numel(node))
            rope_attrs = {"rotary_dim": int(node.args[4])} if len(node.args) > 4 and node.args[4] is not None else {}
            if node.kwargs.get("style", "rotate_half") != "rotate_half":
                rope_attrs["style"] = str(node.kwargs["style"])
            b.host("rope", [arg_buf(x), arg_buf(cos), arg_buf(sin)], [out], head_dim=int(hd), **rope_attrs)
        elif op == "attention_kv":
            q, k, v, kc, vc, cpos, hq, hkv, scale = node.args[:9]
            window, softcap = (list(node.args[9:]) + [None, None])[:2]
            kshape = consts[kc.name].shape  # [B, Hkv, L, hd]
            layer = attn_count
            attn_count += 1
            kv = place_kv(b, layer, int(kshape[2]), int(hkv), int(kshape[3]))
            kv_layouts[layer] = kv
            b.buffer(out, _numel(node))
            sinks = node.kwargs.get("sinks")
            if sinks is not None:  # GPT-OSS per-head sink logits: a host image read by the host softmax
                sinks = b.host_image(const_name(sinks), consts[sinks.name])
            lower_decode_attention(b, kv, arg_buf(q), arg_buf(k), arg_buf(v), out, int(hq), float(scale), name=f"attn{layer}", window=window, softcap=softcap, sinks=sinks)
        elif op == "narrow":  # split of a fused projection (host copy of a buffer slice)
            x, start, length = node.args
            b.buffer(out, _numel(node))
            b.host("narrow", [arg_buf(x)], [out], start=int(start), length=int(length))
        elif op == "gelu_mul":  # GeGLU gating on the host
            g, u = node.args[:2]
            b.buffer(out, _numel(node))
            b.host("gelu_mul", [arg_buf(g), arg_buf(u)], [out], approximate=str(node.args[2]) if len(node.args) > 2 else "tanh")
        elif op == "layer_norm":  # LayerNorm on the host (GPT-2)
            x, w, bias, eps = node.args
            ins = [arg_buf(x)]
            for t in (w, bias):
                if t is not None:
                    ins.append(b.host_image(const_name(t), consts[t.name]))
            b.buffer(out, _numel(node))
            b.host("layer_norm", ins, [out], eps=float(eps), has_weight=w is not None, has_bias=bias is not None)
        elif op == "gelu":  # GELU (no gating) on the host
            x = node.args[0]
            b.buffer(out, _numel(node))
            b.host("gelu", [arg_buf(x)], [out], variant=str(node.args[1]) if len(node.args) > 1 else "gelu_new")
        elif op == "pos_embedding":  # learned absolute positions: x + table[$pos] on the host
            x, table, _pos = node.args
            b.host_image(const_name(table), consts[table.name])
            b.buffer(out, _numel(node))
            b.host("pos_embedding", [arg_buf(x), const_name(table), "$pos"], [out])
        elif op == "softcap":  # final-logit soft-cap on the host
            x, cap = node.args
            b.buffer(out, _numel(node))
            b.host("softcap", [arg_buf(x)], [out], cap=float(cap))
        elif op == "silu_mul":
            g, u = node.args
            b.buffer(out, _numel(node))
            b.host("silu_mul", [arg_buf(g), arg_buf(u)], [out])
        elif op == "add":
            a1, a2 = node.args
            b.buffer(out, _numel(node))
            b.host("add", [arg_buf(a1), arg_buf(a2)], [out])
            m = re.search(r"(?:^|\.)(?:layers|h)\.(\d+)$", path)  # decoder layer l (GPT-2: transformer.h.l)
            if m:
                layer_out[int(m.group(1))] = out
        elif op == "moe":  # router GEMV on PIM, routing on the host, only routed experts issued (lower_moe)
            from nhil.compiler.lower_moe import lower_moe

            x, rw, gu, dw, n_exp, top_k = node.args[:6]
            moe_attrs = dict(zip(("score_func", "norm_topk_prob", "act", "score_bias", "n_group", "topk_group", "routed_scaling_factor"), node.args[6:]))
            if moe_attrs.get("act", "silu") not in ("silu", "swiglu_clamp") or _numel(node) != _numel(x):
                raise CompileError(f"no lowering for this nhil::moe (act {moe_attrs.get('act')}) at {_where(node)}")
            moe_w = {"router": (const_name(rw), consts[rw.name]), "gate_up": (const_name(gu), consts[gu.name]), "down": (const_name(dw), consts[dw.name])}
            sb = moe_attrs.pop("score_bias", None)
            if sb is not None:  # DeepSeek-V3 routing attributes (primitives.moe_routing)
                moe_w["score_bias"] = (const_name(sb), consts[sb.name])
                moe_attrs.update(n_group=int(moe_attrs.get("n_group", 1)), topk_group=int(moe_attrs.get("topk_group", 1)),
                                 routed_scaling_factor=float(moe_attrs.get("routed_scaling_factor", 1.0)))
            else:
                for a in ("n_group", "topk_group", "routed_scaling_factor"):
                    moe_attrs.pop(a, None)
            for key, t in node.kwargs.items():  # keyword-only attributes: optional weights (None when absent) and variant attrs
                if isinstance(t, torch.fx.Node):
                    moe_w[key] = (const_name(t), consts[t.name])
                elif t is not None:
                    moe_attrs[key] = t
            moe_info.append(lower_moe(
                b, arg_buf(x), out, moe_w,
                dict(moe_attrs, num_experts=n_exp, top_k=top_k, score_func=moe_attrs.get("score_func", "softmax"), norm_topk_prob=moe_attrs.get("norm_topk_prob", True)),
                layer=len(moe_info), quant=quant))
        elif op == "mla_kv":  # absorbed MLA: GEMVs and latent-cache attention in PIM, RoPE / softmax on the host (lower_mla)
            from nhil.compiler.lower_mla import lower_mla

            q, lat, kpe, lc, rc, cpos, cos, sin, wkv = node.args[:9]
            names = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scale", "rope_interleave", "q_lora_rank")
            mla_attrs = dict(zip(names, node.args[9:]))
            mla_attrs.setdefault("rope_interleave", True)
            layer = attn_count
            attn_count += 1
            kv_layouts[layer] = lower_mla(b, layer, {"q": arg_buf(q), "latent": arg_buf(lat), "k_rope": arg_buf(kpe), "cos": arg_buf(cos), "sin": arg_buf(sin)},
                                          const_name(wkv), consts[wkv.name], mla_attrs, int(consts[lc.name].shape[2]), out)
        else:
            raise CompileError(f"no lowering for nhil::{op} at {_where(node)}")
        buf[node.name] = out
    for layer, name in sorted(layer_out.items()):
        outputs[f"act.model.layers.{layer}"] = name
    if "logits" not in outputs:
        raise CompileError("the graph has no output to lower")
    io = {"inputs": {"token": "int64 scalar: token id", "pos": "int64 scalar: cache position"}, "outputs": outputs}
    info = {
        "model": model_name,
        "kind": "decode-step",
        "weight_formats": [weight_format],
        "linears": linear_count,
        "attention_layers": attn_count,
        "max_cache_len": kv_layouts[0].max_len if kv_layouts else 0,
        "rows_used": b.next_row,
        "kv_layout": {str(k): vars(v) for k, v in kv_layouts.items()},
    }
    if moe_info:
        info["moe"] = moe_info  # data-dependent expert dispatch (lower_moe; docs/isa.md runtime section)
    if quant is not None:
        formats_used, weight_bytes = {}, 0  # every placed matrix: linears, MoE experts, MLA slices
        for p in b.placements.values():
            formats_used[p.fmt] = formats_used.get(p.fmt, 0) + 1
            weight_bytes += p.nbytes
        info["linear_sizes"] = [p.n_out * p.n_in for p in b.placements.values()]
        info["weight_formats"] = sorted(formats_used)
        info["quant"] = {"recipe": quant.describe(), "matrices_per_format": formats_used, "weight_bytes": weight_bytes,
                         "placements": {n: {"format": p.fmt, "chunk": p.chunk, "rows": p.rows} for n, p in b.placements.items()}}
    return b.finish(io, info)
