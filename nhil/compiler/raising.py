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
   (``Raiser._topological``). ``raise_patterns.raise_region`` offers each to the patterns
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

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from nhil.compiler import primitives  # noqa: F401  (registers torch.ops.nhil)
from nhil.compiler.raise_match import Mismatch
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


_TO_OPS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other}


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_transparent(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in (aten._assert_tensor_metadata.default, aten.alias.default, aten.contiguous.default):  # value identities
        return True
    if n.target in _TO_OPS or n.target == aten.type_as.default:
        a, v = _val(n.args[0]), _val(n)
        return isinstance(a, torch.Tensor) and isinstance(v, torch.Tensor) and a.dtype == v.dtype and a.device == v.device
    return False


def _is_mutating(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def source_of(n: fx.Node) -> str:
    """``file:line`` of the innermost frame in ``node.meta['stack_trace']`` ("unknown" if none)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else "unknown source"


def module_of(n: fx.Node) -> tuple[str, str]:
    """(module path, class name) of the innermost ``nn_module_stack`` entry; ('', '') if none."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return path, cls.rsplit(".", 1)[-1]


def _sandwiched_dropout(n: fx.Node, key: dict) -> tuple[str, str] | None:
    """The parent module's key for an eval-mode dropout submodule that its parent both feeds and reads
    (BERT's ``attention.self.dropout`` between the scores and the values product), so the parent's
    ops stay one region; None for any other op."""
    if n.target != torch.ops.aten.dropout.default or (len(n.args) > 2 and n.args[2]):
        return None
    src = n.args[0]
    while isinstance(src, fx.Node) and _is_transparent(src):
        src = src.args[0]
    if not isinstance(src, fx.Node) or src not in key:
        return None
    parent = key[src]
    users, stack = [], list(n.users)
    while stack:  # through identity casts (GPT-Neo casts the probabilities to the value dtype)
        u = stack.pop()
        if _is_transparent(u):
            stack.extend(u.users)
        elif u in key:
            users.append(u)
    if parent[0] and key[n][0].startswith(parent[0] + ".") and users and all(key[u] == parent for u in users):
        return parent
    return None


def op_name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_function" else f"{n.op} {n.target}"


class Region:
    """Ops of one module instance that form a connected component; ``nodes`` in graph order."""

    def __init__(self, path: str, cls: str, nodes: list[fx.Node]):
        self.path, self.cls, self.nodes = path, cls, nodes


class Raiser:
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

    # -- driver ---------------------------------------------------------------
    def live_nodes(self) -> set[fx.Node]:
        out = self.old.output_node()
        roots = [out] + [n for n in self.old.nodes if n.op == "call_function" and _is_mutating(n)]
        live, stack = set(), list(roots)
        while stack:
            n = stack.pop()
            if n in live:
                continue
            live.add(n)
            stack.extend(n.all_input_nodes)
        self.live = live
        return live

    def regions(self) -> list[Region]:
        live = self.live_nodes()
        ops = [n for n in self.old.nodes if n.op == "call_function" and n in live and not _is_transparent(n)]
        parent = {n: n for n in ops}

        def find(x):
            while parent[x] is not x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        key = {n: module_of(n) for n in ops}
        for n in ops:
            sandwiched = _sandwiched_dropout(n, key)
            if sandwiched is not None:
                key[n] = sandwiched
        for n in ops:
            for a in n.all_input_nodes:
                # follow identity casts only inside the same module (a residual taken from
                # the next norm's input cast must not glue two residual adds together)
                while _is_transparent(a) and module_of(a) == key[n]:
                    a = a.args[0]
                if a in parent and key[a] == key[n]:
                    parent[find(a)] = find(n)
        groups: dict[fx.Node, list[fx.Node]] = {}
        for n in ops:
            groups.setdefault(find(n), []).append(n)
        regs = [Region(*key[piece[0]], piece) for nodes in groups.values() for piece in self._convex_pieces(nodes)]
        regs.sort(key=lambda r: self.index[r.nodes[-1]])
        return self._topological(regs)

    def _topological(self, regs: list[Region]) -> list[Region]:
        """Regions in dependency order, ties (and independent regions) by their last node.

        The last-node order alone is not always a dependency order: GPT-2's prefill
        computes the position ids inside the Model's mask region, whose last node (the
        mask) comes after the ``wpe`` lookup that reads the positions. Kahn's algorithm
        with the last-node index as priority keeps the last-node order wherever it is
        already topological; a cyclic remainder keeps that order too. DeepSeek-V3 prefill needs
        it too: its ``kv_a_layernorm`` region reads the latent split of the attention region.
        """
        import heapq

        owner = {n: i for i, r in enumerate(regs) for n in r.nodes}
        deps: list[set[int]] = [set() for _ in regs]
        for i, r in enumerate(regs):
            for n in r.nodes:
                for a in n.all_input_nodes:
                    j = owner.get(self.canon(a))
                    if j is not None and j != i:
                        deps[i].add(j)
        users: list[list[int]] = [[] for _ in regs]
        for i, ds in enumerate(deps):
            for j in ds:
                users[j].append(i)
        pending = [len(ds) for ds in deps]
        ready = [i for i in range(len(regs)) if not pending[i]]  # indices are already in last-node order
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                pending[u] -= 1
                if not pending[u]:
                    heapq.heappush(ready, u)
        done = set(order)
        return [regs[i] for i in order] + [r for i, r in enumerate(regs) if i not in done]

    def _convex_pieces(self, nodes: list[fx.Node]) -> list[list[fx.Node]]:
        """Split a region where it depends on an outside op that itself depends on the region
        (e.g. OLMo-2's post-norm residual adds ``h1 = x + n(attn)``, ``h2 = h1 + n(mlp(h1))``:
        one connected component, but the MLP between them needs ``h1`` first)."""
        if len(nodes) < 2:
            return [nodes]
        members = set(nodes)
        pieces: list[list[fx.Node]] = [[]]
        cur: set[fx.Node] = set()
        for n in nodes:
            lo = min((self.index[m] for m in cur), default=self.index[n])
            if cur and any(self._depends_on(self.canon(a), cur, lo) for a in n.all_input_nodes if self.canon(a) not in members):
                pieces.append([])
                cur = set()
            pieces[-1].append(n)
            cur.add(n)
        return pieces

    def _depends_on(self, start: fx.Node, targets: set[fx.Node], lo: int) -> bool:
        stack, seen = [start], set()
        while stack:
            x = stack.pop()
            if x in targets:
                return True
            if x in seen or self.index[x] < lo:
                continue
            seen.add(x)
            stack.extend(x.all_input_nodes)
        return False

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
