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

Each primitive has one lowering function in the table ``nhil.compiler.lowering.LOWERINGS``
(dense ops: ``lower_ops``; attention: ``lower_attention``; MoE: ``lower_moe``; MLA:
``lower_mla``); this module walks the graph, handles inputs, constants, ``getitem`` and the
output, and assembles ``program.info``.
"""

from __future__ import annotations

import operator

import torch

# importing these modules registers their lowerings in the table
from nhil.compiler import lower_attention, lower_mla, lower_moe, lower_ops, lower_recurrent  # noqa: F401
from nhil.compiler.builder import ProgramBuilder
from nhil.compiler.lowering import LOWERINGS, LowerCtx, numel, where
from nhil.errors import CompileError
from nhil.isa.device import DeviceConfig
from nhil.isa.program import Program


def lower_decode_graph(gm: torch.fx.GraphModule, device: DeviceConfig, model_name: str = "?", weight_format: str = "bf16", quant=None, passes=None) -> Program:
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
        passes: the lower-stage scheduling passes the builder honours (names of
            ``nhil.compiler.schedule.PASS_INFO``; None = every pass); program-stage ones are
            run after lowering by ``nhil.compiler.pipeline.PassManager``.

    Every ``nhil::<op>`` node is lowered by ``LOWERINGS["nhil::<op>"]`` (``nhil.compiler.lowering``);
    graph constants may be meta tensors (shape-only compiles: placements without bank images).

    Returns:
        The validated Program; ``io["outputs"]`` maps ``logits`` and ``act.<module>`` to buffers.
    Raises:
        CompileError: an op without a lowering (names op, module path, source line), or
            the model does not fit the device.
    """
    if weight_format != "bf16" and quant is None:
        raise CompileError(f"weight format {weight_format!r} is not supported by ISA v0 lowering (bf16 only); see the quantization issue")
    cx = LowerCtx(ProgramBuilder(device, passes), quant=quant)
    for node in gm.graph.nodes:
        _lower_node(cx, gm, node)
    b, outputs = cx.b, cx.outputs
    # each decoder layer's output (tagged by the raiser, nhil.compiler.layer_outputs; graphs built without it:
    # the residual add that ends the layer)
    layers = {}
    for n in gm.graph.nodes:
        if "act" in n.meta:
            if n.name not in cx.buf:
                raise CompileError(f"{n.meta['act']} ({n.name}) has no host buffer to read back: an nhil lowering defect, please report it with the model")
            layers[int(n.meta["act"].rsplit(".", 1)[1])] = cx.buf[n.name]
    for layer, name in sorted((layers or cx.layer_out).items()):
        outputs[f"act.model.layers.{layer}"] = name
    if "logits" not in outputs:
        raise CompileError("the graph has no output to lower")
    io = {"inputs": {"token": "int64 scalar: token id", "pos": "int64 scalar: cache position"}, "outputs": outputs}
    info = {
        "model": model_name,
        "kind": "decode-step",
        "weight_formats": [weight_format],
        "linears": cx.linear_count,
        "attention_layers": cx.attn_count,
        "max_cache_len": cx.kv_layouts[0].max_len if cx.kv_layouts else 0,
        "rows_used": b.next_row,
        "kv_layout": {str(k): vars(v) for k, v in cx.kv_layouts.items()},
    }
    if getattr(b, "row_use", None):  # shape-only compile (meta weights): used rectangle of every weight row
        info["row_use"] = {int(r): list(u) for r, u in b.row_use.items()}
    if getattr(cx, "recurrent_states", None):
        info["recurrent_state"] = cx.recurrent_states  # conv / SSM state rows of hybrid layers (lower_recurrent)
    if cx.moe_info:
        info["moe"] = cx.moe_info  # data-dependent expert dispatch (lower_moe; docs/isa.md runtime section)
    if quant is not None:
        formats_used, weight_bytes = {}, 0  # every placed matrix: linears, MoE experts, MLA slices
        for p in b.placements.values():
            formats_used[p.fmt] = formats_used.get(p.fmt, 0) + 1
            weight_bytes += p.nbytes
        info["linear_sizes"] = [p.n_out * p.n_in for p in b.placements.values()]
        info["weight_formats"] = sorted(formats_used)
        info["quant"] = {"recipe": quant.describe(), "matrices_per_format": formats_used, "weight_bytes": weight_bytes,
                         "placements": {n: {"format": p.fmt, "chunk": p.chunk, "rows": p.rows} for n, p in b.placements.items()}}
    if b.kv_formats:  # fp8 KV cache (lower_attention, nhil.numerics.kv_fp8)
        info["weight_formats"] = sorted(set(info["weight_formats"]) | b.kv_formats)
        info["raw_buffers"] = sorted(b.raw_buffers)
        info["kv_cache"] = "fp8"
    return b.finish(io, info)


def _lower_node(cx: LowerCtx, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Lower one graph node: inputs, constants, ``getitem`` and the output here, primitives by the table.

    Raises:
        CompileError: an unexpected graph input, a non-``nhil`` op, or a primitive without a lowering.
    """
    if node.op == "placeholder":
        nm = node.target
        if nm in ("input_ids", "tokens") or "input_ids" in nm:
            cx.buf[node.name] = "$token"
        elif "cache_position" in nm:
            cx.buf[node.name] = "$pos"
        else:
            raise CompileError(f"unexpected graph input {nm!r}; a decode step takes input_ids and cache_position")
        return
    if node.op == "get_attr":
        t = gm
        for part in node.target.split("."):
            t = getattr(t, part)
        cx.consts[node.name] = t
        cx.buf[node.name] = node.target
        return
    if node.op == "output":
        (res,) = node.args
        res = res[0] if isinstance(res, (tuple, list)) else res
        cx.outputs["logits"] = cx.arg(res)
        return
    if node.op != "call_function":
        raise CompileError(f"cannot lower {node.op} node {node.name} at {where(node)}")
    if "host_group" in node.meta:  # a host ATen region (nhil.compiler.host_aten)
        from nhil.compiler.lower_host_aten import lower_host_group

        lower_host_group(cx, gm, node)
        return
    tgt = node.target
    if tgt is operator.getitem:
        src, i = node.args
        cx.buf[node.name] = f"{cx.arg(src)}.{i}"
        cx.b.buffer(cx.buf[node.name], numel(node))
        return
    if getattr(tgt, "namespace", None) != "nhil":
        raise CompileError(f"no lowering for {tgt} at {where(node)}: only nhil primitives can be lowered (the op was not raised)")
    name = f"nhil::{getattr(tgt, '_opname', None) or tgt}"
    fn = LOWERINGS.get(name)
    if fn is None:
        raise CompileError(f"no lowering for {name} at {where(node)}; lowerings exist for {', '.join(sorted(LOWERINGS))}")
    cx.buf[node.name] = fn(cx, node) or node.name
