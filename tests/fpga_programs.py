"""Shared by the fpga test modules: a small program for the fpga-small device, a runner of its decode
steps, and the bit-for-bit comparison of two runs (outputs and SYNC trace)."""

from __future__ import annotations

import numpy as np

from nhil.compiler.builder import ProgramBuilder
from nhil.isa.device import DEVICE_PRESETS
from nhil.runtime.executor import Runner

DEV = DEVICE_PRESETS["fpga-small"]  # 2 channels x 16 banks x 1024 rows x 1024 cols


def program(seed=4):
    """Two GEMVs with host adds between (bank images, EXEC groups with readbacks, SYNCs), random weights."""
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(seed)
    n_out, n_in = 2 * DEV.slots + 5, 2 * DEV.cols + 24
    b.buffer("x", n_in)
    b.buffer("h", n_out)
    b.buffer("y", 40)
    b.host_image("x0", rng.normal(size=n_in).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w1", rng.normal(size=(n_out, n_in)).astype(np.float32)), "x", "h")
    b.host("add", ["h", "h"], ["h"])
    b.invalidate_gb()
    b.gemv(b.place_matrix("w2", rng.normal(size=(40, n_out)).astype(np.float32)), "h", "y")
    return b.finish({"inputs": {}, "outputs": {"y": "y", "h": "h"}}, {})


def run(prog, target, steps=3, runs=1):
    """(outputs of ``steps`` decode steps, SYNC trace) of the last of ``runs`` runs of one runner (every run after
    the first starts with ``reset``: a reload)."""
    r = Runner(prog, target)
    for _ in range(runs):
        r.reset()
        outs = [{k: v.copy() for k, v in r.step(s, s).items()} for s in range(steps)]
    return outs, target.trace()


def assert_identical(a, b):
    """Two ``run`` results are the same bits: every output of every step, and the trace."""
    (oa, ta), (ob, tb) = a, b
    assert len(oa) == len(ob)
    for x, y in zip(oa, ob):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].tobytes() == y[k].tobytes(), k
    assert ta == tb
