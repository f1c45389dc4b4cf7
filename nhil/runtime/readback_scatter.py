"""A device block's readbacks copied into the host buffers in a few block copies instead of one slice each.

A 64-token SmolLM2 prefill reads back ~67,000 accumulator slices (one ``RD_ACC`` per row-group and token); copying
each into its buffer with a Python slice assignment costs ~1 µs apiece. When the target returns them end to end
in one array (:class:`nhil.targets.base.ReadbackRun`, the simulator's GEMV runs), :class:`ReadbackScatter` copies
them with one compiled loop of block copies per destination array (the ``[T, n]`` token rows of
``nhil.runtime.token_rows`` or a plain buffer), blocks that continue each other in both arrays merged. It is built
once per block and readback layout and gives exactly the per-readback copies' result
(``tests/test_readback_scatter.py``): each element lands where the per-readback copy puts it. A block that writes
one host element twice (where the copies' order would decide the value) is not scattered this way.
"""

from __future__ import annotations

import numpy as np

from nhil.runtime.token_rows import row_of


class ReadbackScatter:
    """Where a block's readbacks go: per destination array, its merged block copies ``(dst start, src start, count)``.

    Args:
        reads: per data-out instruction ``(buffer, offset, count, is RD_SBK)`` (``Runner._segment_plan``).
        spans: int64 ``[m, 2]`` where readback ``i`` lies in the flat array (``ReadbackRun.spans``).
        bufs: the runner's host buffers; rows: its token rows (``token_rows``).
    Raises:
        ValueError: the reads cannot be scattered this way (an RD_SBK, a readback shorter than its count, an element
            written twice); the caller copies readback by readback instead.
    """

    def __init__(self, reads: list[tuple], spans: np.ndarray, bufs: dict[str, np.ndarray], rows: dict[str, np.ndarray]) -> None:
        if len(reads) != spans.shape[0]:
            raise ValueError("one span per read")
        self.spans = spans
        blocks: dict[int, tuple[np.ndarray, list]] = {}  # id(buffer or token rows) -> (its 1-d view, [(dst start, src start, count)])
        for (buf, off, cnt, sbk), (o, e) in zip(reads, spans.tolist()):
            if sbk or cnt > e - o:
                raise ValueError(f"read of {buf} is not an fp32 readback of {cnt} elements")
            r = row_of(buf, rows)
            if r is None:
                key, at = bufs[buf], off
            else:
                key, at = r[0], r[1] * r[0].shape[1] + off
            if cnt:  # keyed by the runner's own arrays (which live as long as it does), not a temporary view
                d = blocks.get(id(key))
                if d is None:
                    d = blocks[id(key)] = (key.reshape(-1), [])
                d[1].append((at, o, cnt))
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []  # (1-d destination, int64 [k, 3] merged blocks)
        for arr, bl in blocks.values():
            b = np.array(sorted(bl), np.int64)  # by destination start
            if (b[1:, 0] < b[:-1, 0] + b[:-1, 2]).any():  # a block starts inside the one before it
                raise ValueError("a block writes one host element twice")
            merged = [list(b[0])]
            for at, o, n in b[1:].tolist():  # a block continuing the previous one in both arrays: one copy
                m = merged[-1]
                if m[0] + m[2] == at and m[1] + m[2] == o:
                    m[2] += n
                else:
                    merged.append([at, o, n])
            self.parts.append((arr, np.array(merged, np.int64)))

    def apply(self, flat: np.ndarray) -> None:
        """Copy every readback from ``flat`` (float32, laid out as ``spans``) into its buffer (one compiled loop of
        block copies per destination array)."""
        for arr, b in self.parts:
            _copy_blocks(arr, flat, b)


def _copy_blocks_py(dst, src, blocks):  # pragma: no cover - compiled by numba
    """``dst[a:a+n] = src[o:o+n]`` for each row ``(a, o, n)`` of ``blocks`` (int64 ``[k, 3]``)."""
    for i in range(blocks.shape[0]):
        a, o, n = blocks[i, 0], blocks[i, 1], blocks[i, 2]
        dst[a : a + n] = src[o : o + n]


try:
    from numba import njit

    _copy_blocks = njit(cache=True, nogil=True)(_copy_blocks_py)
except ImportError:  # pragma: no cover - numba is a dependency; the loop is then plain numpy
    _copy_blocks = _copy_blocks_py
