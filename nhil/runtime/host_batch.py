"""Host kernels of a prefill program called once for all prompt tokens, with the bits of one call per token.

A prefill program (``nhil.compiler.prefill``) runs each host call of the decode step for every prompt token in
a row: ``rms_norm`` of ``x@0`` .. ``x@T-1``, then the next unit. Called one by one, the ~15,000 host calls of a
64-token SmolLM2 prompt cost ~1.3 s of PyTorch call overhead on vectors of a few hundred elements. Here such a
*group* (same kernel, same attributes, the same shared inputs, no member reading another's output) is one
call of the same reference kernel on the tokens stacked as the sequence axis (``[1, T, n]``, which every
``torch.ops.nhil`` reference takes), and each token's row is written to its own output buffers.

Why the bits are a per-token call's bits (checked by ``tests/test_host_batch.py`` against the per-token kernels,
and by ``tests/test_prefill.py`` end to end), all on one intra-op thread (no range split across threads):

* IEEE-exact elementwise ops (``+ - * /``, ``sqrt``, negation, copies, ``cat``, ``masked_fill``, gathers) give
  the correctly rounded result on ATen's vectorised and scalar paths alike, so stacking cannot change them.
* Reductions over the last axis (``mean`` in ``rms_norm``, LayerNorm's row moments, ``softmax`` / ``max`` over
  keys) run row by row with the same loop over the row at any row count.
* Elementwise transcendentals (``exp`` in SiLU, ``tanh`` in GELU and soft-capping, ``cos`` / ``sin``) are not
  correctly rounded and ATen's vector code (SLEEF) and its scalar tail may differ in the last bit. A per-token
  call of ``n`` elements runs all of them on the vector path when ``n`` is a multiple of :data:`ALIGN` (ATen's
  unrolled vector step is 2 x 16 fp32 lanes on AVX-512, 2 x 8 on AVX2), and so does the stacked call, element
  for element; a group whose per-token size is not a multiple is called token by token
  (:func:`batch_reason` says why).

Not batched (called per token as before): kernels with their own data-dependent control (``moe_*``, recurrent
states, ``aten_graph`` regions, which may call BLAS), and anything not in :data:`BATCHED`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from nhil.errors import RunError
from nhil.runtime.host_kernels import _ops, masked_softmax_rows

ALIGN = 64  # per-token element count that keeps every element of a transcendental on ATen's vector path


def _stack(rows) -> torch.Tensor:
    """fp32 [T, n] of T host buffers of n elements each: a list of them, or their token rows (a float32 ``[T, n]``
    array, ``nhil.runtime.token_rows``: no copy; the reference kernels do not write their inputs)."""
    if isinstance(rows, np.ndarray):
        return torch.from_numpy(rows)
    return torch.from_numpy(np.stack([np.asarray(r, dtype=np.float32).reshape(-1) for r in rows]))


def _scatter(y: torch.Tensor, outs) -> None:
    """Row t of ``y`` (any shape with T leading rows once flattened to [T, -1]) into output buffer ``outs[t]``
    (a list of buffers, or their token rows: one copy)."""
    if isinstance(outs, np.ndarray):
        outs[...] = y.reshape(outs.shape[0], -1).numpy()
        return
    rows = y.reshape(len(outs), -1).numpy()
    for o, r in zip(outs, rows):
        o[:] = r


@dataclass(frozen=True)
class Batched:
    """How one host kernel runs for T tokens at once.

    Attributes:
        fn: ``fn(ins, outs, **attrs)``: ``ins[i]`` the list of T per-token values of input ``i`` (a shared input:
            its one value; T buffers that are token rows: their float32 ``[T, n]`` array), ``outs[j]`` the T output
            arrays of output ``j`` (or their ``[T, n]`` token rows).
        shared: input positions every token reads from the same buffer or image (weights, tables); the group
            must name the same one in every member.
        transcendental: per-token sizes (of the outputs; ``fn`` computes a transcendental over them) that must be
            multiples of :data:`ALIGN`; ``None``: only exact ops and row-wise reductions.
    """

    fn: Callable
    shared: tuple[int, ...] = ()
    transcendental: Callable[[dict, list[int]], bool] | None = None


def _outputs_aligned(attrs: dict, out_sizes: list[int]) -> bool:
    return all(n % ALIGN == 0 for n in out_sizes)


def _rms_norm(ins, outs, eps: float, head_dim: int | None = None, unit_offset: bool = False):
    x, w = ins
    T = len(x)
    _scatter(_ops().rms_norm(_stack(x).reshape(1, T, -1), torch.from_numpy(np.asarray(w, np.float32)), eps, head_dim, unit_offset), outs[0])


def _layer_norm(ins, outs, eps: float, has_weight: bool = True, has_bias: bool = True, width: int | None = None):
    x = _stack(ins[0])
    T = x.shape[0]
    it = iter(ins[1:])
    w = torch.from_numpy(np.asarray(next(it), np.float32)) if has_weight else None
    b = torch.from_numpy(np.asarray(next(it), np.float32)) if has_bias else None
    x = x.reshape(1, T, -1) if width is None else x.reshape(1, -1, width)
    _scatter(_ops().layer_norm(x, w, b, eps), outs[0])


def _rope(ins, outs, head_dim: int, rotary_dim: int | None = None, style: str = "rotate_half"):
    x, cos, sin = (_stack(v) for v in ins)
    T = x.shape[0]
    y = _ops().rope(x.reshape(1, T, -1), cos.reshape(1, T, -1), sin.reshape(1, T, -1), head_dim, rotary_dim, style=style)
    _scatter(y, outs[0])


def _rope_cos_sin(ins, outs, attention_scaling: float, half: bool = False):
    pos, inv_freq = ins
    cos, sin = _ops().rope_cos_sin(torch.tensor([list(pos)]), torch.from_numpy(np.asarray(inv_freq, np.float32)), attention_scaling, half=half)
    _scatter(cos, outs[0])
    _scatter(sin, outs[1])


def _embedding(ins, outs, scale: float | None = None):
    table, tokens = ins
    for tok in tokens:
        if not 0 <= tok < table.shape[0]:
            raise RunError(f"token id {tok} outside the vocabulary of {table.shape[0]}")
    _scatter(_ops().embedding(torch.from_numpy(np.asarray(table, np.float32)), torch.tensor([list(tokens)]), scale), outs[0])


def _pos_embedding(ins, outs):
    x, table, pos = ins
    for p in pos:
        if not 0 <= p < table.shape[0]:
            raise RunError(f"position {p} is beyond the {table.shape[0]} learned position embeddings (n_positions) of the model")
    xs = _stack(x)
    _scatter(_ops().pos_embedding(xs.reshape(1, xs.shape[0], -1), torch.from_numpy(np.asarray(table, np.float32)), torch.tensor([list(pos)])), outs[0])


def _binary(op: str):
    def fn(ins, outs, **attrs):
        a, b = (_stack(v) for v in ins)
        _scatter(getattr(_ops(), op)(a, b, **attrs), outs[0])

    return fn


def _unary(op: str):
    def fn(ins, outs, **attrs):
        _scatter(getattr(_ops(), op)(_stack(ins[0]), **attrs), outs[0])

    return fn


def _narrow(ins, outs, start: int, length: int):
    _scatter(_ops().narrow(_stack(ins[0]), start, length), outs[0])


def _masked_softmax(ins, outs, num_heads: int, max_len: int, scale: float, window: int | None = None, softcap: float | None = None, sinks: bool = False):
    """``host_kernels.masked_softmax`` of T tokens: scores [T, H, L], the mask of each token's own position."""
    s = _stack(ins[0]).reshape(len(ins[0]), num_heads, max_len)
    _scatter(masked_softmax_rows(s, ins[1], scale, window, softcap, ins[2] if sinks else None), outs[0])


def _softcap_aligned(attrs: dict, out_sizes: list[int]) -> bool:
    return attrs.get("softcap") is None or _outputs_aligned(attrs, out_sizes)


BATCHED: dict[str, Batched] = {
    "rms_norm": Batched(_rms_norm, shared=(1,)),
    "layer_norm": Batched(_layer_norm, shared=(1, 2)),
    "rope": Batched(_rope),
    "rope_cos_sin": Batched(_rope_cos_sin, shared=(1,), transcendental=_outputs_aligned),
    "embedding": Batched(_embedding, shared=(0,)),
    "pos_embedding": Batched(_pos_embedding, shared=(1,)),
    "add": Batched(_binary("add")),
    "silu_mul": Batched(_binary("silu_mul"), transcendental=_outputs_aligned),
    "gelu_mul": Batched(_binary("gelu_mul"), transcendental=_outputs_aligned),
    "gelu": Batched(_unary("gelu"), transcendental=_outputs_aligned),
    "softcap": Batched(_unary("softcap"), transcendental=_outputs_aligned),
    "narrow": Batched(_narrow),
    "masked_softmax": Batched(_masked_softmax, shared=(2,), transcendental=_softcap_aligned),
}


def batch_reason(kernel: str, attrs: dict, members: list[tuple[list[str], list[str]]], out_sizes: list[int]) -> str | None:
    """Why T host calls of ``kernel`` (``members``: each call's input and output names) cannot run as one, or None.

    Args:
        attrs: the kernel attributes (equal in every member: the caller groups by them).
        out_sizes: elements of each output of one member.
    """
    b = BATCHED.get(kernel)
    if b is None:
        return f"{kernel} has no batched form"
    if len(members) < 2:
        return "a single call"
    n_in = {len(i) for i, _ in members}
    if len(n_in) != 1:
        return "members take different input counts"
    for p in b.shared:
        if p < next(iter(n_in)) and len({i[p] for i, _ in members}) != 1:
            return f"input {p} is not shared by every member"
    written = {o for _, outs in members for o in outs}
    if any(n in written for ins, _ in members for n in ins):
        return "a member reads another's output"
    if b.transcendental is not None and not b.transcendental(attrs, out_sizes):
        return f"per-token sizes {out_sizes} are not multiples of {ALIGN} (a transcendental's vector/scalar split would change)"
    return None


def group_host_calls(program, segments: list[tuple[str, object]], host_token: list[int], sizes: dict[str, int]) -> list[tuple[str, object]]:
    """``segments`` of a prefill program's runner with each batchable run of host calls as one ``("hosts", [i..])``.

    A run is consecutive ``("host", i)`` segments of the same kernel and attributes for distinct prompt tokens
    (``host_token``), which :func:`batch_reason` accepts; everything else is kept as it was.

    Args:
        program: the prefill Program; segments: the runner's ``(kind, seg)`` list; host_token: host op -> token;
        sizes: buffer name -> elements (the outputs' per-token sizes).
    """
    out: list[tuple[str, object]] = []
    run: list[int] = []

    def flush():
        if len(run) > 1:
            h = program.host_ops[run[0]]
            members = [(list(program.host_ops[i].inputs), list(program.host_ops[i].outputs)) for i in run]
            if batch_reason(h.kernel, h.attrs, members, [sizes.get(n, 0) for n in h.outputs]) is None:
                out.append(("hosts", list(run)))
                run.clear()
                return
        out.extend(("host", i) for i in run)
        run.clear()

    for kind, seg in segments:
        if kind == "host":
            h = program.host_ops[seg]
            if run:
                h0 = program.host_ops[run[0]]
                same = (h.kernel == h0.kernel and h.attrs == h0.attrs and len(h.outputs) == len(h0.outputs)
                        and host_token[seg] not in {host_token[i] for i in run})
                if not same:
                    flush()
            if h.kernel in BATCHED:
                run.append(seg)
                continue
        flush()
        out.append((kind, seg))
    flush()
    return out
