"""Differential check: raised graph IR vs the exported ATen program, bit for bit.

Both programs run on the same inputs from the same cache state (fresh copies on both
sides); logits must be ``torch.equal`` and, for decode, every updated KV cache too.
"""

from __future__ import annotations

from typing import Iterator

import torch

from nhil.errors import CompileError


def _state(ep: torch.export.ExportedProgram, name: str) -> torch.Tensor:
    return ep.state_dict[name] if name in ep.state_dict else ep.constants[name]


def _call_exported(ep, em, inputs):
    """Call the unlifted module with ``inputs`` substituted for the tensor leaves of
    ``ep.example_inputs`` (keeps constant kwargs such as ``use_cache=False``)."""
    leaves, spec = torch.utils._pytree.tree_flatten(ep.example_inputs)
    it = iter(inputs)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
    return em(*args, **kwargs)


def check_raised_exact(ep: torch.export.ExportedProgram, raised, inputs: tuple[torch.Tensor, ...], caches: dict[str, torch.Tensor] | None = None) -> None:
    """Run ``ep.module()`` and ``raised.gm`` on ``inputs`` and demand identical results.

    Args:
        ep: the exported program the graph was raised from.
        raised: :class:`nhil.compiler.raising.RaisedGraph` with a ``gm``.
        inputs: user inputs in order (prefill: ``(input_ids [1,S],)``; decode:
            ``(input_ids [1,1], cache_position [1])``, int64).
        caches: initial value per cache buffer name ([1,Hkv,L,hd] fp32); missing names
            start from the exported program's current buffer value. Copies are used; the
            buffers of both programs are restored afterwards.

    Raises:
        CompileError: logits or an updated cache differ (reports max abs difference).
    """
    caches = caches or {}
    em = ep.module()
    saved = []
    try:
        for name in raised.cache_names:
            init = caches.get(name, _state(ep, name)).detach()
            for mod in (em, raised.gm):
                buf = mod.get_buffer(name)
                saved.append((buf, buf.clone()))
                buf.copy_(init)
        with torch.no_grad():
            want = _call_exported(ep, em, inputs)
            got = raised.gm(*inputs)
        if hasattr(want, "logits"):
            want = want.logits
        want = want[0] if isinstance(want, (tuple, list)) else want
        if not (got.shape == want.shape and torch.equal(got, want)):
            diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            raise CompileError(f"raised {raised.kind} graph is not bit-identical to the exported program: logits differ (max |diff| {diff})")
        for name in raised.cache_names:
            a, b = em.get_buffer(name), raised.gm.get_buffer(name)
            if not torch.equal(a, b):
                raise CompileError(f"raised {raised.kind} graph is not bit-identical: cache {name} differs (max |diff| {(a - b).abs().max().item()})")
    finally:
        for buf, old in saved:
            buf.copy_(old)


def example_inputs(ep: torch.export.ExportedProgram, raised, seed: int = 0) -> Iterator[tuple[tuple, dict]]:
    """Default check cases: prefill -> 2 random prompts; decode -> (pos 0, zero caches) and
    (pos L//2, random caches). Yields ``(inputs, caches)``."""
    g = torch.Generator().manual_seed(seed)
    phs = {n.name: n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"}
    vocab = next(iter(ep.graph.find_nodes(op="output"))).args[0][0].meta["val"].shape[-1]
    ids_shape = tuple(phs["input_ids"].shape)
    if raised.kind == "prefill":
        for _ in range(2):
            yield (torch.randint(0, vocab, ids_shape, generator=g),), {}
        return
    L = raised.gm.get_buffer(raised.cache_names[0]).shape[2] if raised.cache_names else 1
    yield (torch.randint(0, vocab, ids_shape, generator=g), torch.tensor([0])), {n: torch.zeros_like(raised.gm.get_buffer(n)) for n in raised.cache_names}
    rand = {n: torch.randn(raised.gm.get_buffer(n).shape, generator=g) for n in raised.cache_names}
    yield (torch.randint(0, vocab, ids_shape, generator=g), torch.tensor([L // 2])), rand
