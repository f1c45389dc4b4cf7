"""Host kernels of recurrent layers (``nhil/compiler/lower_recurrent.py``): the state updates' host halves.

The states live in bank rows; each step the program reads them back (``RD_SBK``, bf16
words decoded to fp32), these kernels compute the new state in fp32 with the reference
kernels' own torch ops (``nhil.compiler.primitives_recurrent``), and the program writes
it back (``WR_SBK``, RNE to bf16). So host numerics are the graph IR's given the stored
(bf16) state; the only device arithmetic is the ``S · C`` GEMV.

Buffers are flat fp32: conv state ``[channels * kernel]`` (channel-major, as the cache's
``[1, C, K]``), SSM state ``[heads * head_dim * state_size]`` (as ``[1, H, hd, N]``).
"""

from __future__ import annotations

import numpy as np
import torch

from nhil.runtime.host_kernels import kernel


def _t(a, *shape) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True)).reshape(*shape)


@kernel("conv_state_update", (3, 6), 2)
def conv_state_update(inputs, outputs, ctx, channels: int, kernel_size: int, activation: str = "silu", has_bias: bool = False, gated: bool = False):
    """``nhil::causal_conv1d_update`` on the host: inputs ``x`` [C], stored state [>= C*K],
    weight image [C*K] (``[C,1,K]``), then the bias image [C] if ``has_bias``, then the
    ``in_gate`` / ``out_gate`` [C] if ``gated`` (LFM2); outputs ``y`` [C] and the new state
    [>= C*K] (tail untouched)."""
    from nhil.compiler.primitives_recurrent import causal_conv1d_update_ref

    x, st, w = inputs[:3]
    rest = list(inputs[3:])
    c, k = channels, kernel_size
    bias = _t(rest.pop(0), c) if has_bias else None
    gates = {"in_gate": _t(rest[0], 1, 1, c), "out_gate": _t(rest[1], 1, 1, c)} if gated else {}
    state = _t(np.asarray(st)[: c * k], 1, c, k)
    y = causal_conv1d_update_ref(_t(x, 1, 1, c), state, _t(w, c, 1, k), bias, activation, **gates)
    outputs[0][:] = y.reshape(-1).numpy()
    outputs[1][: c * k] = state.reshape(-1).numpy()


@kernel("ssm_update", 7, 1)
def ssm_update(inputs, outputs, ctx, num_heads: int, head_dim: int, n_groups: int, state_size: int):
    """New Mamba-2 SSM state ``state * dA + dBx`` (``primitives_recurrent.ssm_discretize``):
    inputs ``x`` [H*hd], ``dt`` [H], ``B`` [G*N], stored state [H*hd*N], images A_log, D,
    dt_bias [H]; output the new state [H*hd*N]."""
    from nhil.compiler.primitives_recurrent import ssm_discretize

    x, dt, B, st, a_log, D, dt_bias = inputs
    H, hd, G, N = num_heads, head_dim, n_groups, state_size
    _, dA, dBx, _ = ssm_discretize(_t(x, 1, 1, H * hd), _t(dt, 1, 1, H), _t(a_log, H), _t(B, 1, 1, G * N), _t(D, H), _t(dt_bias, H), H, hd, G, N)
    new = _t(st, 1, H, hd, N) * dA + dBx
    outputs[0][:] = new.reshape(-1).numpy()


@kernel("ssm_skip", 3, 1)
def ssm_skip(inputs, outputs, ctx, num_heads: int, head_dim: int):
    """Mamba-2 output ``y = (S · C) + D * x`` per head: inputs the GEMV result [H*hd], ``x`` [H*hd], image D [H]."""
    y, x, D = inputs
    H, hd = num_heads, head_dim
    out = _t(y, 1, H, hd) + _t(x, 1, H, hd) * _t(D, H)[:, None].expand(-1, hd)
    outputs[0][:] = out.reshape(-1).numpy()


@kernel("rms_norm_gated", 3, 1)
def rms_norm_gated(inputs, outputs, ctx, eps: float, group_size: int, norm_before_gate: bool = False):
    """``nhil::rms_norm_gated`` on the host: inputs ``x``, ``gate`` [F], weight image ([F], or [group_size] when
    ``norm_before_gate``); output [F]."""
    from nhil.compiler.primitives_recurrent import rms_norm_gated_ref

    x, gate, w = inputs
    f = len(x)
    out = rms_norm_gated_ref(_t(x, 1, 1, f), _t(gate, 1, 1, f), _t(w, len(w)), eps, group_size, norm_before_gate)
    outputs[0][:] = out.reshape(-1).numpy()


@kernel("concat", (1, None), 1)
def concat(inputs, outputs, ctx):
    """``nhil::concat``: the inputs one after the other."""
    outputs[0][:] = np.concatenate([np.asarray(x, dtype=np.float32) for x in inputs])


@kernel("delta_prep", 6, 4)
def delta_prep(inputs, outputs, ctx, num_k_heads: int, head_k_dim: int, beta_scale: float, qk_l2norm: bool = True):
    """Gated DeltaNet host step 1 (``primitives_recurrent.delta_host_prep``): inputs ``q``, ``k`` [Hk*dk], ``a``, ``b``
    [Hv], images A_log, dt_bias [Hv]; outputs ``q̂``, ``k̂`` [Hk*dk], ``decay``, ``beta`` [Hv]."""
    from nhil.compiler.primitives_recurrent import delta_host_prep

    q, k, a, b, a_log, dt_bias = inputs
    hv = len(a)
    res = delta_host_prep(_t(q, 1, 1, -1), _t(k, 1, 1, -1), _t(a, 1, 1, hv), _t(b, 1, 1, hv), _t(a_log, hv), _t(dt_bias, hv),
                          num_k_heads, head_k_dim, beta_scale, qk_l2norm)
    for o, r in zip(outputs, res):
        o[:] = r.reshape(-1).numpy()


@kernel("delta_update", 6, 1)
def delta_update(inputs, outputs, ctx, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int):
    """Gated DeltaNet host step 2 (``primitives_recurrent.delta_host_update``): inputs ``v`` [Hv*dv], the PIM product
    ``Sᵀ k̂`` [Hv*dv], ``decay``, ``beta`` [Hv], ``k̂`` [Hk*dk], stored ``Sᵀ`` [Hv*dv*dk]; output the new ``S'ᵀ``."""
    from nhil.compiler.primitives_recurrent import delta_host_update

    v, kvm, decay, beta, kh, st = inputs
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    k_rows = _t(kh, hk, dk).repeat_interleave(hv // hk, dim=0)
    new = delta_host_update(_t(v, hv, dv), _t(kvm, hv, dv), _t(decay, hv), _t(beta, hv), k_rows, _t(st, hv, dv, dk))
    outputs[0][:] = new.reshape(-1).numpy()
