"""The ``nhil`` torch library that every ``torch.ops.nhil.*`` primitive is defined in, its registration
helpers and the layout helpers the reference kernels share.

Each ``primitives_*`` module defines its schemas with :func:`define`, registers a reference kernel per op
with ``@_impl(name)`` (``CompositeExplicitAutograd``) and a fake kernel (shapes/dtypes only, for
``FakeTensorProp`` and export) with ``@_fake(name)``. ``nhil.compiler.primitives`` imports them all.

Layout convention: activations are token-major ``[B, S, features]``; multi-head tensors are flat with
heads concatenated (``[B, S, heads * head_dim]``), as fed to / produced by the q/k/v/o projections.
All float tensors are fp32.
"""

from __future__ import annotations

import torch

LIB = torch.library.Library("nhil", "DEF")  # noqa: the library object must stay alive


def define(schemas: dict[str, str]) -> tuple[str, ...]:
    """Define every schema of ``schemas`` (op name -> ``torch.library`` schema string) in :data:`LIB`.

    Returns:
        The op names, in the dict's order.

    Raises:
        RuntimeError: an op of that name is already defined (``torch.library``'s error).
    """
    for schema in schemas.values():
        LIB.define(schema)
    return tuple(schemas)


REFERENCE: dict = {}  # op name -> its reference kernel (the function torch.ops.nhil.<name> dispatches to)


def _impl(name):
    def deco(fn):
        torch.library.impl(f"nhil::{name}", "CompositeExplicitAutograd", lib=LIB)(fn)
        REFERENCE[name] = fn
        return fn

    return deco


def _fake(name):
    return torch.library.register_fake(f"nhil::{name}", lib=LIB)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B,S,n*hd] -> [B,n,S,hd] view (as LlamaAttention: view(..., -1, hd).transpose(1, 2))."""
    b, s, _ = x.shape
    return x.view(b, s, -1, head_dim).transpose(1, 2)


def _positions_2d(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [S] -> [1,S]; [B,S] unchanged."""
    return position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
