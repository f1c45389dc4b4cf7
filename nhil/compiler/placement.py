"""Where each part of a model runs: PIM primitives, host primitives, host ATen (the report's
"Where it ran" section and the landscape's PIM column).

* PIM: the primitives whose GEMVs and cache reads the lowering puts in banks
  (``nhil::linear``, ``nhil::attention_kv``, ``nhil::moe``, ``nhil::mla_kv``; see
  ``nhil.compiler.lower``).
* host primitives: every other ``nhil::*`` primitive (norms, RoPE, activations, residual
  adds: ``nhil.runtime.host_kernels``).
* host ATen: exported ops no pattern raised, run on the host as exported
  (``nhil.compiler.host_aten``).

MACs per decoded token are counted from the graph IR's shapes: a linear ``[.., K] x [N, K]``
is N·K per token; decode attention over a cache of L positions is ``2·Hq·L·hd`` (q·Kᵀ and
p·V, the whole compiled cache: what the device's row reads cover); a MoE layer counts the
router plus its ``top_k`` experts (what runs for one token); a product inside a host ATen
region counts its output elements times the contracted size.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

PIM_PRIMITIVES = ("linear", "attention_kv", "attention", "attention_scores", "attention_values", "moe", "moe_experts", "mla_kv", "mla")
_HOST_PRODUCTS = ("mm", "bmm", "matmul", "linear", "addmm", "baddbmm", "einsum")


def _shape(n) -> tuple:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _macs(n: fx.Node) -> int:
    """MACs of one graph-IR node for one decode step (module docstring); 0 for elementwise work."""
    op = getattr(n.target, "_opname", None) or getattr(n.target, "__name__", "")
    if getattr(n.target, "namespace", None) == "nhil":
        if op == "linear":
            w = _shape(n.args[1])
            tokens = math.prod(_shape(n.args[0])[:-1]) or 1
            return tokens * w[0] * w[1] if len(w) == 2 else 0
        if op == "attention_kv":
            q, kc = _shape(n.args[0]), _shape(n.args[3])
            return 2 * q[1] * kc[2] * q[2] if len(q) == 3 and len(kc) == 4 else 0
        if op == "moe":
            x, rw, gu, dn = (_shape(a) for a in n.args[:4])
            tokens, k = (math.prod(x[:-1]) or 1), int(n.args[5])
            per_expert = (math.prod(gu[1:]) if len(gu) == 3 else 0) + (math.prod(dn[1:]) if len(dn) == 3 else 0)
            return tokens * ((math.prod(rw) if rw else 0) + k * per_expert)
        if op in ("attention_scores", "attention_values"):
            c = _shape(n.args[2])
            return int(n.args[4]) * c[2] * c[3] if len(c) == 4 else 0
        if op == "moe_experts":
            gu, dn = _shape(n.args[3]), _shape(n.args[4])
            return int(n.args[6]) * (math.prod(gu[1:]) + math.prod(dn[1:])) if len(gu) == 3 and len(dn) == 3 else 0
        return 0
    name = str(n.target)
    if any(f"aten.{p}." in name for p in _HOST_PRODUCTS):
        out, a = _shape(n), _shape(n.args[0] if name.find("addmm") < 0 else n.args[1])
        return math.prod(out) * (a[-1] if a else 1) if out else 0
    return 0


def placement(gm: fx.GraphModule) -> dict:
    """``{"pim": {prim: count}, "host_primitives": {...}, "host_aten": {op: count}, "macs": {"pim", "host", "pim_share"}}``
    of a raised graph (module docstring)."""
    pim: dict[str, int] = {}
    host: dict[str, int] = {}
    aten_ops: dict[str, int] = {}
    macs = {"pim": 0, "host": 0}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if getattr(n.target, "namespace", None) == "nhil":
            op = n.target._opname
            side = pim if op in PIM_PRIMITIVES else host
            side[f"nhil::{op}"] = side.get(f"nhil::{op}", 0) + 1
            macs["pim" if op in PIM_PRIMITIVES else "host"] += _macs(n)
        elif "host_group" in n.meta:
            from nhil.runtime.aten_graph import op_name

            k = op_name(n.target)
            aten_ops[k] = aten_ops.get(k, 0) + 1
            macs["host"] += _macs(n)
    total = macs["pim"] + macs["host"]
    macs["pim_share"] = macs["pim"] / total if total else 1.0
    return {"pim": dict(sorted(pim.items())), "host_primitives": dict(sorted(host.items())), "host_aten": dict(sorted(aten_ops.items())), "macs": macs}
