"""Lowering: graph IR (raised FX graph of ``nhil::*`` primitives) -> PIM program.

Partition (CENT / AttAcc / NeuPIMs): every ``nhil::linear`` (decode GEMV, incl. the LM
head) and decode attention's q·Kᵀ and p·V run on the PIM device; embedding, RMSNorm,
RoPE, softmax, SwiGLU gating and residual adds run as host kernels
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
from nhil.compiler.lower_attention import lower_decode_attention, place_kv
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


def lower_decode_graph(gm: torch.fx.GraphModule, device: DeviceConfig, model_name: str = "?", weight_format: str = "bf16") -> Program:
    """Lower a raised decode-step graph (one token, static KV cache) to a Program.

    Args:
        gm: graph IR from ``nhil.compiler.raising.raise_graph(ep, "decode")``.
        device: the device to compile for (``nhil.isa.DEVICE_PRESETS``).
        model_name: recorded in ``program.info``.
        weight_format: storage format of PIM weights (``bf16`` in ISA v0).
    Returns:
        The validated Program; ``io["outputs"]`` maps ``logits`` and ``act.<module>`` to buffers.
    Raises:
        CompileError: an op without a lowering (names op, module path, source line), or
            the model does not fit the device.
    """
    if weight_format != "bf16":
        raise CompileError(f"weight format {weight_format!r} is not supported by ISA v0 lowering (bf16 only); see the quantization issue")
    b = ProgramBuilder(device)
    buf: dict[str, str] = {}  # node name -> host buffer / image / "$input"
    consts: dict[str, torch.Tensor] = {}
    layer_of_cache: dict[str, int] = {}
    kv_layouts: dict[int, object] = {}
    outputs: dict[str, str] = {}
    layer_out: dict[int, str] = {}
    linear_count = attn_count = 0

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
            table, ids = node.args
            b.host_image(const_name(table), consts[table.name])
            b.buffer(out, _numel(node))
            b.host("embedding", [const_name(table), arg_buf(ids)], [out])
            outputs["act.model.embed_tokens"] = out
        elif op == "rms_norm":
            x, w, eps = node.args
            b.host_image(const_name(w), consts[w.name])
            b.buffer(out, _numel(node))
            b.host("rms_norm", [arg_buf(x), const_name(w)], [out], eps=float(eps))
        elif op == "linear":
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            if bias is not None:
                raise CompileError(f"linear with bias at {_where(node)} is not supported by ISA v0 lowering")
            p = b.place_matrix(const_name(w), consts[w.name])
            b.buffer(out, _numel(node))
            b.gemv(p, arg_buf(x), out)
            linear_count += 1
        elif op == "rope_cos_sin":
            pos, inv_freq, scaling = node.args
            b.host_image(const_name(inv_freq), consts[inv_freq.name])
            hd = int(node.meta["val"][0].shape[-1])
            b.buffer(f"{out}.0", hd)
            b.buffer(f"{out}.1", hd)
            b.host("rope_cos_sin", ["$pos", const_name(inv_freq)], [f"{out}.0", f"{out}.1"], attention_scaling=float(scaling))
            buf[node.name] = out
            continue
        elif op == "rope":
            x, cos, sin, hd = node.args
            b.buffer(out, _numel(node))
            b.host("rope", [arg_buf(x), arg_buf(cos), arg_buf(sin)], [out], head_dim=int(hd))
        elif op == "attention_kv":
            q, k, v, kc, vc, cpos, hq, hkv, scale = node.args
            kshape = consts[kc.name].shape  # [B, Hkv, L, hd]
            layer = attn_count
            attn_count += 1
            kv = place_kv(b, layer, int(kshape[2]), int(hkv), int(kshape[3]))
            kv_layouts[layer] = kv
            b.buffer(out, _numel(node))
            lower_decode_attention(b, kv, arg_buf(q), arg_buf(k), arg_buf(v), out, int(hq), float(scale), name=f"attn{layer}")
        elif op == "silu_mul":
            g, u = node.args
            b.buffer(out, _numel(node))
            b.host("silu_mul", [arg_buf(g), arg_buf(u)], [out])
        elif op == "add":
            a1, a2 = node.args
            b.buffer(out, _numel(node))
            b.host("add", [arg_buf(a1), arg_buf(a2)], [out])
            m = re.search(r"(?:^|\.)layers\.(\d+)$", path)
            if m:
                layer_out[int(m.group(1))] = out
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
    return b.finish(io, info)
