"""Positions and masks: the static-cache position, position ids and causal / sliding-window masks,
recognised by evaluating the model's own index arithmetic at every cache position.

Sources: transformers 5.24 ``integrations/executorch.py`` (the decode wrapper's
``cumulative_length.copy_(cache_position[0])``), ``masking_utils.py`` (``causal_mask_function``,
``sliding_window_causal_mask_function``, ``eager_mask``), ``models/gpt2/modeling_gpt2.py``
(GPT2Model positions and learned-position add).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nhil.compiler.raise_ctx import Ctx, _one, aten, nhil
from nhil.compiler.raise_match import Mismatch, V
from nhil.compiler.raising import Marker, _val

__all__ = ["h_static_cache_wrapper", "h_index_arith", "h_gpt2_model", "INDEX_OPS", "FLOAT_MASK_OPS"]


def h_static_cache_wrapper(ctx: Ctx) -> None:
    """``cumulative_length.copy_(cache_position[0])`` per layer -> Marker('cache_pos0')."""
    b = ctx.match([[("sel", aten.select.int, (V("cp"), 0, 0), None), ("copy", aten.copy_.default, (V("buf"), V("sel")), None)]])
    cp = b["cp"]
    if cp.op != "placeholder" or cp.name != "cache_position" or b["buf"].name not in ctx.r.fqn:
        raise Mismatch(ctx.nodes[0], "expected cumulative_length.copy_(cache_position[0])")
    ctx.set(b["copy"], Marker("cache_pos0", ctx.value(cp)))


def _is_position_ids(v) -> bool:
    """Whether graph-IR value ``v`` is the position ids :func:`h_index_arith` maps them to
    (decode: the ``cache_position`` input; prefill: the folded ``position_ids`` constant)."""
    return isinstance(v, fx.Node) and ((v.op == "placeholder" and v.target == "cache_position") or (v.op == "get_attr" and v.target == "position_ids"))


INDEX_OPS = {
    aten.arange.default, aten.arange.start, aten.add.Tensor, aten.sub.Tensor, aten.unsqueeze.default,
    aten.slice.Tensor, aten.diff.default, aten.ne.Scalar, aten.cumsum.default, aten.expand.default,
    aten.new_ones.default, aten.index.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor,
    aten.gt.Tensor, aten.eq.Tensor, aten.__and__.Tensor, aten.__or__.Tensor, aten.view.default, aten.select.int,
    aten.to.device, aten.to.dtype,  # a padding mask moved / cast (bool or int: floats are refused below)
}
# bool -> additive float mask (masking_utils.eager_mask: where(mask, 0, finfo.min))
FLOAT_MASK_OPS = {aten.zeros.default, aten.where.ScalarOther, aten.where.self, aten.scalar_tensor.default}


def _window_of(t: torch.Tensor, p: int) -> int | None:
    """Sliding window W implied by the last query row of mask ``t`` at cache position p (None: plain causal)."""
    q_last = p + t.shape[2] - 1
    row = t[0, 0, -1]
    vis = int(row.sum()) if row.dtype == torch.bool else int((row == 0).sum())
    return vis if vis < min(q_last + 1, t.shape[3]) else None


CONSTANT_FILLS = {aten.ones.default, aten.zeros.default, aten.full.default}


def _constant_of(a: fx.Node) -> torch.Tensor | None:
    """The value of ``a`` when it is a fill of constants only (the all-ones padding mask the
    export hands BioGPT-like models, ``nhil.compiler.export._positions_from_cache``), else None."""
    if a.op != "call_function" or a.target not in CONSTANT_FILLS or a.all_input_nodes:
        return None
    return a.target(*a.args, **a.kwargs)


def h_index_arith(ctx: Ctx) -> None:
    """Position ids and causal / sliding-window masks built by the Model / masking_utils.

    The region must be pure integer/bool arithmetic over constants and cache_position[0]
    (plus the bool -> additive-float conversion of eager attention); it is evaluated
    exhaustively (every cache position when it depends on one) and each output must equal
    a causal mask, optionally restricted to a sliding window W (``j > i - W``; W read off
    the mask and then checked at every position), bool or additive (0 / finfo.min),
    -> Marker('causal_mask', (kind, kv_len, window, additive)); or the position ids
    (decode: the ``cache_position`` input, S == 1; prefill: a folded constant
    ``position_ids``).
    """
    for n in ctx.nodes:
        v = _val(n)
        if not isinstance(v, torch.Tensor) or v.dtype.is_complex:
            raise Mismatch(n, "not integer/bool index arithmetic of a position or causal-mask pattern")
        if n.target in FLOAT_MASK_OPS:
            continue
        if n.target not in INDEX_OPS or v.dtype.is_floating_point:
            raise Mismatch(n, "not integer/bool index arithmetic of a position or causal-mask pattern")
    externals = []
    for n in ctx.nodes:
        for a in n.all_input_nodes:
            a = ctx.r.canon(a)
            if a not in ctx.members and a not in externals:
                externals.append(a)
    consts = {a: _constant_of(a) for a in externals}
    consts = {a: t for a, t in consts.items() if t is not None}
    externals = [a for a in externals if a not in consts]
    markers = [ctx.marker(a, "cache_pos0") for a in externals]
    outputs = [n for n in ctx.nodes if ctx.outside_users(n)]

    def evaluate(p: int) -> dict:
        vals = {a: torch.full(_val(a).shape, p, dtype=_val(a).dtype) for a in externals} | consts
        look = lambda a: vals[ctx.r.canon(a)]  # noqa: E731
        for n in ctx.nodes:
            vals[n] = n.target(*fx.node.map_arg(n.args, look), **fx.node.map_arg(n.kwargs, look))
        return vals

    positions = range(ctx.r.cache_len) if externals else [0]
    kinds: dict[fx.Node, str] = {}
    windows: dict[fx.Node, int | None] = {}
    if externals:  # read each mask's window at the last cache position, check it everywhere
        last = evaluate(ctx.r.cache_len - 1)
        for o in outputs:
            t = last[o]
            if t.dim() == 4 and t.shape[1] == 1 and (t.dtype == torch.bool or t.dtype.is_floating_point):
                windows[o] = _window_of(t, ctx.r.cache_len - 1)
    for p in positions:
        vals = evaluate(p)
        for o in outputs:
            t = vals[o]
            if t.dim() == 4 and t.shape[1] == 1 and (t.dtype == torch.bool or t.dtype == torch.float32):
                s, k = t.shape[2], t.shape[3]
                if o not in windows:
                    windows[o] = _window_of(t, p)
                from nhil.compiler.primitives import visible_mask

                want = visible_mask(p + torch.arange(s), k, windows[o])[None, None].expand(t.shape)
                if t.dtype == torch.float32:
                    want = torch.where(want, torch.zeros((), dtype=t.dtype), torch.finfo(t.dtype).min)
                ok = torch.equal(t, want) and (externals or k == s)
                kinds[o] = "mask"
            elif t.dtype == torch.int64 and t.dim() == 2 and t.shape[0] == 1:
                ok = torch.equal(t, p + torch.arange(t.shape[1])[None]) and (not externals or t.shape[1] == 1)
                kinds[o] = "pos"
            else:
                ok = False
            if not ok:
                raise Mismatch(o, f"{o.name} is not a causal / sliding-window mask or position ids (checked at cache position {p})")
    vals = evaluate(0)
    for o in outputs:
        t = vals[o]
        if kinds[o] == "mask":
            ctx.set(o, Marker("causal_mask", ("cache" if externals else "prefill", t.shape[3], windows[o], t.dtype.is_floating_point)))
        elif externals:
            ctx.set(o, markers[0].data)  # the cache_position input, [S] == [1]
        else:
            ctx.set(o, ctx.const("position_ids", t.clone()))


def h_gpt2_model(ctx: Ctx) -> None:
    """GPT2Model glue (modeling_gpt2.GPT2Model.forward): the shape-identity views
    ``input_ids.view(-1, S)`` and ``hidden.view(output_shape)`` (-> the input value), the
    learned-position add ``inputs_embeds + wpe(position_ids)`` (-> nhil.pos_embedding; the
    ``wpe`` lookup is a Marker from :func:`h_embedding`), and otherwise the position / mask
    index arithmetic (:func:`h_index_arith`)."""
    n = ctx.nodes[0]
    if len(ctx.nodes) == 1 and n.target == aten.view.default:
        b = ctx.match([_one(aten.view.default, (V("x"), V("shape")))])
        if tuple(_val(b["x"]).shape) != tuple(_val(b["out"]).shape):
            raise Mismatch(n, f"view {b['shape']} changes the shape {tuple(_val(b['x']).shape)}")
        ctx.set(b["out"], ctx.value(b["x"]))
        return
    if len(ctx.nodes) == 1 and n.target == aten.add.Tensor and isinstance(n.args[1], fx.Node) and isinstance(ctx.value(n.args[1]), Marker):
        b = ctx.match([_one(aten.add.Tensor, (V("x"), V("pe")))])
        table, pos = ctx.marker(b["pe"], "pos_embedding").data
        xv, pv = _val(b["x"]), _val(b["pe"])
        if not (xv.dtype == pv.dtype == torch.float32 and xv.dim() == 3 and tuple(xv.shape) == tuple(pv.shape)):
            raise Mismatch(n, f"position-embedding add needs two fp32 [B,S,H] tensors, got {tuple(xv.shape)} + {tuple(pv.shape)}")
        ctx.set(b["out"], ctx.emit(nhil.pos_embedding.default, ctx.tensor(b["x"]), table, pos))
        return
    h_index_arith(ctx)
