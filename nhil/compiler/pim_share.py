"""Share of a model's weights that the raised graph puts on PIM.

A PASS of the landscape means the model ran as the device would run it: every matrix a
GEMV reads (every linear layer, the MoE router and experts, MLA's ``kv_b_proj``) lives in
PIM banks. :func:`pim_weight_share` counts, over the model's parameters with two or more
dimensions, the elements that feed a PIM primitive of the raised graph (``nhil::linear``
weight, ``nhil::moe`` matrices, ``nhil::mla_kv`` / ``nhil::mla`` projections). Tensors
are identified by storage, so a transposed view (GPT-2's Conv1D ``W.t()``) or a tied
LM head counts once. The token-embedding table is excluded when it is only read by
``nhil::embedding`` (a host row lookup, not a GEMV); when it is tied to the LM head it is
a GEMV matrix and counts. Likewise a >=2-D parameter read only by host ATen (an additive
``[1, E]`` routing bias, a gathered table): host ATen may not hold a product over a weight
(``nhil.compiler.host_aten``), so such a tensor is not a GEMV matrix. A parameter the decode
step never reads (the cross-attention of a BART-family decoder run without encoder states)
is listed as unused, not counted.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["pim_weight_share", "PIM_OPS"]

PIM_OPS = ("linear", "moe", "moe_experts", "mla_kv", "mla")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def pim_weight_share(gm: fx.GraphModule, model: torch.nn.Module) -> dict:
    """``{"pim_params", "matrix_params", "share", "host_matrices"}`` of a raised graph.

    Args:
        gm: graph IR from :func:`nhil.compiler.raise_graph` (get_attr nodes are the
            exported program's tensors, which share storage with ``model``'s parameters).
        model: the transformers model that was exported.

    Returns:
        pim_params: elements of the matrices read by PIM primitives; matrix_params:
        elements of every >=2-D parameter except an embedding table read only by
        ``nhil::embedding``; share = pim_params / matrix_params (1.0 when there are no
        matrices); host_matrices: names of matrices no PIM primitive reads (first 10).
    """
    on_pim: set[int] = set()
    lookup_only: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        host_aten = "host_group" in n.meta  # host ATen never holds a product over a weight (host_aten.pim_bound_reason)
        if not host_aten and getattr(n.target, "namespace", None) != "nhil":
            continue
        op = "host ATen" if host_aten else n.target._opname
        args = list(n.args) + list(n.kwargs.values())
        for a in args:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                t = getattr(gm, a.target, None) if "." not in a.target else _fetch(gm, a.target)
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    (on_pim if op in PIM_OPS else lookup_only).add(_storage(t))
    read: set[int] = set()  # every tensor the graph reads at all
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = _fetch(gm, n.target)
            if isinstance(t, torch.Tensor):
                read.add(_storage(t))
    seen: set[int] = set()
    total = pim = 0
    host: list[str] = []
    unused: list[str] = []
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.dim() < 2:
            continue
        s = _storage(p)
        if s in seen:
            continue
        seen.add(s)
        if s in lookup_only and s not in on_pim:
            continue  # embedding table: a host row lookup
        if s not in read:
            unused.append(name)  # never read by the decode step (a decoder's cross-attention without encoder states)
            continue
        total += p.numel()
        if s in on_pim:
            pim += p.numel()
        else:
            host.append(name)
    return {"pim_params": pim, "matrix_params": total, "share": (pim / total) if total else 1.0, "host_matrices": host[:10], "unused_matrices": unused[:10]}


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
