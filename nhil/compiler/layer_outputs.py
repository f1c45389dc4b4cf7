"""Which value of the exported graph is each decoder layer's output, found from the graph itself.

The golden captures the output of every block of the decoder stack (``nhil.golden.decoder_stack``:
the ModuleList of the config's layer count, whatever it is called). A program names the same values
``act.model.layers.<l>`` so the accuracy tier can say where a run first diverges. Rather than
trusting a module name (``layers`` / ``h``) or the kind of the last op (a residual add; Gemma 4 ends
its layers with a scalar multiply), the layer's output is read off the exported graph: the decoder
stack is the outermost indexed module list in the ops' ``nn_module_stack`` (``<prefix>.<i>``, not
inside another indexed module) with the most blocks, and block ``i``'s output is its last op, in graph
order, whose value is read outside the block.
"""

from __future__ import annotations

import re

import torch.fx as fx

__all__ = ["decoder_layer_outputs"]

_INDEXED = re.compile(r"(.*)\.(\d+)")


def _paths(n: fx.Node) -> list[str]:
    return [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()]


def decoder_layer_outputs(graph: fx.Graph) -> dict[int, fx.Node]:
    """``{layer index: exported node}`` of each decoder block's output; {} when the graph has no indexed blocks.

    Args:
        graph: an exported (ATen) graph whose nodes carry ``nn_module_stack`` metadata.
    """
    ops = [n for n in graph.nodes if n.op == "call_function"]
    blocks: dict[str, set[int]] = {}
    for n in ops:
        for p in _paths(n):
            m = _INDEXED.fullmatch(p)
            if m and not re.search(r"\.\d+(\.|$)", m.group(1)):  # outermost: no index above it
                blocks.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not blocks:
        return {}
    prefix = max(blocks, key=lambda k: (len(blocks[k]), -len(k)))
    inside: dict[fx.Node, int] = {}
    for n in ops:
        for p in _paths(n):
            m = _INDEXED.fullmatch(p)
            if m and m.group(1) == prefix:
                inside[n] = int(m.group(2))
                break
    out: dict[int, fx.Node] = {}
    for n in ops:  # graph order: the last escaping node of a block wins
        i = inside.get(n)
        if i is not None and any(inside.get(u) != i for u in n.users):
            out[i] = n
    return dict(sorted(out.items()))
