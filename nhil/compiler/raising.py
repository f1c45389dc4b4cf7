"""Raise an exported ATen program into the nhil graph IR (``torch.ops.nhil.*`` only).

Algorithm (linear in the number of nodes):

1. *Transparent* nodes are removed: ``aten._assert_tensor_metadata``, ``aten.alias``,
   ``aten.contiguous`` (a value identity: the graph IR has no strides) and
   casts/moves that do not change dtype or device (``aten.to.*`` identities, which alias
   their input in eager mode). Every argument is canonicalised through them.
2. Dead nodes (no path to the output or to an in-place op) are ignored.
3. The remaining ops are grouped into *regions*: connected components of ops that share
   the same innermost ``nn_module_stack`` entry (module path + class).
4. Regions are visited in dependency order, ties by graph order of their last node
   (``raise_regions.RegionPartition._topological``; convex pieces, a dropout between
   a parent's ops kept in its region). ``raise_patterns.raise_region`` offers each to the patterns
   whose anchor ops it contains (``PATTERNS``; module class names choose nothing), each
   checking the region's exact ATen op sequence and argument data flow (``raise_match``)
   or, for integer/bool index arithmetic (positions, causal masks), evaluating it
   exhaustively over every cache position; then to attention by its anchors
   (``raise_anchor``); then to host ATen (``host_aten``: the exported ops themselves, unless
   they are PIM-bound). A region nothing raises is *unraised*: reported, never approximated.
5. ``FakeTensorProp`` fills ``node.meta["val"]``; ``check.check_raised_exact`` runs both
   programs and demands bit-identical logits (and caches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from nhil.compiler import primitives  # noqa: F401  (registers torch.ops.nhil)
from nhil.compiler.raise_match import Mismatch
from nhil.compiler.raise_nodes import _is_transparent, _val, module_of, op_name, source_of
from nhil.compiler.raise_regions import Region, RegionPartition
from nhil.errors import CompileError

aten = torch.ops.aten
HINT = "docs/adding-an-architecture.md explains how to add a primitive and its pattern"


@dataclass
class UnraisedOp:
    """An ATen op the frontend could not raise: op name, module path, source ``file:line``, reason."""

    op: str
    module_path: str
    source: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.op} in module '{self.module_path}' at {self.source} ({self.reason})"


@dataclass
class RaisedGraph:
    """Result of :func:`raise_graph`.

    gm: graph IR (placeholders, get_attr of weights/inv_freq/caches by their original
        state-dict names, ``torch.ops.nhil.*`` calls, output = logits [B,S,V]); ``None`` if
        unraised ops made it impossible to build (non-strict mode only).
    counts: ``"nhil::<prim>" -> number of calls``.
    unraised: ops left as ATen (non-strict mode), first one first.
    host_aten: ``"aten.<op>.<overload>" -> count`` of the ops kept as host ATen regions
        (``nhil.compiler.host_aten``): the exported ops, run on the host as exported.
    raised_by: ``(module path, class, pattern)`` per region: which pattern raised it
        (``raise_patterns.PATTERNS``, ``"attention (anchors)"`` or ``"host ATen"``).
    """

    gm: fx.GraphModule | None
    kind: str
    counts: dict[str, int] = field(default_factory=dict)
    unraised: list[UnraisedOp] = field(default_factory=list)
    cache_names: list[str] = field(default_factory=list)
    host_aten: dict[str, int] = field(default_factory=dict)
    raised_by: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class Marker:
    """A value that exists only implicitly in the graph IR (e.g. 'causal mask', 'cache_position[0]')."""

    kind: str
    data: Any = None




class Raiser(RegionPartition):
    """One raising run over an ExportedProgram; see the module docstring."""

    def __init__(self, ep: torch.export.ExportedProgram, kind: str):
        self.ep, self.kind = ep, kind
        sig = ep.graph_signature
        self.fqn: dict[str, str] = {}
        self.fqn.update(sig.inputs_to_parameters)
        self.fqn.update(sig.inputs_to_buffers)
        self.fqn.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
        self.user_inputs = [u for u in sig.user_inputs if isinstance(u, str)]
        self.old = ep.graph
        self.index = {n: i for i, n in enumerate(self.old.nodes)}
        self.g = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.attrs: dict[str, torch.Tensor] = {}
        self.attr_nodes: dict[str, fx.Node] = {}
        self.unraised: list[UnraisedOp] = []
        self.failed: set[fx.Node] = set()
        self.cache_len = max([_val(n).shape[2] for n in self.old.nodes if n.op == "call_function" and n.target == aten.index_copy_.default] or [1])
        self.cache_names: list[str] = []
        self.raised_by: list[tuple[str, str, str]] = []  # (module path, class, pattern) per raised region

    # -- canonical values -------------------------------------------------------
    def canon(self, n: fx.Node) -> fx.Node:
        while _is_transparent(n):
            n = n.args[0]
        return n

    def state_tensor(self, fqn: str) -> torch.Tensor:
        if fqn in self.ep.state_dict:
            return self.ep.state_dict[fqn]
        return self.ep.constants[fqn]

    def get_attr(self, name: str, tensor: torch.Tensor) -> fx.Node:
        if name not in self.attr_nodes:
            if not isinstance(tensor, torch.nn.Parameter):
                tensor = tensor.clone()  # buffers (caches, inv_freq) are private to the graph IR
            self.attrs[name] = tensor
            node = self.g.get_attr(name)
            self.attr_nodes[name] = node
        return self.attr_nodes[name]

    def ir_val(self, node: fx.Node):
        """Fake value (shape, dtype) of a node of the graph IR being built, computed lazily with
        fake tensors and memoised (``None`` when it cannot be computed)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = self.__dict__.get("_fake_mode")
        if mode is None:
            mode = self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            self._ir_vals = {}
        if node in self._ir_vals:
            return self._ir_vals[node]
        val = None
        try:
            if node.op == "placeholder":
                val = mode.from_tensor(torch.zeros(node.meta["example_shape"], dtype=node.meta["example_dtype"]))
            elif node.op == "get_attr":
                val = mode.from_tensor(self.attrs[node.target])
            elif node.op == "call_function":
                look = lambda a: self.ir_val(a)  # noqa: E731
                args, kwargs = fx.node.map_arg(node.args, look), fx.node.map_arg(node.kwargs, look)
                with mode:
                    val = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a value that cannot be faked is reported as unknown
            val = None
        self._ir_vals[node] = val
        return val

    # -- driver (regions: nhil.compiler.raise_regions) -------------------------
    def run(self, strict: bool) -> RaisedGraph:
        from nhil.compiler.raise_ctx import Ctx
        from nhil.compiler.raise_patterns import raise_region

        for name in self.user_inputs:
            ph = self.g.placeholder(name)
            old = next(n for n in self.old.nodes if n.op == "placeholder" and n.name == name)
            self.env[old] = ph
            v = _val(old)
            ph.meta["example_shape"], ph.meta["example_dtype"] = tuple(v.shape), v.dtype
        for region in self.regions():
            ctx = Ctx(self, region)
            try:
                self.raised_by.append((region.path, region.cls, raise_region(ctx)))
            except Mismatch as m:
                self.record_unraised(region, m)
                ctx.undo()
                if not strict:
                    ctx.fallback_aten()
        # root causes first (not "input ... not raised"), then graph order
        self.unraised.sort(key=lambda u: ("not raised" in u.reason, u._index))  # type: ignore[attr-defined]
        if strict and self.unraised:
            u = self.unraised[0]
            more = f" (and {len(self.unraised) - 1} more)" if len(self.unraised) > 1 else ""
            raise CompileError(
                f"cannot raise {u.op} in module '{u.module_path}' at {u.source}: {u.reason}{more}. "
                f"Unsupported ops are never approximated; {HINT}."
            )
        outs = []
        for a in self.old.output_node().args[0]:
            v = self.env.get(self.canon(a))
            if not isinstance(v, fx.Node):
                return RaisedGraph(None, self.kind, self._counts(), self.unraised, self.cache_names, self._host_counts(), self.raised_by)
            outs.append(v)
        self.g.output(outs[0] if len(outs) == 1 else tuple(outs))
        from nhil.compiler.layer_outputs import decoder_layer_outputs

        for i, old in decoder_layer_outputs(self.old).items():  # act.model.layers.<i>: what the golden captures
            v = self.env.get(self.canon(old))
            if isinstance(v, fx.Node):
                v.meta["act"] = f"act.model.layers.{i}"
        for n in list(self.g.nodes):
            if n.op == "get_attr" and not n.users:
                self.g.erase_node(n)
                self.attrs.pop(n.target)
        # get_attr nodes first (after placeholders), for readability
        first = next((n for n in self.g.nodes if n.op != "placeholder"), None)
        for n in list(self.g.nodes):
            if n.op == "get_attr" and first is not None and n is not first:
                first.prepend(n)
        self.g.lint()
        gm = fx.GraphModule(_attr_root(self.attrs), self.g, class_name="NhilGraph")
        try:
            _fake_prop(gm)
        except Exception as e:  # noqa: BLE001 - a raised graph whose shapes do not propagate is a compiler defect, reported
            where = getattr(e, "__notes__", None) or [""]
            raise CompileError(f"the raised graph does not propagate shapes ({type(e).__name__}: {str(e)[:300]} {where[-1][:200]}); "
                               f"this is an nhil raising defect: please report it with the model") from None
        return RaisedGraph(gm, self.kind, self._counts(), self.unraised, self.cache_names, self._host_counts(), self.raised_by)

    def record_unraised(self, region: Region, m: Mismatch) -> None:
        n = m.node if m.node is not None else region.nodes[0]
        u = UnraisedOp(op_name(n), module_of(n)[0] or region.path, source_of(n), m.reason)
        u._index = self.index.get(n, 0)  # type: ignore[attr-defined]
        self.unraised.append(u)
        self.failed.update(region.nodes)

    def _host_counts(self) -> dict[str, int]:
        from nhil.runtime.aten_graph import op_name

        counts: dict[str, int] = {}
        for n in self.g.nodes:
            if n.op == "call_function" and "host_group" in n.meta:
                k = op_name(n.target)
                counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.g.nodes:
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "nhil":
                k = f"nhil::{n.target._opname}"
                counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))


def _attr_root(attrs: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding each attribute under its dotted name (buffers, cloned caches stay shared)."""
    root = torch.nn.Module()
    for name, t in attrs.items():
        mod = root
        *parents, leaf = name.split(".")
        for p in parents:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        if isinstance(t, torch.nn.Parameter):
            mod.register_parameter(leaf, t)
        else:
            mod.register_buffer(leaf, t)
    return root


def _fake_prop(gm: fx.GraphModule) -> None:
    """Set ``meta['val']`` on every node with fake tensors (FakeTensorProp over the graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_inputs = [mode.from_tensor(torch.zeros(n.meta["example_shape"], dtype=n.meta["example_dtype"])) for n in phs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)


def raise_graph(ep: torch.export.ExportedProgram, kind: str, strict: bool = True, check: bool = True) -> RaisedGraph:
    """Raise an exported Llama-family program into the nhil graph IR.

    Args:
        ep: from :func:`nhil.compiler.export.export_prefill` (``kind="prefill"``; user input
            ``input_ids`` [1,S] int64) or :func:`~nhil.compiler.export.export_decode`
            (``kind="decode"``; ``input_ids`` [1,1], ``cache_position`` [1] int64).
        strict: raise on the first unraised op; otherwise report them in ``unraised`` and
            keep those regions as ATen nodes in ``gm`` when possible.
        check: run :func:`nhil.compiler.check.check_raised_exact` on example inputs
            (prefill: two random prompts; decode: position 0 with empty caches and a middle
            position with random caches).

    Returns:
        :class:`RaisedGraph`.

    Raises:
        CompileError: unknown ``kind``; an unraised op (strict), naming op, module path and
            source ``file:line``; a primitive attribute outside its definition
            (:func:`nhil.compiler.attr_checks.check_attributes`: names attribute, value and
            module path); or the raised graph is not bit-identical.
    """
    if kind not in ("prefill", "decode"):
        raise CompileError(f"raise_graph kind must be 'prefill' or 'decode', got {kind!r}")
    raised = Raiser(ep, kind).run(strict)
    if raised.gm is not None:  # config attributes (soft-cap, window, head counts, ...) before anything runs
        from nhil.compiler.attr_checks import check_attributes

        check_attributes(raised.gm)
    if check and raised.gm is not None:
        from nhil.compiler.check import check_raised_exact, example_inputs

        for inputs, caches in example_inputs(ep, raised):
            check_raised_exact(ep, raised, inputs, caches)
    return raised
