"""Raising of recurrent (state-space / linear-attention) layers: the state update recognised from its ATen ops.

The decode branch of a recurrent layer, as ``torch.export`` records it with nhil's
recurrent-state cache (``nhil.compiler.export_recurrent``), is a fixed op sequence around
two in-place state writes (``aten.copy_`` into ``conv_state_<i>`` / ``ssm_state_<i>``).
The patterns below are written as pieces that families share:

* :data:`CONV_UPDATE` — the short depthwise convolution over the rolling window
  (``cat(conv_state, xᵀ)``, ``copy_`` of the last K columns into the state,
  ``conv1d(groups=C)``, last position, SiLU) -> ``nhil::causal_conv1d_update``;
* :data:`SSM_SCALAR_DECAY` — the selective state update with one decay per head
  (softplus(dt + dt_bias), ``exp(dt*A)``, ``state*dA + (dt*B)x``, ``copy_``, ``bmm`` with C,
  ``+ D*x``) -> ``nhil::ssm_state_update``;
* :data:`GATED_RMS_NORM` — ``x * silu(gate)`` then grouped RMSNorm -> ``nhil::rms_norm_gated``.

A family whose layer is made of these pieces in another arrangement needs a new
concatenation, not new matching code. Every bound shape is checked against the state
buffers and parameters (heads, head_dim, groups, state size, kernel width), and the
raised graph is checked bit-exact against the export like every other region.

Sources: transformers 5.24 ``models/mamba2/modeling_mamba2.py`` (``Mamba2Mixer.forward``
recurrent form, ``causal_conv1d_update``, ``mamba2_selective_state_update``,
``MambaRMSNormGated``); ``models/falcon_h1/modeling_falcon_h1.py`` (``FalconH1Mixer``:
``mup_vector``, the gate inside the update when ``mamba_rms_norm`` is off).

Hook: ``RECURRENT_HANDLERS`` (with ``raise_delta.DELTA_HANDLERS``) is offered by
``raise_handlers.PATTERNS``; the keys only name the handlers. Gated DeltaNet layers:
``nhil/compiler/raise_delta.py``.
"""

from __future__ import annotations

import operator

import torch

from nhil.compiler.raise_ctx import INT64_MAX, Ctx, aten, nhil
from nhil.compiler.raise_match import Mismatch, V, match_any
from nhil.compiler.raising import _val

MAMBA2_SPLIT = [
    ("exp", aten.exp.default, (V("A_log"),), None),
    ("neg", aten.neg.default, (V("exp"),), None),
    ("split", aten.split_with_sizes.default, (V("zxbcdt"), [V("I"), V("CD"), V("H")], -1), None),
    ("gate", operator.getitem, (V("split"), 0), None),
    ("xbc", operator.getitem, (V("split"), 1), None),
    ("dt", operator.getitem, (V("split"), 2), None),
]

CONV_CORE = [  # the rolling-window depthwise conv over ``cin`` [B, C, 1] (channel-major)
    ("wsq", aten.squeeze.dim, (V("conv_w"), 1), None),
    ("cat", aten.cat.default, ([V("conv_state"), V("cin")], -1), None),
    ("win", aten.slice.Tensor, (V("cat"), 2, V("negK"), INT64_MAX), None),
    ("ccopy", aten.copy_.default, (V("conv_state"), V("win")), None),
    ("wun", aten.unsqueeze.default, (V("wsq"), 1), None),
    ("conv", aten.conv1d.default, (V("cat"), V("wun"), V("conv_b"), [1], [0], [1], V("CD")), None),
    ("last", aten.slice.Tensor, (V("conv"), 2, -1, INT64_MAX), None),
]

CONV_UPDATE = (  # Mamba-2: xBC transposed in, SiLU, transposed out
    [("cin", aten.transpose.int, (V("xbc"), 1, 2), None)]
    + CONV_CORE
    + [("act", aten.silu.default, (V("last"),), None), ("cout", aten.transpose.int, (V("act"), 1, 2), None)]
)

GATED_SHORT_CONV = (  # LFM2: in_proj -> B, C, x; conv over B*x; C * conv; no activation
    [("t", aten.transpose.int, (V("bcx"), -1, -2), None),
     ("chunk", aten.chunk.default, (V("t"), 3, -2), None),
     ("Bg", operator.getitem, (V("chunk"), 0), None),
     ("Cg", operator.getitem, (V("chunk"), 1), None),
     ("xg", operator.getitem, (V("chunk"), 2), None),
     ("cin", aten.mul.Tensor, (V("Bg"), V("xg")), None)]
    + CONV_CORE
    + [("y", aten.mul.Tensor, (V("Cg"), V("last")), None), ("out", aten.transpose.int, (V("y"), -1, -2), None)]
)

INLINE_SWIGLU = [  # LFM2 MLP body ``silu(w1 x) * w3 x`` with F.silu inline (no act_fn module)
    ("act", aten.silu.default, (V("g"),), None),
    ("out", aten.mul.Tensor, (V("act"), V("u")), None),
]

SSM_SCALAR_DECAY = [
    ("split2", aten.split_with_sizes.default, (V("cout"), [V("I"), V("GN"), V("GN")], -1), None),
    ("xs", operator.getitem, (V("split2"), 0), None),
    ("Bs", operator.getitem, (V("split2"), 1), None),
    ("Cs", operator.getitem, (V("split2"), 2), None),
    ("hs", aten.view.default, (V("xs"), [1, V("H"), V("hd")]), None),
    ("dtt", aten.transpose.int, (V("dt"), 1, 2), None),
    ("dte", aten.expand.default, (V("dtt"), [-1, -1, V("hd")]), None),
    ("a1", aten.unsqueeze.default, (V("neg"), 1), None),
    ("a2", aten.unsqueeze.default, (V("a1"), 2), None),
    ("ae", aten.expand.default, (V("a2"), [-1, V("hd"), V("N")]), None),
    ("Bv", aten.view.default, (V("Bs"), [1, V("G"), V("N")]), None),
    ("Cv", aten.view.default, (V("Cs"), [1, V("G"), V("N")]), None),
    ("d1", aten.unsqueeze.default, (V("D"), 1), None),
    ("de", aten.expand.default, (V("d1"), [-1, V("hd")]), None),
    ("b1", aten.unsqueeze.default, (V("dt_bias"), 1), None),
    ("be", aten.expand.default, (V("b1"), [-1, V("hd")]), None),
    ("dtb", aten.add.Tensor, (V("dte"), V("be")), None),
    ("sp", aten.softplus.default, (V("dtb"),), None),
    ("dt4", aten.unsqueeze.default, (V("sp"), 3), None),
    ("dtA", aten.mul.Tensor, (V("dt4"), V("ae")), None),
    ("dA", aten.exp.default, (V("dtA"),), None),
    ("Br", aten.reshape.default, (V("Bv"), [1, V("G"), 1, V("N")]), None),
    ("Bx", aten.expand.default, (V("Br"), [1, V("G"), V("HG"), V("N")]), None),
    ("Bh", aten.reshape.default, (V("Bx"), [1, V("H"), 1, V("N")]), None),
    ("dB", aten.mul.Tensor, (V("dt4"), V("Bh")), None),
    ("x4", aten.unsqueeze.default, (V("hs"), 3), None),
    ("dBx", aten.mul.Tensor, (V("dB"), V("x4")), None),
    ("sd", aten.mul.Tensor, (V("state"), V("dA")), None),
    ("new", aten.add.Tensor, (V("sd"), V("dBx")), None),
    ("scopy", aten.copy_.default, (V("state"), V("new")), None),
    ("Cr", aten.reshape.default, (V("Cv"), [1, V("G"), 1, V("N")]), None),
    ("Cx", aten.expand.default, (V("Cr"), [1, V("G"), V("HG"), V("N")]), None),
    ("Ch", aten.reshape.default, (V("Cx"), [1, V("H"), V("N")]), None),
    ("sv", aten.view.default, (V("new"), [V("H"), V("hd"), V("N")]), None),
    ("cv", aten.view.default, (V("Ch"), [V("H"), V("N"), 1]), None),
    ("bmm", aten.bmm.default, (V("sv"), V("cv")), None),
    ("yv", aten.view.default, (V("bmm"), [1, V("H"), V("hd")]), None),
    ("skip", aten.mul.Tensor, (V("hs"), V("de")), None),
    ("y", aten.add.Tensor, (V("yv"), V("skip")), None),
    ("out", aten.view.default, (V("y"), [1, 1, -1]), None),
]

MAMBA2_MIXER_DECODE = MAMBA2_SPLIT + CONV_UPDATE + SSM_SCALAR_DECAY


def _gated_in_mixer(ssm: list) -> list:
    """:data:`SSM_SCALAR_DECAY` with the output gate applied inside the mixer, ``y * silu(gate)`` per head (the
    ``z=gate.view(B, H, hd)`` of ``mamba2_selective_state_update`` when the mixer has no gated RMSNorm: Falcon-H1's
    ``mamba_rms_norm=False``); the head view of the gate is taken after the ``dt_bias`` expand."""
    at = next(i for i, st in enumerate(ssm) if st[0] == "be") + 1
    return (ssm[:at] + [("gv", aten.view.default, (V("gate"), [1, V("H"), V("hd")]), None)] + ssm[at:-1]
            + [("sg", aten.silu.default, (V("gv"),), None), ("gy", aten.mul.Tensor, (V("y"), V("sg")), None),
               ("out", aten.view.default, (V("gy"), [1, 1, V("I")]), None)])


# Falcon-H1: in_proj's output times the muP multipliers (``mup_vector`` buffer) before the split; gate inside
MAMBA2_MIXER_MUP_GATED = ([("mup", aten.mul.Tensor, (V("proj"), V("mup_vector")), None)] + MAMBA2_SPLIT[:2]
                          + [(n, t, (V("mup"),) + a[1:] if n == "split" else a, k) for n, t, a, k in MAMBA2_SPLIT[2:]]
                          + CONV_UPDATE + _gated_in_mixer(SSM_SCALAR_DECAY))

GATED_RMS_NORM = [
    ("sg", aten.silu.default, (V("gate"),), None),
    ("m", aten.mul.Tensor, (V("x"), V("sg")), None),
    ("grp", aten.view.default, (V("m"), [1, 1, V("ng"), V("gs")]), None),
    ("pow", aten.pow.Tensor_Scalar, (V("grp"), 2), None),
    ("mean", aten.mean.dim, (V("pow"), [-1], True), None),
    ("add", aten.add.Tensor, (V("mean"), V("eps")), None),
    ("rsqrt", aten.rsqrt.default, (V("add"),), None),
    ("mul", aten.mul.Tensor, (V("grp"), V("rsqrt")), None),
    ("flat", aten.view.default, (V("mul"), [1, 1, V("F")]), None),
    ("out", aten.mul.Tensor, (V("w"), V("flat")), None),
]



def _shape(ctx: Ctx, node, what: str) -> tuple:
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        raise Mismatch(ctx.nodes[0], f"{what} has no tensor value")
    return tuple(v.shape)


def _state(ctx: Ctx, old) -> torch.fx.Node:
    """get_attr of a state buffer (``conv_state_<i>`` / ``ssm_state_<i>``), recorded as a cache of the graph."""
    node = ctx.param(old)
    if node.target not in ctx.r.cache_names:
        ctx.r.cache_names.append(node.target)
    return node


def conv_update(ctx: Ctx, b: dict, x, activation: str = "silu", **gates) -> torch.fx.Node:
    """Emit ``nhil::causal_conv1d_update`` for a matched :data:`CONV_CORE` (channels ``CD``, kernel K);
    ``gates``: ``in_gate`` / ``out_gate`` graph-IR values (LFM2)."""
    cs, ws = _shape(ctx, b["conv_state"], "conv state"), _shape(ctx, b["conv_w"], "conv weight")
    k = cs[-1]
    if not (len(cs) == 3 and cs[0] == 1 and cs[1] == b["CD"] and ws == (b["CD"], 1, k) and b["negK"] == -k):
        raise Mismatch(ctx.nodes[0], f"short conv shapes do not fit: state {cs}, weight {ws}, window slice {b['negK']}, channels {b['CD']}")
    bias = ctx.param(b["conv_b"]) if b["conv_b"] is not None else None
    return ctx.emit(nhil.causal_conv1d_update.default, x, _state(ctx, b["conv_state"]), ctx.param(b["conv_w"]), bias, activation, **gates)


def h_mamba2_mixer(ctx: Ctx) -> None:
    """Mamba-2 mixer decode region -> narrow x3, ``causal_conv1d_update``, narrow x3, ``ssm_state_update``.

    The in_proj output ``zxbcdt`` is split into the gate (consumed by the gated norm's
    region, or inside the mixer: ``silu_mul(gate, y)``), the conv input ``xBC`` and ``dt``;
    the conv output into x, B, C. Falcon-H1's muP multiply of the in_proj output by its
    ``mup_vector`` buffer is host ATen (an elementwise product with a constant vector).
    """
    i, b = match_any([MAMBA2_MIXER_DECODE, MAMBA2_MIXER_MUP_GATED], ctx.nodes, ctx.r.canon)
    I, CD, H, hd, G, N, GN, HG = (b[k] for k in ("I", "CD", "H", "hd", "G", "N", "GN", "HG"))
    ss = _shape(ctx, b["state"], "SSM state")
    if not (all(isinstance(v, int) for v in (I, CD, H, hd, G, N, GN, HG)) and H * hd == I and G * N == GN and CD == I + 2 * GN
            and HG * G == H and ss == (1, H, hd, N)
            and all(_shape(ctx, b[p], p) == (H,) for p in ("A_log", "D", "dt_bias"))):
        raise Mismatch(ctx.nodes[0], f"Mamba-2 shapes do not fit: inner {I}, conv channels {CD}, heads {H} x {hd}, groups {G} x state {N}, state buffer {ss}")
    if i == 1:
        ms = _shape(ctx, b["mup_vector"], "muP vector")
        if not (ms and ms[-1] == I + CD + H and all(d == 1 for d in ms[:-1]) and ctx.r.canon(b["mup_vector"]).op == "placeholder"):
            raise Mismatch(ctx.nodes[0], f"muP multiplier of shape {ms} is not a constant per in_proj output ({I + CD + H})")
        from nhil.compiler.host_aten import emit_host

        z = emit_host(ctx, [b["mup"]])[b["mup"]]
    else:
        z = ctx.tensor(b["zxbcdt"])
    gate = ctx.emit(nhil.narrow.default, z, 0, I)
    xbc = ctx.emit(nhil.narrow.default, z, I, CD)
    dt = ctx.emit(nhil.narrow.default, z, I + CD, H)
    conv = conv_update(ctx, b, xbc)
    xs = ctx.emit(nhil.narrow.default, conv, 0, I)
    bs = ctx.emit(nhil.narrow.default, conv, I, GN)
    cs = ctx.emit(nhil.narrow.default, conv, I + GN, GN)
    y = ctx.emit(nhil.ssm_state_update.default, xs, dt, ctx.param(b["A_log"]), bs, cs, ctx.param(b["D"]), ctx.param(b["dt_bias"]),
                 _state(ctx, b["state"]), H, hd, G, N)
    if i == 1:
        ctx.set(b["out"], ctx.emit(nhil.silu_mul.default, gate, y))  # y * silu(gate): the same products, commuted
        return
    ctx.set(b["gate"], gate)
    ctx.set(b["out"], y)


def h_gated_rms_norm(ctx: Ctx) -> None:
    """``MambaRMSNormGated`` (gate applied before the norm) -> ``nhil::rms_norm_gated``."""
    b = ctx.match([GATED_RMS_NORM])
    F = b["F"]
    if not (isinstance(b["eps"], float) and isinstance(F, int) and b["ng"] * b["gs"] == F and _shape(ctx, b["w"], "norm weight") == (F,)):
        raise Mismatch(ctx.nodes[0], f"gated RMSNorm shapes do not fit: {b['ng']} groups x {b['gs']} vs width {F}")
    ctx.set(b["out"], ctx.emit(nhil.rms_norm_gated.default, ctx.tensor(b["x"]), ctx.tensor(b["gate"]), ctx.param(b["w"]), b["eps"], b["gs"]))


def h_gated_short_conv(ctx: Ctx) -> None:
    """LFM2 ``Lfm2ShortConv`` decode region -> narrow x3 of ``in_proj``'s output (B, C, x) and one
    ``causal_conv1d_update(x, ..., activation='none', in_gate=B, out_gate=C)``."""
    b = ctx.match([GATED_SHORT_CONV])
    CD = b["CD"]
    shp = _shape(ctx, b["bcx"], "in_proj output")
    if not (isinstance(CD, int) and shp == (1, 1, 3 * CD)):
        raise Mismatch(ctx.nodes[0], f"short-conv shapes do not fit: in_proj output {shp}, conv channels {CD}")
    z = ctx.tensor(b["bcx"])
    bg, cg, xg = (ctx.emit(nhil.narrow.default, z, i * CD, CD) for i in range(3))
    ctx.set(b["out"], conv_update(ctx, b, xg, "none", in_gate=bg, out_gate=cg))


def h_inline_swiglu(ctx: Ctx) -> None:
    """``silu(g) * u`` written inline in an MLP's forward -> ``nhil::silu_mul`` (same ops as its reference kernel)."""
    b = ctx.match([INLINE_SWIGLU])
    ctx.set(b["out"], ctx.emit(nhil.silu_mul.default, ctx.tensor(b["g"]), ctx.tensor(b["u"])))


def _residual(ctx: Ctx) -> None:
    from nhil.compiler.raise_handlers import h_residual  # raise_patterns imports this module

    h_residual(ctx)


def _wrapper(ctx: Ctx) -> None:
    """The recurrent-cache wrapper's ``cumulative_length.copy_(cache_position[0])`` (attention layers of a hybrid)."""
    from nhil.compiler.raise_positions import h_static_cache_wrapper

    h_static_cache_wrapper(ctx)


RECURRENT_HANDLERS = {
    "TorchExportableModuleWithRecurrentCache": _wrapper,
    "Mamba2Mixer": h_mamba2_mixer,
    "MambaRMSNormGated": h_gated_rms_norm,
    "Mamba2Block": _residual,
    "Lfm2ShortConv": h_gated_short_conv,
    "Lfm2MLP": h_inline_swiglu,
}

