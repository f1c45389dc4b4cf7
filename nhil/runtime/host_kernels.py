"""Host kernels: the parts of a step that run on the host CPU, not in PIM.

Each kernel takes fp32 numpy views of host buffers/images and writes its outputs. Where
a graph-IR primitive exists, the kernel calls its reference kernel (``torch.ops.nhil``)
so host numerics are exactly the graph IR's. ``masked_softmax`` is the host half of
decode attention: ``softmax(scale * scores)`` over cache positions ``<= pos`` in fp32
(``torch.softmax``), positions beyond ``pos`` get probability exactly 0 — the same
computation SDPA does with a boolean causal mask.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nhil.errors import RunError

KERNELS: dict[str, Callable] = {}


def kernel(name: str):
    """Register a host kernel ``fn(inputs: list, outputs: list[np.ndarray], ctx: dict, **attrs)``."""

    def deco(fn):
        KERNELS[name] = fn
        return fn

    return deco


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32))


def _ops():
    import nhil.compiler.primitives  # noqa: F401  (registers torch.ops.nhil)

    return torch.ops.nhil


@kernel("embedding")
def embedding(inputs, outputs, ctx):
    table, token = inputs
    if not 0 <= token < table.shape[0]:
        raise RunError(f"token id {token} outside the vocabulary of {table.shape[0]}")
    outputs[0][:] = _ops().embedding(_t(table), torch.tensor([[token]])).reshape(-1).numpy()


@kernel("rms_norm")
def rms_norm(inputs, outputs, ctx, eps):
    x, w = inputs
    outputs[0][:] = _ops().rms_norm(_t(x).reshape(1, 1, -1), _t(w), eps).reshape(-1).numpy()


@kernel("rope_cos_sin")
def rope_cos_sin(inputs, outputs, ctx, attention_scaling):
    pos, inv_freq = inputs
    cos, sin = _ops().rope_cos_sin(torch.tensor([[pos]]), _t(inv_freq), attention_scaling)
    outputs[0][:] = cos.reshape(-1).numpy()
    outputs[1][:] = sin.reshape(-1).numpy()


@kernel("rope")
def rope(inputs, outputs, ctx, head_dim):
    x, cos, sin = inputs
    y = _ops().rope(_t(x).reshape(1, 1, -1), _t(cos).reshape(1, 1, -1), _t(sin).reshape(1, 1, -1), head_dim)
    outputs[0][:] = y.reshape(-1).numpy()


@kernel("silu_mul")
def silu_mul(inputs, outputs, ctx):
    g, u = inputs
    outputs[0][:] = _ops().silu_mul(_t(g), _t(u)).numpy()


@kernel("add")
def add(inputs, outputs, ctx):
    a, b = inputs
    outputs[0][:] = _ops().add(_t(a), _t(b)).numpy()


@kernel("masked_softmax")
def masked_softmax(inputs, outputs, ctx, num_heads, max_len, scale):
    scores, pos = inputs
    s = _t(scores).reshape(num_heads, max_len) * scale
    visible = torch.arange(max_len) <= pos
    s = s.masked_fill(~visible, float("-inf"))
    outputs[0][:] = torch.softmax(s, dim=-1).reshape(-1).numpy()
