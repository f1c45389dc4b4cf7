"""Raising of gated DeltaNet layers (linear attention with a delta-rule state): the decode step from its ATen ops.

One decode region holds the q/k/v short conv (:data:`raise_recurrent.CONV_UPDATE`), the
head views, the beta / decay gates and ``torch_recurrent_gated_delta_rule`` for one token;
it becomes ``nhil::causal_conv1d_update`` + ``nhil::gated_delta_rule``
(``primitives_recurrent``). The families differ only in how q, k, v (and the output
gate z, beta's b and the decay's a) come out of the input projections, so the pattern is
one function of that layout (:func:`gated_delta_decode`):

* ``"cat"`` — three projections joined by ``cat(q, k, v)`` before the conv
  (OLMo-hybrid ``OlmoHybridGatedDeltaNet``), head views by ``view``;
* ``"fused"`` — one ``in_proj_qkv`` whose output is the conv input (Qwen3.5
  ``Qwen3_5GatedDeltaNet``, LaRA-mini), head views by ``reshape``;
* ``"qkvz"`` — ``in_proj_qkvz`` / ``in_proj_ba`` laid out per key head
  (``[q_h, k_h, v_h.., z_h..]``, ``[b_h.., a_h..]``; Qwen3-Next
  ``fix_query_key_value_ordering``): the region's view / split / reshape / cat is a fixed
  column permutation, raised as ``nhil::narrow`` pieces joined by ``nhil::concat`` (copies:
  exact by construction); the conv then reads them in q, k, v order.

and by ``beta * 2`` (``linear_allow_neg_eigval``) and the key heads' ``repeat_interleave``
to the value heads. Per-head reshapes around the output norm pass as
``Marker('dn_heads', (flat value, head_v_dim))``. Every bound size is checked against the
state buffer and parameters; the region is checked bit-exact like every other.

Sources: transformers 5.24 ``models/olmo_hybrid/modeling_olmo_hybrid.py``,
``models/qwen3_5/modeling_qwen3_5.py``, ``models/qwen3_next/modeling_qwen3_next.py``
(``GatedDeltaNet.forward`` decode branch, ``torch_recurrent_gated_delta_rule``, ``l2norm``,
``RMSNormGated``).
"""

from __future__ import annotations

import operator

import torch

from nhil.compiler.raise_ctx import Ctx, aten, nhil
from nhil.compiler.raise_handlers import RMS_NORM
from nhil.compiler.raise_match import Mismatch, V, match_any
from nhil.compiler.raise_recurrent import CONV_UPDATE, _shape, _state, conv_update
from nhil.compiler.raising import Marker

LAYOUTS = ("cat", "fused", "qkvz")

QKVZ_SPLIT = [  # Qwen3-Next: per key head [q (dk), k (dk), v (rep*dv), z (rep*dv)] and [b (rep), a (rep)]
    ("qkvz4", aten.view.default, (V("qkvz"), [1, 1, V("Hk"), V("W")]), None),
    ("ba4", aten.view.default, (V("ba"), [1, 1, V("Hk"), V("Wba")]), None),
    ("sp1", aten.split_with_sizes.default, (V("qkvz4"), [V("dk"), V("dk"), V("RDV"), V("RDV")], 3), None),
    ("q_", operator.getitem, (V("sp1"), 0), None), ("k_", operator.getitem, (V("sp1"), 1), None),
    ("v_", operator.getitem, (V("sp1"), 2), None), ("z_", operator.getitem, (V("sp1"), 3), None),
    ("sp2", aten.split_with_sizes.default, (V("ba4"), [V("rep"), V("rep")], 3), None),
    ("b_", operator.getitem, (V("sp2"), 0), None), ("a_", operator.getitem, (V("sp2"), 1), None),
    ("v4", aten.reshape.default, (V("v_"), [1, 1, -1, V("dv")]), None),
    ("z4", aten.reshape.default, (V("z_"), [1, 1, -1, V("dv")]), None),
    ("bl", aten.reshape.default, (V("b_"), [1, 1, V("Hv")]), None),
    ("al", aten.reshape.default, (V("a_"), [1, 1, V("Hv")]), None),
    ("qf", aten.reshape.default, (V("q_"), [1, 1, -1]), None), ("kf", aten.reshape.default, (V("k_"), [1, 1, -1]), None),
    ("vf", aten.reshape.default, (V("v4"), [1, 1, -1]), None),
    ("xbc", aten.cat.default, ([V("qf"), V("kf"), V("vf")], -1), None),
]


def _l2norm(x: str, p: str) -> list:
    return [(f"{p}sq", aten.mul.Tensor, (V(x), V(x)), None), (f"{p}sum", aten.sum.dim_IntList, (V(f"{p}sq"), [-1], True), None),
            (f"{p}eps", aten.add.Tensor, (V(f"{p}sum"), 1e-6), None), (f"{p}rs", aten.rsqrt.default, (V(f"{p}eps"),), None),
            (f"{p}n", aten.mul.Tensor, (V(x), V(f"{p}rs")), None)]


def gated_delta_decode(neg_eigval: bool, grouped: bool, layout: str = "cat") -> list:
    """The gated DeltaNet decode region as one op sequence (module docstring).

    Args:
        neg_eigval: beta is ``sigmoid(b) * 2``.
        grouped: key heads ``repeat_interleave``d to the value heads.
        layout: one of :data:`LAYOUTS`: how q/k/v reach the conv.
    """
    head = {"cat": aten.view.default, "fused": aten.reshape.default, "qkvz": aten.reshape.default}[layout]
    source = {"cat": [("xbc", aten.cat.default, ([V("ql"), V("kl"), V("vl")], -1), None)], "fused": [], "qkvz": QKVZ_SPLIT}[layout]
    qk = ("qv", "kv") if not grouped else ("qr", "kr")
    return (
        source
        + CONV_UPDATE
        + [("split2", aten.split_with_sizes.default, (V("cout"), [V("KD"), V("KD"), V("VD")], -1), None),
           ("qs", operator.getitem, (V("split2"), 0), None), ("ks", operator.getitem, (V("split2"), 1), None),
           ("vs", operator.getitem, (V("split2"), 2), None),
           ("qv", head, (V("qs"), [1, 1, -1, V("dk")]), None), ("kv", head, (V("ks"), [1, 1, -1, V("dk")]), None),
           ("vv", head, (V("vs"), [1, 1, -1, V("dv")]), None),
           ("sig", aten.sigmoid.default, (V("bl"),), None)]
        + ([("beta", aten.mul.Tensor, (V("sig"), 2.0), None)] if neg_eigval else [])
        + [("aexp", aten.exp.default, (V("A_log"),), None), ("aneg", aten.neg.default, (V("aexp"),), None),
           ("adt", aten.add.Tensor, (V("al"), V("dt_bias")), None), ("sp", aten.softplus.default, (V("adt"),), None),
           ("g", aten.mul.Tensor, (V("aneg"), V("sp")), None)]
        + ([("qr", aten.repeat_interleave.self_int, (V("qv"), V("rep"), 2), None),
            ("kr", aten.repeat_interleave.self_int, (V("kv"), V("rep"), 2), None)] if grouped else [])
        + [("tq", aten.transpose.int, (V(qk[0]), 1, 2), None), ("tk", aten.transpose.int, (V(qk[1]), 1, 2), None),
           ("tv", aten.transpose.int, (V("vv"), 1, 2), None),
           ("tb", aten.transpose.int, (V("beta" if neg_eigval else "sig"), 1, 2), None), ("tg", aten.transpose.int, (V("g"), 1, 2), None)]
        + _l2norm("tq", "q") + _l2norm("tk", "k")
        + [("qd", aten.div.Tensor, (V("qn"), V("qscale")), None),
           ("zeros", aten.zeros_like.default, (V("tv"),), {"pin_memory": False}),
           ("q_t", aten.select.int, (V("qd"), 2, 0), None), ("k_t", aten.select.int, (V("kn"), 2, 0), None),
           ("v_t", aten.select.int, (V("tv"), 2, 0), None), ("g_t", aten.select.int, (V("tg"), 2, 0), None),
           ("dec", aten.exp.default, (V("g_t"),), None), ("d1", aten.unsqueeze.default, (V("dec"), 2), None),
           ("d2", aten.unsqueeze.default, (V("d1"), 3), None), ("sdec", aten.mul.Tensor, (V("state"), V("d2")), None),
           ("b_t", aten.select.int, (V("tb"), 2, 0), None), ("bu", aten.unsqueeze.default, (V("b_t"), -1), None),
           ("ku", aten.unsqueeze.default, (V("k_t"), -1), None), ("skm", aten.mul.Tensor, (V("sdec"), V("ku")), None),
           ("kvm", aten.sum.dim_IntList, (V("skm"), [-2]), None), ("dif", aten.sub.Tensor, (V("v_t"), V("kvm")), None),
           ("delta", aten.mul.Tensor, (V("dif"), V("bu")), None), ("ku2", aten.unsqueeze.default, (V("k_t"), -1), None),
           ("du", aten.unsqueeze.default, (V("delta"), -2), None), ("kd", aten.mul.Tensor, (V("ku2"), V("du")), None),
           ("snew", aten.add.Tensor, (V("sdec"), V("kd")), None), ("qu", aten.unsqueeze.default, (V("q_t"), -1), None),
           ("sq", aten.mul.Tensor, (V("snew"), V("qu")), None), ("o", aten.sum.dim_IntList, (V("sq"), [-2]), None),
           ("osel", aten.select.int, (V("zeros"), 2, 0), None), ("ocopy", aten.copy_.default, (V("osel"), V("o")), None),
           ("ot", aten.transpose.int, (V("zeros"), 1, 2), None), ("scopy", aten.copy_.default, (V("state"), V("snew")), None),
           ("out", aten.reshape.default, (V("ot"), [-1, V("dv")]), None)]
        + ([("zh", aten.reshape.default, (V("z4"), [-1, V("dv")]), None)] if layout == "qkvz" else [])
    )


VARIANTS = [(n, g, lay) for lay in LAYOUTS for n in (True, False) for g in (True, False)]
GATED_DELTA_DECODE = [gated_delta_decode(*v) for v in VARIANTS]

HEADS_RESHAPE = [("out", aten.reshape.default, (V("x"), V("shape")), None)]
HEADS_RESHAPE2 = [("mid", aten.reshape.default, (V("x"), V("shape1")), None), ("out", aten.reshape.default, (V("mid"), V("shape")), None)]

NORM_BEFORE_GATE = RMS_NORM[:5] + [  # RMSNorm's normalisation, then the weight and the silu gate
    ("wmul", aten.mul.Tensor, (V("w"), V("mul")), None),
    ("sg", aten.silu.default, (V("gate"),), None),
    ("out", aten.mul.Tensor, (V("wmul"), V("sg")), None),
]


def _heads_reshape(ctx: Ctx) -> None:
    """A region of one or two reshapes between flat ``[1, 1, H*dv]`` values and per-head rows ``[-1, dv]``
    (``[1, 1, -1|H, dv]`` in between): flat -> ``Marker('dn_heads')``, or a ``dn_heads`` Marker -> its flat value."""
    i, b = match_any([HEADS_RESHAPE, HEADS_RESHAPE2], ctx.nodes, ctx.r.canon)
    xv, shape = ctx.value(b["x"]), list(b["shape"])
    mid = list(b["shape1"]) if i == 1 else None
    if isinstance(xv, Marker) and xv.kind == "dn_heads" and shape == [1, 1, -1]:
        dv = xv.data[1]
        if mid is None or (len(mid) == 4 and mid[:2] == [1, 1] and mid[3] == dv):
            ctx.set(b["out"], xv.data[0])
            return
    if isinstance(xv, torch.fx.Node) and len(shape) == 2 and shape[0] == -1 and _shape(ctx, b["x"], "gate")[:2] == (1, 1):
        if mid is None or (len(mid) == 4 and mid[:2] == [1, 1] and mid[3] == shape[1]):
            ctx.set(b["out"], Marker("dn_heads", (xv, shape[1])))
            return
    raise Mismatch(ctx.nodes[0], f"a reshape to {shape} that is not a per-head view of a gated DeltaNet")


def _deinterleave(ctx: Ctx, x, hk: int, pieces: list[int]) -> list:
    """Columns of ``x`` [1, 1, hk * sum(pieces)] laid out per key head, gathered per piece: for piece j the
    ``nhil::narrow``s of every head's slice (head-major) -> list of lists of graph-IR values."""
    w, out = sum(pieces), []
    for j, n in enumerate(pieces):
        off = sum(pieces[:j])
        out.append([ctx.emit(nhil.narrow.default, x, h * w + off, n) for h in range(hk)])
    return out


def h_gated_delta_net(ctx: Ctx) -> None:
    """Gated DeltaNet decode region -> the q/k/v join, ``causal_conv1d_update``, narrow x3, ``gated_delta_rule``;
    its per-head reshapes become Marker('dn_heads', (flat value, dv)) and back (:func:`_heads_reshape`)."""
    if len(ctx.nodes) <= 2:
        _heads_reshape(ctx)
        return
    i, b = match_any(GATED_DELTA_DECODE, ctx.nodes, ctx.r.canon)
    neg_eigval, _grouped, layout = VARIANTS[i]
    KD, VD, dk, dv = b["KD"], b["VD"], b["dk"], b["dv"]
    ss = _shape(ctx, b["state"], "recurrent state")
    hk, hv = (KD // dk, VD // dv) if isinstance(dk, int) and isinstance(dv, int) and dk and dv else (0, 0)
    rep = b.get("rep", 1)
    if not (hk * dk == KD and hv * dv == VD and hk * rep == hv and ss == (1, hv, dk, dv) and b["qscale"] == dk ** 0.5
            and _shape(ctx, b["A_log"], "A_log") == (hv,) and _shape(ctx, b["dt_bias"], "dt_bias") == (hv,)
            and b["CD"] == 2 * KD + VD):
        raise Mismatch(ctx.nodes[0], f"gated DeltaNet shapes do not fit: q/k {KD} = {hk} x {dk}, v {VD} = {hv} x {dv}, repeat {rep}, "
                                     f"state {ss}, query scale {b['qscale']}")
    if layout == "cat":
        qkv = ctx.emit(nhil.concat.default, [ctx.tensor(b["ql"]), ctx.tensor(b["kl"]), ctx.tensor(b["vl"])])
        a_in, b_in = ctx.tensor(b["al"]), ctx.tensor(b["bl"])
    elif layout == "fused":
        if _shape(ctx, b["xbc"], "in_proj_qkv output") != (1, 1, b["CD"]):
            raise Mismatch(ctx.nodes[0], f"fused q/k/v projection is not [1, 1, {b['CD']}]")
        qkv, a_in, b_in = ctx.tensor(b["xbc"]), ctx.tensor(b["al"]), ctx.tensor(b["bl"])
    else:
        rdv = rep * dv
        if not (b["Hk"] == hk and b["RDV"] == rdv and b["W"] == 2 * dk + 2 * rdv and b["Wba"] == 2 * rep and b["Hv"] == hv
                and _shape(ctx, b["qkvz"], "in_proj_qkvz output") == (1, 1, hk * b["W"])
                and _shape(ctx, b["ba"], "in_proj_ba output") == (1, 1, hk * b["Wba"])):
            raise Mismatch(ctx.nodes[0], f"q/k/v/z layout per key head does not fit: {b['Hk']} heads x {b['W']}, b/a {b['Wba']}")
        q, k, v, z = _deinterleave(ctx, ctx.tensor(b["qkvz"]), hk, [dk, dk, rdv, rdv])
        bs, as_ = _deinterleave(ctx, ctx.tensor(b["ba"]), hk, [rep, rep])
        qkv = ctx.emit(nhil.concat.default, q + k + v)
        b_in, a_in = ctx.emit(nhil.concat.default, bs), ctx.emit(nhil.concat.default, as_)
        ctx.set(b["zh"], Marker("dn_heads", (ctx.emit(nhil.concat.default, z), dv)))
    conv = conv_update(ctx, b, qkv)
    q, k, v = (ctx.emit(nhil.narrow.default, conv, s, n) for s, n in ((0, KD), (KD, KD), (2 * KD, VD)))
    o = ctx.emit(nhil.gated_delta_rule.default, q, k, v, a_in, b_in, ctx.param(b["A_log"]), ctx.param(b["dt_bias"]),
                 _state(ctx, b["state"]), hk, hv, dk, dv, 2.0 if neg_eigval else 1.0)
    ctx.set(b["out"], Marker("dn_heads", (o, dv)))


def h_norm_before_gate(ctx: Ctx) -> None:
    """Gated DeltaNet output norm ``w * rmsnorm(x) * silu(gate)`` over per-head views -> ``rms_norm_gated(norm_before_gate=True)``."""
    b = ctx.match([NORM_BEFORE_GATE])
    xv, gv = ctx.value(b["x"]), ctx.value(b["gate"])
    if not (isinstance(xv, Marker) and xv.kind == "dn_heads" and isinstance(gv, Marker) and gv.kind == "dn_heads"
            and xv.data[1] == gv.data[1] and isinstance(b["eps"], float) and _shape(ctx, b["w"], "norm weight") == (xv.data[1],)):
        raise Mismatch(ctx.nodes[0], "a norm-before-gate RMSNorm whose inputs are not per-head views of one width")
    dv = xv.data[1]
    y = ctx.emit(nhil.rms_norm_gated.default, xv.data[0], gv.data[0], ctx.param(b["w"]), b["eps"], dv, True)
    ctx.set(b["out"], Marker("dn_heads", (y, dv)))


DELTA_HANDLERS = {
    "OlmoHybridGatedDeltaNet": h_gated_delta_net,
    "OlmoHybridRMSNormGated": h_norm_before_gate,
}
