"""Token-row buffers (nhil.runtime.token_rows) and the gathered readback copy (nhil.runtime.readback_scatter) against
the per-readback slice copies they replace, element for element."""

from __future__ import annotations

import numpy as np
import pytest

from nhil.runtime.readback_scatter import ReadbackScatter
from nhil.runtime.token_rows import row_of, rows_of, token_rows
from nhil.targets.base import ReadbackRun


def test_token_rows_share_one_array_per_complete_tensor():
    sizes = {"x@0": 5, "x@1": 5, "x@2": 5, "y@0": 3, "y@2": 3, "w@0": 2, "w@1": 4, "w@2": 2, "plain": 7}
    bufs, rows = token_rows(sizes, 3)
    assert set(rows) == {"x"}  # y lacks token 1, w's copies differ in size
    assert rows["x"].shape == (3, 5) and rows["x"].dtype == np.float32
    assert {n: b.size for n, b in bufs.items()} == sizes
    bufs["x@1"][2] = 7.5
    assert rows["x"][1, 2] == 7.5 and not rows["x"][[0, 2]].any()
    assert not np.shares_memory(bufs["y@0"], bufs["y@2"])
    assert rows_of(["x@0", "x@1", "x@2"], rows) is rows["x"]
    assert rows_of(["x@1", "x@0", "x@2"], rows) is None and rows_of(["x@0", "x@1"], rows) is None
    assert rows_of(["y@0", "y@1", "y@2"], rows) is None
    a, t = row_of("x@2", rows)
    assert a is rows["x"] and t == 2 and row_of("plain", rows) is None
    assert token_rows(sizes, 0)[1] == {}  # a decode program: no rows
    odd = {"z@0": 2, "z@1": 2, "z@01": 2}  # not the transform's spelling of token 1: its own buffer, no shared row
    bufs, rows = token_rows(odd, 2)
    assert set(rows) == {"z"} and row_of("z@01", rows) is None
    assert not np.shares_memory(bufs["z@01"], rows["z"])


def _loop_copy(bufs, reads, rbs):
    for (buf, off, cnt, _), data in zip(reads, rbs):
        bufs[buf][off : off + cnt] = data[:cnt]


@pytest.mark.parametrize("seed", range(5))
def test_scatter_equals_the_per_readback_copies(seed):
    rng = np.random.default_rng(seed)
    T, n = 4, 40
    sizes = {f"q@{t}": n for t in range(T)} | {"logits": 64, "h@0": 9}
    reads, spans, at = [], [], 0
    for buf, size in sizes.items():  # each buffer cut into random disjoint pieces, read in a shuffled order
        cuts = np.sort(rng.choice(np.arange(1, size), size=3, replace=False))
        for lo, hi in zip([0, *cuts], [*cuts, size]):
            reads.append((buf, int(lo), int(hi - lo), False))
    order = rng.permutation(len(reads))
    reads = [reads[i] for i in order]
    for _, _, cnt, _ in reads:
        extra = int(rng.integers(0, 3))  # a readback may be longer than the count the host keeps
        spans.append((at, at + cnt + extra))
        at += cnt + extra
    flat = rng.standard_normal(at).astype(np.float32)
    flat[::7] = np.float32("nan")
    spans = np.array(spans, np.int64)
    rbs = ReadbackRun(flat, spans)
    assert len(rbs) == len(reads) and all(np.array_equal(a, flat[o:e], equal_nan=True) for a, (o, e) in zip(rbs, spans))

    want, _ = token_rows(sizes, T)
    _loop_copy(want, reads, rbs)
    got, rows = token_rows(sizes, T)
    ReadbackScatter(reads, spans, got, rows).apply(flat)
    for name in sizes:
        assert np.array_equal(got[name].view(np.uint32), want[name].view(np.uint32)), name


def test_scatter_refuses_what_it_cannot_order():
    bufs, rows = token_rows({"a@0": 8, "a@1": 8}, 2)
    spans = np.array([(0, 4), (4, 8)], np.int64)
    with pytest.raises(ValueError, match="twice"):
        ReadbackScatter([("a@0", 0, 4, False), ("a@0", 2, 4, False)], spans, bufs, rows)
    with pytest.raises(ValueError, match="fp32 readback"):
        ReadbackScatter([("a@0", 0, 4, True), ("a@1", 0, 4, False)], spans, bufs, rows)
    with pytest.raises(ValueError, match="fp32 readback"):
        ReadbackScatter([("a@0", 0, 5, False), ("a@1", 0, 4, False)], spans, bufs, rows)
