"""Host ATen regions on the raise side: what nhil does not raise runs on the host as the
exported ATen ops themselves, never approximated, and never hiding PIM-bound work.

A region no pattern raises is copied into the graph IR op for op (:func:`emit_host`), tagged
``meta["host_group"]``; the lowering (``nhil.compiler.lower_host_aten``) turns each run of
tagged nodes into one ``aten_graph`` host op (``nhil.runtime.aten_graph``). The copy is the
exported computation, so the raised graph stays bit-identical to the exported one by
construction (and ``check.check_raised_exact`` still checks it).

What may not be a host region (:func:`pim_bound_reason`):

* a write into a buffer (a KV cache or a recurrent state): the device owns the caches;
* a matrix product (``linear``, ``mm``, ``bmm``, ``matmul``, ``addmm``, ``einsum``, ...) whose
  operand is a weight (a parameter of 2 or more dims) or reads a cache: that is a GEMV or an
  attention over the KV cache, PIM-bound by definition. An ``aten.linear`` whose weight is a
  parameter is raised to ``nhil::linear`` in place (a projection written inline in a module's
  forward), any other such product is a COMPILE_FAIL naming it.

Products over activations or small buffers only (RoPE's ``inv_freq @ positions``) stay host ATen.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from nhil.compiler.raise_match import Mismatch
from nhil.compiler.raising import Marker, _val
from nhil.runtime.aten_graph import dtype_name

aten = torch.ops.aten
nhil = torch.ops.nhil

PRODUCTS = {
    aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
    aten.baddbmm.default, aten.addbmm.default, aten.einsum.default, aten.dot.default, aten.mv.default,
    aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten._convolution.default,
    aten.scaled_dot_product_attention.default, aten.tensordot.default,
}


LAYOUT = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.detach.default, aten.repeat_interleave.self_int, aten.repeat.default,
    aten.index_copy_.default, aten.index_copy.default, aten.copy_.default, aten._to_copy.default, aten.to.dtype,
    aten.lift_fresh_copy.default, aten.unbind.int, aten.split.Tensor, aten.chunk.default,
    # gathers of weight rows (a MoE layer's ``gate_up_proj[expert_ids]``) still read the weight
    aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.take.default,
}


def _heavy_sources(raiser, node: fx.Node) -> set[str]:
    """State-dict names of the weights (params with >= 2 dims) and caches (mutated buffers) that
    ``node`` *is*, up to layout ops (views, transposes, slices, casts, repeat_kv, a cache write,
    gathers of rows):
    the operand of a product that makes it a GEMV or an attention over the cache."""
    mutated = raiser.__dict__.get("_mutated")
    if mutated is None:
        mutated = raiser._mutated = {raiser.canon(n.args[0]) for n in raiser.old.nodes if n.op == "call_function" and getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable and n.args and isinstance(n.args[0], fx.Node)}
    stack, out, seen = [node], set(), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            fqn = raiser.fqn.get(n.name)
            t = raiser.ep.state_dict.get(fqn) if fqn is not None else None
            if (isinstance(t, torch.nn.Parameter) and t.dim() >= 2) or (n in mutated and fqn is not None):
                out.add(fqn)
        elif n.op == "call_function" and (n.target in LAYOUT or n.target is operator.getitem):
            stack.extend(a for a in n.all_input_nodes[:1])
    return out


def _is_weight(raiser, a) -> bool:
    if not isinstance(a, fx.Node):
        return False
    a = raiser.canon(a)
    fqn = raiser.fqn.get(a.name) if a.op == "placeholder" else None
    t = raiser.ep.state_dict.get(fqn) if fqn is not None else None
    return isinstance(t, torch.nn.Parameter) and t.dim() == 2


def functional_form(raiser, n: fx.Node):
    """The out-of-place overload of an in-place op on a value computed in the graph (``w /= w.sum()``
    of a router), when that is the same computation: the mutated input is no buffer or input, and
    every other reader of it comes before the op. ``None`` otherwise."""
    name = getattr(getattr(n.target, "_schema", None), "name", "")
    if not (name.startswith("aten::") and name.endswith("_") and not name.endswith("__") and n.args and isinstance(n.args[0], fx.Node)):
        return None
    x = raiser.canon(n.args[0])
    if x.op != "call_function" or any(raiser.index[u] > raiser.index[n] for u in x.users if u is not n):
        return None
    packet = getattr(torch.ops.aten, name[len("aten::"):-1], None)
    op = getattr(packet, n.target._overloadname, None) if packet is not None else None
    return op if isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable else None


def pim_bound_reason(raiser, n: fx.Node) -> str | None:
    """Why ``n`` may not run as host ATen (a cache write, a GEMV or an attention over the cache), or None."""
    schema = getattr(n.target, "_schema", None)
    if schema is not None and schema.is_mutable and functional_form(raiser, n) is None:
        return f"{n.target} writes into a buffer (a KV cache or recurrent state the device owns); no nhil pattern raises this write"
    if n.target in PRODUCTS:
        heavy = sorted(set().union(*(_heavy_sources(raiser, a) for a in n.all_input_nodes)))
        if heavy:
            return (f"{n.target} reads {', '.join(heavy[:3])}{' ...' if len(heavy) > 3 else ''}: a GEMV or attention over the KV cache "
                    "is PIM-bound and may not run as host ATen, and no nhil pattern raises it")
    return None


def external_inputs(ctx, nodes: list[fx.Node]) -> list[fx.Node]:
    """Old-graph values the ``nodes`` read from outside them (canonical, first use first)."""
    members, out = set(nodes), []
    for n in nodes:
        for a in n.all_input_nodes:
            a = ctx.r.canon(a)
            if a not in members and a not in out:
                out.append(a)
    return out


def materialise(ctx, old: fx.Node) -> fx.Node:
    """The graph-IR tensor of old value ``old``: its raised node, a parameter, or, when it was
    raised to a Marker (a value the graph IR keeps implicit), the exported ops that computed
    it copied as host ATen (``cache_pos0``: ``cache_position[0]``).

    Raises:
        Mismatch: the value comes from an unraised region, or recomputing it would need a
            PIM-bound op or a buffer write.
    """
    old = ctx.r.canon(old)
    done = ctx.__dict__.setdefault("_materialised", {})
    if old in done:
        return done[old]
    v = ctx.r.env.get(old)
    if isinstance(v, fx.Node):
        return v
    if v is None and (old.op != "call_function" or old in ctx.r.failed or old in ctx.members):
        return ctx.tensor(old)  # a parameter, or the Mismatch naming the unraised region
    # a Marker, or a value internal to a raised region (a mask's bool form inside the Model region)
    if v is not None and not isinstance(v, Marker):
        raise Mismatch(ctx.nodes[0], f"input {old.name} is not a tensor of the graph IR")
    if isinstance(v, Marker) and v.kind == "cache_pos0":
        ov = _val(old)
        node = _emit(ctx, aten.select.int, (v.data, 0, 0), {}, old)
        if isinstance(ov, torch.Tensor) and ov.dim() == 1:
            node = _emit(ctx, aten.reshape.default, (node, list(ov.shape)), {}, old)
    else:
        if old.op != "call_function":
            raise Mismatch(ctx.nodes[0], f"input {old.name} cannot be recomputed on the host")
        linear = old.target == aten.linear.default and _is_weight(ctx.r, old.args[1])
        why = None if linear else pim_bound_reason(ctx.r, old)
        if why:
            raise Mismatch(old, f"recomputing {old.name} on the host: {why}")
        srcs = [materialise(ctx, a) for a in old.all_input_nodes]
        lookup = dict(zip([ctx.r.canon(a) for a in old.all_input_nodes], srcs))
        args = fx.node.map_arg(old.args, lambda a: lookup[ctx.r.canon(a)])
        kwargs = fx.node.map_arg(old.kwargs, lambda a: lookup[ctx.r.canon(a)])
        if linear:
            node = ctx.emit(nhil.linear.default, args[0], args[1], args[2] if len(args) > 2 else None)
        else:
            node = _emit(ctx, old.target, args, kwargs, old)
    _new_group(ctx)
    done[old] = node
    return node


def _new_group(ctx) -> None:
    ctx.r.host_group = getattr(ctx.r, "host_group", 0) + 1


def _emit(ctx, target, args, kwargs, old: fx.Node) -> fx.Node:
    """Append one host ATen node (a copy of ``old``) to the graph IR, in the current host group."""
    n = ctx.r.g.call_function(target, tuple(args), dict(kwargs) or None)
    n.meta["nn_module_stack_path"] = ctx.path
    n.meta["stack_trace"] = old.meta.get("stack_trace")
    n.meta["host_group"] = getattr(ctx.r, "host_group", 0)
    n.meta["host_source"] = old.name
    ctx.created.append(n)
    return n


def _exported_shape(ctx, new: fx.Node, old: fx.Node) -> fx.Node:
    """``new`` viewed in ``old``'s exported shape where the graph IR keeps a value in another
    shape (decode position ids [1, 1] are the ``cache_position`` input [1]; a per-head QK-norm
    primitive returns the flat projection [B, S, H*hd] of the exported [B, S, H, hd])."""
    ov = _val(old)
    nv = ctx.r.ir_val(new)
    shape = tuple(nv.shape) if isinstance(nv, torch.Tensor) else None
    if isinstance(ov, torch.Tensor) and shape is not None and shape != tuple(ov.shape) and math.prod(shape) == ov.numel():
        _new_group(ctx)
        new = _emit(ctx, aten.reshape.default, (new, list(ov.shape)), {}, old)
        _new_group(ctx)
    return new


def emit_host(ctx, nodes: list[fx.Node], done: dict | None = None) -> dict[fx.Node, fx.Node]:
    """Copy ``nodes`` (old graph, in graph order) into the graph IR as host ATen; ``aten.linear``
    over a weight parameter becomes ``nhil::linear`` (a GEMV on PIM).

    ``done``: old node -> new value already emitted (e.g. by an attention anchor); updated.
    Returns the old -> new map of the emitted nodes (also set in the raiser's env).

    Raises:
        Mismatch: a PIM-bound op (:func:`pim_bound_reason`), a value the spec cannot carry,
            or an input from an unraised region.
    """
    local: dict[fx.Node, fx.Node] = dict(done or {})
    # every op must be allowed before anything is emitted; a product over a weight or cache is named
    # before a cache write (it says what the region is: Bloom's ALiBi baddbmm, not StaticCache's index_copy_)
    nodes_checked = sorted(nodes, key=lambda n: n.target not in PRODUCTS)
    for n in nodes_checked:
        if n.target is operator.getitem or (n.target == aten.linear.default and _is_weight(ctx.r, n.args[1])):
            continue
        if not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "aten":
            raise Mismatch(n, f"{n.target} is neither an ATen op nor raised by an nhil pattern")
        why = pim_bound_reason(ctx.r, n)
        if why:
            raise Mismatch(n, why)
        v = _val(n)
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor):
                try:
                    dtype_name(t.dtype)
                except ValueError as e:
                    raise Mismatch(n, str(e)) from None
    ext = [a for a in external_inputs(ctx, nodes) if a not in local]
    for a in ext:  # Markers recomputed (in their own host groups) before this group starts
        local[a] = _exported_shape(ctx, materialise(ctx, a), a)
    _new_group(ctx)

    def look(a: fx.Node) -> fx.Node:
        return local[ctx.r.canon(a)]

    for n in nodes:
        if n.target == aten.linear.default and _is_weight(ctx.r, n.args[1]):
            x = look(n.args[0])
            bias = look(n.args[2]) if len(n.args) > 2 and n.args[2] is not None else None
            new = ctx.emit(nhil.linear.default, x, look(n.args[1]), bias)
            _new_group(ctx)
        else:
            target = functional_form(ctx.r, n) or n.target
            new = _emit(ctx, target, fx.node.map_arg(n.args, look), fx.node.map_arg(n.kwargs, look), n)
        local[n] = new
        ctx.set(n, new)
    _new_group(ctx)
    return local


def h_host_aten(ctx) -> None:
    """Fallback of every region no pattern raises: the region as host ATen (:func:`emit_host`).

    Raises:
        Mismatch: the region holds a PIM-bound op or reads a value the host cannot recompute.
    """
    emit_host(ctx, ctx.nodes)
