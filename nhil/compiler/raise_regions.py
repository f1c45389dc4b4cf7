"""Regions of an exported graph: the ops of one module instance that form a connected component, cut
into convex pieces, in dependency order (the raiser offers each to the patterns).

A region's module path and class only name it in reports; they choose nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from nhil.compiler.raise_nodes import _is_mutating, _is_transparent, module_of

__all__ = ["Region", "RegionPartition"]


class Region:
    """Ops of one module instance that form a connected component; ``nodes`` in graph order."""

    def __init__(self, path: str, cls: str, nodes: list[fx.Node]):
        self.path, self.cls, self.nodes = path, cls, nodes


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


class RegionPartition:
    """The region methods of :class:`nhil.compiler.raising.Raiser` (``self.old``: the exported graph,
    ``self.index``: node -> position, ``self.canon``: through identity casts)."""

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
