"""Lowering of host ATen regions: each run of graph-IR nodes tagged ``meta["host_group"]``
(``nhil.compiler.host_aten``) becomes one ``aten_graph`` host op whose spec is the
region's ATen ops (``nhil.runtime.aten_graph``).

Inputs are the host buffers of the values the group reads (fp32; the spec records each
value's exported shape and dtype, so integer and bool values round-trip exactly), graph
constants as host images, ``$token`` / ``$pos`` for the step inputs. Outputs are the group's
values read outside it, one fp32 host buffer each.
"""

from __future__ import annotations

import torch

from nhil.compiler.lowering import LowerCtx, where
from nhil.errors import CompileError
from nhil.runtime import aten_graph as ag


def _groups(cx: LowerCtx, gm: torch.fx.GraphModule) -> dict[int, list[torch.fx.Node]]:
    groups = cx.__dict__.get("_host_groups")
    if groups is None:
        groups = {}
        for n in gm.graph.nodes:
            if n.op == "call_function" and "host_group" in n.meta:
                groups.setdefault(n.meta["host_group"], []).append(n)
        cx._host_groups = groups
        cx._host_done = set()
    return groups


def _spec_of(node: torch.fx.Node) -> list:
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise CompileError(f"host ATen value {node.name} at {where(node)} is not a tensor ({type(v).__name__})")
    try:
        return [list(v.shape), ag.dtype_name(v.dtype)]
    except ValueError as e:
        raise CompileError(f"{e} ({node.name} at {where(node)})") from None


def lower_host_group(cx: LowerCtx, gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Lower the host group of ``node`` at its first node (later members are already done).

    Raises:
        CompileError: a value the spec cannot carry (dtype, argument kind), or a graph
            constant whose integers an fp32 image cannot hold exactly.
    """
    groups = _groups(cx, gm)
    if node in cx._host_done:
        return
    members = groups[node.meta["host_group"]]
    mset = set(members)
    inputs: list[torch.fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in mset and a not in inputs:
                inputs.append(a)
    ref = {a: i for i, a in enumerate(inputs)} | {n: len(inputs) + i for i, n in enumerate(members)}
    in_names, in_specs = [], []
    for a in inputs:
        spec = _spec_of(a)
        if a.op == "get_attr":
            t = cx.const(a)
            if not t.is_meta and not t.dtype.is_floating_point and t.dtype != torch.bool and t.numel() and int(t.abs().max()) >= 2**24:
                raise CompileError(f"graph constant {a.target} holds integers beyond 2^24, which an fp32 host image cannot keep exactly")
            in_names.append(cx.image(a))
        else:
            in_names.append(cx.arg(a))
        in_specs.append(spec)
    try:
        ops = [[ag.op_name(n.target), ag.encode(list(n.args), ref.__getitem__), {k: ag.encode(v, ref.__getitem__) for k, v in n.kwargs.items()}] for n in members]
    except (ValueError, AttributeError) as e:
        raise CompileError(f"host ATen region at {where(members[0])} cannot be carried by a program: {e}") from None
    outs = [n for n in members if any(u not in mset for u in n.users)]
    out_names, out_specs = [], []
    for n in outs:
        out_specs.append([ref[n], *_spec_of(n)])
        out_names.append(cx.out(n))
        cx.buf[n.name] = n.name
    if out_names:
        cx.b.host("aten_graph", in_names, out_names, ops=ops, in_specs=in_specs, out_specs=out_specs)
    cx._host_done.update(members)
