"""The handler context of exact raising: :class:`Ctx` (one region, its matched bindings,
emitting ``nhil::*`` nodes) and the constants every handler module shares.

Handlers live in ``raise_handlers`` (norms, embeddings, MLP, residuals, model glue),
``raise_attention`` (attention cores and their variants), ``raise_moe`` (MoE blocks) and
per-family modules (``raise_deepseek``); ``raise_patterns.raise_region`` offers a region to them
by its ATen ops (``PATTERNS``), then to the attention anchors and host ATen.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nhil.compiler.raise_match import Mismatch, match_any
from nhil.compiler.raising import Marker, Raiser, Region, _is_transparent

aten = torch.ops.aten
nhil = torch.ops.nhil
INT64_MAX = 9223372036854775807


class Ctx:
    """What a handler sees: the region, value lookup, emission into the new graph."""

    def __init__(self, raiser: Raiser, region: Region):
        self.r, self.region = raiser, region
        self.nodes, self.path = region.nodes, region.path
        self.members = set(region.nodes)
        self.created: list[fx.Node] = []
        self.set_keys: list[fx.Node] = []

    def match(self, patterns: list[list[tuple]]) -> dict:
        """Bindings of the first pattern matching the whole region exactly (raises Mismatch)."""
        return match_any(patterns, self.nodes, self.r.canon)[1]

    def value(self, old: fx.Node):
        """New-graph value (node or Marker) of an old node; parameters become get_attr."""
        old = self.r.canon(old)
        if old in self.r.env:
            return self.r.env[old]
        if old.op == "placeholder" and old.name in self.r.fqn:
            return self.param(old)
        raise Mismatch(self.nodes[0], f"input {old.name} comes from a region that was not raised")

    def param(self, old: fx.Node) -> fx.Node:
        """get_attr node (original state-dict name) for a parameter/buffer placeholder."""
        old = self.r.canon(old)
        if old.op != "placeholder" or old.name not in self.r.fqn:
            raise Mismatch(self.nodes[0], f"{old.name} should be a parameter or buffer")
        fqn = self.r.fqn[old.name]
        return self.r.get_attr(fqn, self.r.state_tensor(fqn))

    def const(self, name: str, tensor: torch.Tensor) -> fx.Node:
        """get_attr node for a constant folded out of the exported graph."""
        return self.r.get_attr(name, tensor)

    def marker(self, old: fx.Node, kind: str) -> Marker:
        v = self.value(old)
        if not isinstance(v, Marker) or v.kind != kind:
            raise Mismatch(self.nodes[0], f"input {old.name} is not a {kind}")
        return v

    def tensor(self, old: fx.Node) -> fx.Node:
        v = self.value(old)
        if not isinstance(v, fx.Node):
            raise Mismatch(self.nodes[0], f"input {old.name} is not a tensor of the graph IR")
        return v

    def emit(self, op, *args, **kwargs) -> fx.Node:
        """Append ``op(*args, **kwargs)`` to the new graph (kwargs: keyword-only schema attributes)."""
        n = self.r.g.call_function(op, tuple(args), kwargs or None)
        n.meta["nn_module_stack_path"] = self.path
        n.meta["stack_trace"] = self.nodes[-1].meta.get("stack_trace")
        self.created.append(n)
        return n

    def set(self, old: fx.Node, val) -> None:
        self.r.env[old] = val
        self.set_keys.append(old)

    # -- bookkeeping ----------------------------------------------------------
    def outside_users(self, n: fx.Node) -> list[fx.Node]:
        out, stack = [], list(n.users)
        while stack:
            u = stack.pop()
            if u in self.members:
                continue
            if _is_transparent(u):
                stack.extend(u.users)
            elif u.op != "call_function" or u in self.r.live:
                out.append(u)
        return out

    def check_outputs_mapped(self) -> None:
        for n in self.nodes:
            if n not in self.r.env and self.outside_users(n):
                raise Mismatch(n, f"{n.name} is used outside its region but the pattern does not produce it")

    def undo(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.r.g.erase_node(n)
        for k in self.set_keys:
            self.r.env.pop(k, None)
        self.created, self.set_keys = [], []
        self.__dict__.pop("_materialised", None)  # host ATen recomputations of Markers (host_aten.materialise)

    def fallback_aten(self) -> None:
        """Non-strict mode: copy the region's ATen nodes verbatim (when all inputs are real nodes)."""
        local: dict[fx.Node, fx.Node] = {}

        def look(a: fx.Node) -> fx.Node:
            a = self.r.canon(a)
            if a in local:
                return local[a]
            v = self.value(a)
            if not isinstance(v, fx.Node):
                raise Mismatch(a, "implicit value")
            return v

        try:
            for n in self.nodes:
                new = self.r.g.call_function(n.target, fx.node.map_arg(n.args, look), fx.node.map_arg(n.kwargs, look))
                new.meta["nn_module_stack_path"] = self.path
                new.meta["stack_trace"] = n.meta.get("stack_trace")
                self.created.append(new)
                local[n] = new
        except Mismatch:
            self.undo()
            return
        for n, new in local.items():
            self.set(n, new)


# ------------------------------------------------------------------ handlers


def _one(target, args, name="out", kwargs=None):
    return [(name, target, args, kwargs)]
