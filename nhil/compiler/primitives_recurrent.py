"""Graph-IR primitives of recurrent (state-space / linear-attention) layers, registered into the nhil torch library.

The decode step of a hybrid layer is a fixed-size state update plus GEMVs (issue 14).
Each primitive carries the family's real parameters and a reference kernel written with
the same torch ops, in the same order and broadcast shapes, as the transformers 5.24
module's decode branch as it appears in the exported graph, so a raised graph is
bit-identical to the exported one (``nhil.compiler.check``).

* ``nhil::causal_conv1d_update``: the depthwise short convolution over a rolling window
  (``modeling_mamba2.causal_conv1d_update``: ``cat(conv_state, x)``, window shifted into
  the state, ``conv1d(groups=C)``, last position, activation); with ``in_gate`` /
  ``out_gate`` LFM2's gated short conv ``C * conv(B * x)`` (``modeling_lfm2.Lfm2ShortConv``).
* ``nhil::ssm_state_update``: the Mamba-2 selective state update
  (``modeling_mamba2.mamba2_selective_state_update`` with ``dt_softplus=True``, called by
  ``Mamba2Mixer.forward``'s recurrent form): per head ``h`` a scalar decay
  ``dA_h = exp(softplus(dt_h + dt_bias_h) * A_h)``, ``A = -exp(A_log)``; state
  ``S_h <- S_h * dA_h + (dt_h * B_g) ⊗ x_h`` ([head_dim, state_size], ``g`` the head's
  group); output ``y_h = S_h · C_g + D_h * x_h``. ``decay="scalar_per_head"`` names the
  decay form (Mamba-1's per-channel matrix decay would be another value).
* ``nhil::rms_norm_gated``: ``MambaRMSNormGated``: ``x * silu(gate)`` then RMSNorm over
  groups of ``group_size``, times the weight; ``norm_before_gate`` (OLMo-hybrid's output
  norm): ``w * rmsnorm(x) * silu(gate)`` per group.
* ``nhil::gated_delta_rule``: gated DeltaNet (``modeling_olmo_hybrid``,
  ``torch_recurrent_gated_delta_rule``): decay ``exp(-exp(A_log) softplus(a + dt_bias))``,
  delta-rule correction with ``beta = sigmoid(b) * beta_scale``, L2-normed q/k,
  key heads shared by ``num_v_heads / num_k_heads`` value heads; ``nhil::concat`` joins
  the q/k/v projections before their short conv.

Layouts follow ``primitives_lib.py``: token-major ``[B, 1, features]`` activations, multi-head
tensors flat. States keep the cache's shapes: conv ``[B, channels, kernel]``, SSM
``[B, heads, head_dim, state_size]``; both fp32, mutated in place (``Tensor(a!)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nhil.compiler.primitives_lib import _fake, _impl, define

_SCHEMAS = {
    "causal_conv1d_update": (
        "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, str activation='silu', *, "
        "Tensor? in_gate=None, Tensor? out_gate=None) -> Tensor"
    ),
    "ssm_state_update": (
        "ssm_state_update(Tensor x, Tensor dt, Tensor A_log, Tensor B, Tensor C, Tensor D, Tensor dt_bias, Tensor(a!) state, "
        "int num_heads, int head_dim, int n_groups, int state_size, str decay='scalar_per_head') -> Tensor"
    ),
    "rms_norm_gated": "rms_norm_gated(Tensor x, Tensor gate, Tensor weight, float eps, int group_size, bool norm_before_gate=False) -> Tensor",
    "concat": "concat(Tensor[] xs) -> Tensor",
    "gated_delta_rule": (
        "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, Tensor(a!) state, "
        "int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim, float beta_scale=1.0, bool qk_l2norm=True) -> Tensor"
    ),
}
PRIMITIVES = define(_SCHEMAS)
ACTIVATIONS = {"silu": F.silu, "none": None}
DECAYS = ("scalar_per_head",)


@_impl("causal_conv1d_update")
def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias, activation: str = "silu", *,
                             in_gate=None, out_gate=None) -> torch.Tensor:
    """Short depthwise convolution of one token over the rolling window in ``conv_state``.

    Args:
        x: [B, 1, C] fp32 (token-major; the module transposes to [B, C, 1]).
        conv_state: [B, C, K] fp32, mutated: the last K inputs (oldest first).
        weight: [C, 1, K] (``nn.Conv1d(groups=C).weight``); bias [C] or None.
        activation: ``"silu"`` or ``"none"``.
        in_gate / out_gate: [B, 1, C] or None: LFM2's double gating ``C * conv(B * x)``
            (``modeling_lfm2.Lfm2ShortConv.forward``): the window holds ``B * x``.

    Returns:
        [B, 1, C] fp32. Source: transformers 5.24 ``modeling_mamba2.causal_conv1d_update``.
    """
    h = x.transpose(1, 2)
    if in_gate is not None:
        h = in_gate.transpose(1, 2) * h
    c, k = h.shape[1], conv_state.shape[-1]
    full = torch.cat([conv_state, h], dim=-1)
    conv_state.copy_(full[:, :, -k:])
    out = F.conv1d(full, weight.squeeze(1).unsqueeze(1), bias, padding=0, groups=c)[:, :, -1:]
    act = ACTIVATIONS[activation]
    if act is not None:
        out = act(out)
    if out_gate is not None:
        out = out_gate.transpose(1, 2) * out
    return out.transpose(1, 2).contiguous()


def ssm_discretize(x, dt, A_log, B, D, dt_bias, num_heads: int, head_dim: int, n_groups: int, state_size: int):
    """The decay and input terms of the Mamba-2 update (ops of ``mamba2_selective_state_update``).

    Args: x [1,1,H*hd], dt [1,1,H], A_log [H], B [1,1,G*N], D [H], dt_bias [H] (fp32).

    Returns:
        ``(hs [1,H,hd], dA [1,H,hd,N], dBx [1,H,hd,N], Dx-factor D [H,hd])``: the state
        update is ``state * dA + dBx`` and the skip term ``hs * D``.
    """
    b = x.shape[0]
    A = -torch.exp(A_log.float())
    hs = x.view(b, num_heads, head_dim)
    dt = dt.transpose(1, 2).expand(-1, -1, head_dim)
    A = A[:, None, None].expand(-1, head_dim, state_size)
    B = B.view(b, n_groups, state_size)
    D = D[:, None].expand(-1, head_dim)
    dt = dt + dt_bias[:, None].expand(-1, head_dim)
    dt = F.softplus(dt)[..., None]
    dA = torch.exp(dt * A)
    B = B.reshape(b, n_groups, 1, state_size).expand(b, n_groups, num_heads // n_groups, state_size).contiguous().reshape(b, num_heads, 1, state_size)
    dBx = (dt * B) * hs[..., None]
    return hs, dA, dBx, D


def ssm_c_rows(C, b: int, num_heads: int, n_groups: int, state_size: int) -> torch.Tensor:
    """C [1,1,G*N] expanded to its heads: [B, H, N] (``mamba2_selective_state_update``)."""
    C = C.view(b, n_groups, state_size)
    return C.reshape(b, n_groups, 1, state_size).expand(b, n_groups, num_heads // n_groups, state_size).contiguous().reshape(b, num_heads, state_size)


@_impl("ssm_state_update")
def ssm_state_update_ref(x, dt, A_log, B, C, D, dt_bias, state, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                         decay: str = "scalar_per_head") -> torch.Tensor:
    """Mamba-2 selective state update for one token (module docstring).

    Args:
        x: [B,1,H*hd]; dt: [B,1,H] (before ``dt_bias`` and softplus); A_log, D, dt_bias: [H];
        B, C: [B,1,G*N]; state: [B,H,hd,N] fp32, mutated to the new state.

    Returns:
        y [B,1,H*hd] fp32 (before the gated norm). Source: transformers 5.24
        ``Mamba2Mixer.forward`` (recurrent form) and ``mamba2_selective_state_update``.
    """
    b = x.shape[0]
    hs, dA, dBx, Dh = ssm_discretize(x, dt, A_log, B, D, dt_bias, num_heads, head_dim, n_groups, state_size)
    new = state * dA + dBx
    state.copy_(new)
    c = ssm_c_rows(C, b, num_heads, n_groups, state_size)
    out = torch.bmm(new.view(b * num_heads, head_dim, state_size), c.view(b * num_heads, state_size, 1)).view(b, num_heads, head_dim)
    out = out + hs * Dh
    return out.view(b, 1, -1)


@_impl("rms_norm_gated")
def rms_norm_gated_ref(x, gate, weight, eps: float, group_size: int, norm_before_gate: bool = False) -> torch.Tensor:
    """``weight * groupnorm_rms(x * silu(gate))`` over groups of ``group_size`` (fp32, [B,S,F] -> [B,S,F]).

    ``norm_before_gate``: ``weight * groupnorm_rms(x) * silu(gate)`` with a per-group weight
    [group_size] (gated DeltaNet's output norm, one group per value head).

    Source: transformers 5.24 ``modeling_mamba2.MambaRMSNormGated.forward``;
    ``modeling_olmo_hybrid.OlmoHybridRMSNormGated.forward`` (``norm_before_gate``).
    """
    if norm_before_gate:
        *lead, last = x.shape
        h = x.view(*lead, last // group_size, group_size)
        var = h.pow(2).mean(-1, keepdim=True)
        h = weight * (h * torch.rsqrt(var + eps))
        return (h * F.silu(gate.view(*lead, last // group_size, group_size))).view(*lead, last)
    h = x * F.silu(gate)
    *lead, last = h.shape
    g = h.view(*lead, last // group_size, group_size)
    var = g.pow(2).mean(-1, keepdim=True)
    g = g * torch.rsqrt(var + eps)
    return weight * g.view(*lead, last)


@_impl("concat")
def concat_ref(xs) -> torch.Tensor:
    """``torch.cat(xs, dim=-1)`` of token-major activations (gated DeltaNet's ``cat(q, k, v)`` before its conv)."""
    return torch.cat(list(xs), dim=-1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x*x, -1) + eps)`` (``modeling_olmo_hybrid.l2norm``, FLA's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_gates(a, b, A_log, dt_bias, beta_scale: float):
    """Per value head ``beta = sigmoid(b) * beta_scale`` and log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``
    ([B,1,Hv] each; ``OlmoHybridGatedDeltaNet.forward``)."""
    beta = b.sigmoid()
    if beta_scale != 1.0:
        beta = beta * beta_scale
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return beta, g


def delta_qkv(q, k, v, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, qk_l2norm: bool = True):
    """Head views of q/k/v as ``torch_recurrent_gated_delta_rule`` prepares them: q, k repeated to the value heads,
    [B, H, 1, d] contiguous fp32, L2-normalised, q scaled by ``1/sqrt(head_k_dim)``."""
    b = q.shape[0]
    qh, kh, vh = q.view(b, 1, -1, head_k_dim), k.view(b, 1, -1, head_k_dim), v.view(b, 1, -1, head_v_dim)
    if num_k_heads != num_v_heads:
        qh = qh.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        kh = kh.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    qh, kh, vh = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (qh, kh, vh)]
    if qk_l2norm:
        qh, kh = l2norm(qh), l2norm(kh)
    return qh / (qh.shape[-1] ** 0.5), kh, vh


@_impl("gated_delta_rule")
def gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                         beta_scale: float = 1.0, qk_l2norm: bool = True) -> torch.Tensor:
    """Gated delta rule for one token (linear attention with a decayed, delta-corrected state).

    Per value head h (key head ``h // (Hv/Hk)``): ``S <- S * exp(g_h)``;
    ``delta = (v_h - k̂ᵀS) * beta_h``; ``S <- S + k̂ ⊗ delta``; ``o_h = q̂ᵀS`` with k̂, q̂ the
    L2-normalised key / query (q̂ scaled by ``1/sqrt(dk)``).

    Args:
        q, k: [B,1,Hk*dk]; v: [B,1,Hv*dv]; a, b: [B,1,Hv] (``a_proj`` / ``b_proj`` outputs);
        A_log, dt_bias: [Hv]; state: [B,Hv,dk,dv] fp32, mutated.
        beta_scale: 2.0 when ``linear_allow_neg_eigval`` (beta in [0, 2]).

    Returns:
        o [B,1,Hv*dv] fp32 (before the output norm). Source: transformers 5.24
        ``modeling_olmo_hybrid.OlmoHybridGatedDeltaNet.forward`` (decode) and
        ``torch_recurrent_gated_delta_rule``.
    """
    beta, g = delta_gates(a, b, A_log, dt_bias, beta_scale)
    query, key, value = delta_qkv(q, k, v, num_k_heads, num_v_heads, head_k_dim, head_v_dim, qk_l2norm)
    beta, decay = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (beta, g)]
    out = torch.zeros_like(value)
    q_t, k_t, v_t = query[:, :, 0], key[:, :, 0], value[:, :, 0]
    s = state * decay[:, :, 0].exp()[..., None, None]
    kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta[:, :, 0].unsqueeze(-1)
    s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out[:, :, 0] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
    state.copy_(s)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1)


def delta_host_prep(q, k, a, b, A_log, dt_bias, num_k_heads: int, head_k_dim: int, beta_scale: float, qk_l2norm: bool = True):
    """The host half of the device mapping of ``gated_delta_rule`` (``nhil/compiler/lower_recurrent.py``), step 1:
    per key head ``q̂`` [Hk, dk] (L2-normed, / sqrt(dk)) and ``k̂`` [Hk, dk]; per value head ``decay = exp(g)`` and
    ``beta`` [Hv] (fp32, the reference kernel's ops on the key heads before their repeat)."""
    beta, g = delta_gates(a, b, A_log, dt_bias, beta_scale)
    qh, kh = q.reshape(num_k_heads, head_k_dim), k.reshape(num_k_heads, head_k_dim)
    if qk_l2norm:
        qh, kh = l2norm(qh), l2norm(kh)
    return qh / (head_k_dim ** 0.5), kh, g.reshape(-1).exp(), beta.reshape(-1)


def delta_host_update(v, kvm_raw, decay, beta, k_rows, s_t):
    """Step 2 of the device mapping: the new transposed state ``S'ᵀ`` [Hv, dv, dk] from the stored ``Sᵀ``, the PIM
    product ``kvm_raw = Sᵀ k̂`` [Hv, dv], ``v`` [Hv, dv], decay / beta [Hv] and ``k_rows`` = k̂ of each value head
    [Hv, dk]: ``kv_mem = kvm_raw * decay``, ``delta = (v - kv_mem) * beta``, ``S' = S * decay + delta ⊗ k̂`` (fp32)."""
    d = decay[:, None]
    delta = (v - kvm_raw * d) * beta[:, None]
    return s_t * d[..., None] + delta[..., None] * k_rows[:, None, :]


@_fake("concat")
def _concat_fake(xs):
    return xs[0].new_empty((*xs[0].shape[:-1], sum(x.shape[-1] for x in xs)))


@_fake("gated_delta_rule")
def _gdr_fake(q, k, v, a, b, A_log, dt_bias, state, num_k_heads, num_v_heads, head_k_dim, head_v_dim, beta_scale=1.0, qk_l2norm=True):
    return v.new_empty(v.shape)


@_fake("causal_conv1d_update")
def _conv_fake(x, conv_state, weight, bias, activation="silu", *, in_gate=None, out_gate=None):
    return torch.empty_like(x)


@_fake("ssm_state_update")
def _ssm_fake(x, dt, A_log, B, C, D, dt_bias, state, num_heads, head_dim, n_groups, state_size, decay="scalar_per_head"):
    return torch.empty_like(x)


@_fake("rms_norm_gated")
def _norm_gated_fake(x, gate, weight, eps, group_size, norm_before_gate=False):
    return torch.empty_like(x)


# ---------------------------------------------------------------- attribute checks (nhil.compiler.attr_checks)
from nhil.compiler.attr_checks import _at_least, _check, _positive  # noqa: E402


@_check("causal_conv1d_update")
def _conv_attrs(a: dict):
    if a["activation"] not in ACTIVATIONS:
        yield "activation", a["activation"], f"must be one of {sorted(ACTIVATIONS)}"
    w = a["weight"]
    if isinstance(w, torch.Tensor) and (w.dim() != 3 or w.shape[1] != 1 or w.shape[2] < 1):
        yield "weight", tuple(w.shape), "must be a depthwise conv weight [channels, 1, kernel >= 1]"


@_check("ssm_state_update")
def _ssm_attrs(a: dict):
    for n in ("num_heads", "head_dim", "n_groups", "state_size"):
        yield from _at_least(a, n, 1)
    h, g = a["num_heads"], a["n_groups"]
    if isinstance(h, int) and isinstance(g, int) and g >= 1 and h % g:
        yield "n_groups", g, f"must divide num_heads={h}"
    if a["decay"] not in DECAYS:
        yield "decay", a["decay"], f"must be one of {list(DECAYS)}"


@_check("rms_norm_gated")
def _norm_gated_attrs(a: dict):
    yield from _positive(a, "eps")
    yield from _at_least(a, "group_size", 1)
    w = a["weight"]
    if isinstance(w, torch.Tensor) and isinstance(a["group_size"], int) and a["group_size"] >= 1 and w.shape[-1] % a["group_size"]:
        yield "group_size", a["group_size"], f"must divide the width {w.shape[-1]}"


@_check("concat")
def _concat_attrs(a: dict):
    return iter(())


@_check("gated_delta_rule")
def _gdr_attrs(a: dict):
    for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
        yield from _at_least(a, n, 1)
    hk, hv = a["num_k_heads"], a["num_v_heads"]
    if isinstance(hk, int) and isinstance(hv, int) and hk >= 1 and hv % hk:
        yield "num_k_heads", hk, f"must divide num_v_heads={hv}"
    yield from _positive(a, "beta_scale")
