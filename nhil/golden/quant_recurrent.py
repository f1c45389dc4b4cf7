"""Device numerics of recurrent layers for the quantized reference (``nhil.golden.quant_reference``).

Written from the mapping of ``nhil/compiler/lower_recurrent.py`` (``docs/isa.md``
"Recurrent state"), independently of the simulator and the executor:

* states are stored in bf16 bank rows, zero at the start of a sequence; the host reads
  them (bf16 -> fp32 exactly), computes in fp32 with the reference kernels' torch ops and
  stores the result rounded to bf16 (RNE);
* ``nhil::causal_conv1d_update``: the reference kernel on the stored window; the new
  window is stored in bf16;
* ``nhil::gated_delta_rule``: state stored transposed ``Sᵀ`` in bf16; ``delta_host_prep`` (q̂, k̂,
  decay, beta, fp32); ``kvm = bf16 MAC(Sᵀ rows, k̂)``; ``S'ᵀ = bf16(delta_host_update(...))``;
  output ``bf16 MAC(S'ᵀ rows, q̂)``;
* ``nhil::ssm_state_update``: ``new = stored * dA + dBx`` in fp32 (``ssm_discretize``),
  stored as ``bf16(new)``; ``y_raw = bf16 MAC(bf16(new) rows, C_g)`` per head group
  (``bf16_mac_rows``: C rounded to bf16 in the global buffer, 16-lane pairwise tree,
  bursts in order); ``y = y_raw + D * x`` in fp32.

:class:`RecurrentStates` holds the states of one reference run (``reset`` zeroes them).
"""

from __future__ import annotations

import torch

RECURRENT_OPS = ("causal_conv1d_update", "ssm_state_update", "gated_delta_rule")
_STATE_ARG = {"causal_conv1d_update": 1, "ssm_state_update": 7, "gated_delta_rule": 7}


class RecurrentStates:
    """Conv / SSM state tensors of a raised graph, by constant name (fp32 holding bf16 values on the device path).

    Args:
        gm: the raised decode graph; every ``nhil::causal_conv1d_update`` /
            ``nhil::ssm_state_update`` node names its state constant (a ``get_attr``).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.names: set[str] = set()
        for n in gm.graph.nodes:
            op = getattr(n.target, "_opname", None)
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "nhil" and op in RECURRENT_OPS:
                self.names.add(n.args[_STATE_ARG[op]].target)
        self.states: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Zero every state (start of a sequence; the lowered program's rows are zero at load)."""
        self.states = {name: torch.zeros_like(self.gm.get_buffer(name), dtype=torch.float32) for name in self.names}

    def call(self, op: str, args, kwargs):
        """Run recurrent primitive ``op`` with the device's numerics (module docstring); states updated in place."""
        from nhil.golden.quant_mac import round_bf16

        if op == "causal_conv1d_update":
            from nhil.compiler.primitives_recurrent import causal_conv1d_update_ref

            x, state, *rest = args
            out = causal_conv1d_update_ref(x, state, *rest, **kwargs)
            state.copy_(round_bf16(state))
            return out
        if op == "gated_delta_rule":
            return self._gdr(*args, **kwargs)
        return self._ssm(*args, **kwargs)

    @staticmethod
    def _ssm(x, dt, A_log, B, C, D, dt_bias, state, num_heads, head_dim, n_groups, state_size, decay="scalar_per_head"):
        from nhil.compiler.primitives_recurrent import ssm_c_rows, ssm_discretize
        from nhil.golden.quant_mac import bf16_mac_rows, round_bf16

        H, hd, G, N = int(num_heads), int(head_dim), int(n_groups), int(state_size)
        hs, dA, dBx, Dh = ssm_discretize(x, dt, A_log, B, D, dt_bias, H, hd, G, N)
        new = round_bf16(state * dA + dBx)
        state.copy_(new)
        c = ssm_c_rows(C, 1, H, G, N)[0]  # [H, N]: head h reads C of its group
        y = bf16_mac_rows(new[0], c)  # [H, hd]: row (h, p) of the state against C of h's group
        out = y.view(1, H, hd) + hs * Dh
        return out.view(1, 1, -1)

    @staticmethod
    def _gdr(q, k, v, a, b, A_log, dt_bias, state, num_k_heads, num_v_heads, head_k_dim, head_v_dim, beta_scale=1.0, qk_l2norm=True):
        from nhil.compiler.primitives_recurrent import delta_host_prep, delta_host_update
        from nhil.golden.quant_mac import bf16_mac_rows, round_bf16

        hk, hv, dk, dv = int(num_k_heads), int(num_v_heads), int(head_k_dim), int(head_v_dim)
        qh, kh, decay, beta = delta_host_prep(q, k, a, b, A_log, dt_bias, hk, dk, float(beta_scale), bool(qk_l2norm))
        rep = hv // hk
        k_rows, q_rows = kh.repeat_interleave(rep, dim=0), qh.repeat_interleave(rep, dim=0)  # [Hv, dk]
        s_t = state[0].transpose(1, 2)  # stored Sᵀ [Hv, dv, dk] (bf16 values)
        kvm = bf16_mac_rows(s_t, k_rows)  # PIM: Sᵀ k̂ per value head
        new_t = round_bf16(delta_host_update(v.reshape(hv, dv), kvm, decay, beta, k_rows, s_t))
        state.copy_(new_t.transpose(1, 2).unsqueeze(0))
        return bf16_mac_rows(new_t, q_rows).reshape(1, 1, hv * dv)  # PIM: S'ᵀ q̂
