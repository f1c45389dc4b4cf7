"""Host buffers of a prefill program laid out as one row per prompt token.

A prefill program (``nhil.compiler.prefill``) holds each host tensor of the decode step once per prompt token,
named ``name@t``. :func:`token_rows` allocates the ``T`` copies of a tensor as the rows of one fp32 ``[T, n]``
array, so that a batched host call (``nhil.runtime.host_batch``) reads its ``T`` inputs as that array (no stacking
copy) and writes its outputs with one copy, and a block's readbacks land in a few block copies
(``nhil.runtime.readback_scatter``). Every buffer is still its own 1-d array (a row view), so every other reader and
writer of ``Runner.bufs`` is unchanged; only the layout differs, never a value.
"""

from __future__ import annotations

import numpy as np


def _token(name: str) -> tuple[str, int] | None:
    """``(base, t)`` of a buffer named ``base@t`` with ``t`` a decimal index as the prefill transform writes it (no sign,
    no leading zero: ``x@01`` is not token 1 of ``x``, so two names never share a row), else None."""
    base, at, t = name.rpartition("@")
    if not at or not t.isdigit() or t != str(int(t)):
        return None
    return base, int(t)


def token_rows(buffers: dict[str, int], tokens: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Zeroed host buffers, ``name@t`` for ``t < tokens`` as rows of one array.

    Args:
        buffers: buffer name -> element count (``Program.buffers``).
        tokens: the prompt tokens of the prefill program (``T``); 0 for a decode program (no rows).
    Returns:
        ``(bufs, rows)``: ``bufs`` name -> float32 ``[count]`` for every buffer (a row view where it has one);
        ``rows`` base name -> float32 ``[T, count]`` for each tensor whose ``T`` copies ``base@0 .. base@T-1`` all exist
        with one count.
    """
    by_base: dict[str, dict[int, int]] = {}
    if tokens > 1:
        for n, c in buffers.items():
            bt = _token(n)
            if bt is not None and bt[1] < tokens:
                by_base.setdefault(bt[0], {})[bt[1]] = int(c)
    rows: dict[str, np.ndarray] = {}
    for base, per in by_base.items():
        if len(per) == tokens and len(set(per.values())) == 1:
            rows[base] = np.zeros((tokens, per[0]), np.float32)
    bufs: dict[str, np.ndarray] = {}
    for n, c in buffers.items():
        r = row_of(n, rows)
        bufs[n] = r[0][r[1]] if r is not None else np.zeros(c, np.float32)
    return bufs, rows


def rows_of(names: list[str], rows: dict[str, np.ndarray]) -> np.ndarray | None:
    """The ``[T, n]`` array of :func:`token_rows` whose row ``t`` is buffer ``names[t]`` for every ``t``, or None when
    ``names`` are not ``base@0 .. base@T-1`` of one such array, in that order."""
    if not names:
        return None
    base = names[0].rpartition("@")[0]
    a = rows.get(base)
    if a is None or len(names) != a.shape[0] or any(n != f"{base}@{t}" for t, n in enumerate(names)):
        return None
    return a


def row_of(name: str, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, int] | None:
    """``(array, t)`` when buffer ``name`` is row ``t`` of a :func:`token_rows` array, else None."""
    bt = _token(name)
    a = rows.get(bt[0]) if bt is not None else None
    if a is None or bt[1] >= a.shape[0]:
        return None
    return a, bt[1]
