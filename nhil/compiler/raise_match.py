"""Exact pattern matching of an ATen node sequence, with unification of arguments.

A pattern is a list of steps ``(name, target, args, kwargs)``. It matches a region (a list
of fx nodes in graph order) iff the region has exactly one node per step, with the same
ATen overload, in the same order, and every argument unifies:

* ``V("x")`` binds ``x`` on first sight and must be the same node/value afterwards (each
  step's own ``name`` is bound to its node, so later steps refer to it with ``V(name)``);
* ``ANY`` matches anything (used for ``device=``/``pin_memory=`` kwargs);
* lists/tuples/dicts match element-wise (dicts: same keys);
* anything else is a literal compared with ``==``.

Node arguments are canonicalised first (identity casts/aliases removed, see
``raising._canon``). The technique is classic first-order unification as in
torch.fx's ``SubgraphMatcher``, restricted to a fixed node order so it is linear-time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx


@dataclass(frozen=True)
class V:
    """A pattern variable."""

    name: str


class _Any:
    def __repr__(self):
        return "ANY"


ANY = _Any()


class Mismatch(Exception):
    """A region does not match: ``node`` is the first offending node, ``reason`` says why."""

    def __init__(self, node: fx.Node | None, reason: str, matched: int = 0):
        super().__init__(reason)
        self.node = node
        self.reason = reason
        self.matched = matched


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def unify(pat: Any, act: Any, env: dict, canon: Callable[[fx.Node], fx.Node]) -> bool:
    """Unify pattern ``pat`` with actual argument ``act``, extending ``env``; True on success."""
    if isinstance(act, fx.Node):
        act = canon(act)
    if pat is ANY:
        return True
    if isinstance(pat, V):
        if pat.name in env:
            return _same(env[pat.name], act)
        env[pat.name] = act
        return True
    if isinstance(pat, (list, tuple)):
        return isinstance(act, (list, tuple)) and len(pat) == len(act) and all(unify(p, a, env, canon) for p, a in zip(pat, act))
    if isinstance(pat, dict):
        return isinstance(act, dict) and set(pat) == set(act) and all(unify(pat[k], act[k], env, canon) for k in pat)
    if isinstance(act, fx.Node):
        return False
    return _same(pat, act)


def match_sequence(steps: list[tuple], nodes: list[fx.Node], canon: Callable[[fx.Node], fx.Node]) -> dict:
    """Match ``nodes`` against ``steps`` exactly; return the bindings.

    Raises:
        Mismatch: first differing node (wrong op, wrong argument, or wrong length).
    """
    env: dict = {}
    for i, (name, target, args, kwargs) in enumerate(steps):
        if i >= len(nodes):
            raise Mismatch(nodes[-1] if nodes else None, f"region ends early: expected {target} next", i)
        n = nodes[i]
        if n.target != target:
            raise Mismatch(n, f"expected {target}, found {n.target}", i)
        if not unify(V(name), n, env, canon):
            raise Mismatch(n, f"{n.name} does not fit pattern step '{name}'", i)
        if not unify(tuple(args), tuple(n.args), env, canon):
            raise Mismatch(n, f"arguments of {n.name} {n.args} do not fit {args}", i)
        if not unify(kwargs if kwargs is not None else {}, dict(n.kwargs), env, canon):
            raise Mismatch(n, f"keyword arguments of {n.name} {dict(n.kwargs)} do not fit {kwargs}", i)
    if len(nodes) > len(steps):
        raise Mismatch(nodes[len(steps)], f"unexpected extra op {nodes[len(steps)].target}", len(steps))
    return env


def match_any(patterns: list[list[tuple]], nodes: list[fx.Node], canon) -> tuple[int, dict]:
    """Try each pattern; return (index, bindings) of the first that matches.

    Raises:
        Mismatch: of the pattern that matched the longest prefix.
    """
    best: Mismatch | None = None
    for i, steps in enumerate(patterns):
        try:
            return i, match_sequence(steps, nodes, canon)
        except Mismatch as m:
            if best is None or m.matched > best.matched:
                best = m
    assert best is not None
    raise best
