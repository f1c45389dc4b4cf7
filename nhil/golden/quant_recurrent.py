"""Device numerics of recurrent layers for the quantized reference (``nhil.golden.quant_reference``).

Written from the mapping of ``nhil/compiler/lower_recurrent.py`` (``docs/isa.md``
"Recurrent state"), independently of the simulator and the executor:

* states are stored in bf16 bank rows, zero at the start of a sequence; the host reads
  them (bf16 -> fp32 exactly), computes in fp32 with the reference kernels' torch ops and
  stores the result rounded to bf16 (RNE);
* ``nhil::causal_conv1d_update``: the reference kernel on the stored window; the new
  window is stored in bf16;
* ``nhil::ssm_state_update``: ``new = stored * dA + dBx`` in fp32 (``ssm_discretize``),
  stored as ``bf16(new)``; ``y_raw = bf16 MAC(bf16(new) rows, C_g)`` per head group
  (``bf16_mac_rows``: C rounded to bf16 in the global buffer, 16-lane pairwise tree,
  bursts in order); ``y = y_raw + D * x`` in fp32.

:class:`RecurrentStates` holds the states of one reference run (``reset`` zeroes them).
"""

from __future__ import annotations

import torch

RECURRENT_OPS = ("causal_conv1d_update", "ssm_state_update")
_STATE_ARG = {"causal_conv1d_update": 1, "ssm_state_update": 7}


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
        from nhil.golden.quant_reference import round_bf16

        if op == "causal_conv1d_update":
            from nhil.compiler.primitives_recurrent import causal_conv1d_update_ref

            x, state, *rest = args
            out = causal_conv1d_update_ref(x, state, *rest, **kwargs)
            state.copy_(round_bf16(state))
            return out
        return self._ssm(*args, **kwargs)

    @staticmethod
    def _ssm(x, dt, A_log, B, C, D, dt_bias, state, num_heads, head_dim, n_groups, state_size, decay="scalar_per_head"):
        from nhil.compiler.primitives_recurrent import ssm_c_rows, ssm_discretize
        from nhil.golden.quant_reference import bf16_mac_rows, round_bf16

        H, hd, G, N = int(num_heads), int(head_dim), int(n_groups), int(state_size)
        hs, dA, dBx, Dh = ssm_discretize(x, dt, A_log, B, D, dt_bias, H, hd, G, N)
        new = round_bf16(state * dA + dBx)
        state.copy_(new)
        c = ssm_c_rows(C, 1, H, G, N)[0]  # [H, N]: head h reads C of its group
        y = bf16_mac_rows(new[0], c)  # [H, hd]: row (h, p) of the state against C of h's group
        out = y.view(1, H, hd) + hs * Dh
        return out.view(1, 1, -1)
