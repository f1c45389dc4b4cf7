"""``nhil::moe_experts``: the experts of a MoE layer whose routing is not a named rule.

A MoE block is PIM-bound in two places: the router GEMV and the routed experts' GEMVs.
When a family's routing is one nhil has no rule for (a new score function, an op order
the router patterns do not know), the routing runs as host ATen (the exported ops: the
router linear is still a PIM GEMV) and hands the expert ids and weights to this
primitive, which runs the experts exactly as ``nhil::moe`` does: per slot the SwiGLU FFN
of the chosen expert, scaled by its weight, summed over the slots in order.

Source: transformers 5.24 ``integrations/moe.batched_mm_experts_forward`` with the default
gate (``_default_apply_gate``): ``repeat_interleave`` of the tokens over the k slots,
``bmm(gate_up_proj[ids], x)`` -> chunk -> ``silu(gate) * up`` -> ``bmm(down_proj[ids], ·)``
-> ``* weight`` -> ``view(T, k, H).sum(1)``.
"""

from __future__ import annotations

import torch

from nhil.compiler.primitives import LIB, _fake, _impl, moe_expert_ffn

SCHEMAS = {"moe_experts": "moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up_proj, Tensor down_proj, int num_experts, int top_k) -> Tensor"}
for _schema in SCHEMAS.values():
    LIB.define(_schema)


def _check(x, ids, weights, gate_up_proj, down_proj, num_experts: int, top_k: int) -> None:
    t, h = x.shape
    e, i2, h2 = gate_up_proj.shape
    if (h2 != h or e != num_experts or i2 % 2 or tuple(down_proj.shape) != (e, h, i2 // 2) or tuple(ids.shape) != (t, top_k)
            or tuple(weights.shape) != (t, top_k) or ids.dtype != torch.int64):
        raise ValueError(f"moe_experts shapes do not fit: x {tuple(x.shape)}, ids {tuple(ids.shape)} {ids.dtype}, weights {tuple(weights.shape)}, "
                         f"gate_up {tuple(gate_up_proj.shape)}, down {tuple(down_proj.shape)}, E={num_experts}, k={top_k}")


@_impl("moe_experts")
def moe_experts_ref(x, ids, weights, gate_up_proj, down_proj, num_experts: int, top_k: int):
    """Routed SwiGLU experts: x [T,H] fp32, ids [T,k] int64, weights [T,k] fp32, gate_up_proj
    [E,2I,H] (gate rows, then up rows), down_proj [E,H,I] -> [T,H] (module docstring).

    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    _check(x, ids, weights, gate_up_proj, down_proj, num_experts, top_k)
    t, h = x.shape
    y = moe_expert_ffn(x.repeat_interleave(top_k, dim=0), gate_up_proj, down_proj, ids.reshape(-1))
    y = y * weights.reshape(-1).unsqueeze(-1)
    return y.view(t, top_k, h).sum(dim=1)


@_fake("moe_experts")
def _moe_experts_fake(x, ids, weights, gate_up_proj, down_proj, num_experts, top_k):
    return torch.empty_like(x)
