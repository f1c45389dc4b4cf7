"""Scheduling passes change no result: simulator outputs bit-identical before/after on llama-tiny."""

from __future__ import annotations

import numpy as np
import pytest

from nhil.compiler.schedule import PASSES, apply_passes
from nhil.isa.instr import Op


@pytest.fixture(scope="module")
def tiny():
    from nhil.compile import compile_model

    return compile_model("llama-tiny")


def _run(prog, tokens):
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    r = Runner(prog, SimTarget())
    r.reset()
    outs = []
    for pos, t in enumerate(tokens):
        o = r.step(t, pos)
        outs.append({k: v.copy() for k, v in o.items()})
    return outs


@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_is_bit_identical_on_llama_tiny(tiny, name):
    after = apply_passes(tiny, [name])
    assert after.instrs != tiny.instrs  # the pass did something on this model
    assert sorted(i.op for i in after.instrs if i.op is not Op.WR_GB) == sorted(i.op for i in tiny.instrs if i.op is not Op.WR_GB)
    tokens = [3, 17, 42, 99, 5]
    a, b = _run(tiny, tokens), _run(after, tokens)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)), k


def test_gemv_batch_regroups_shared_input_gemvs(tiny):
    after = apply_passes(tiny, ["gemv-batch"])
    assert after.info["schedule"] == ["gemv-batch"]
    after.validate()
    # q, k, v of layer 0 (3 units, one input) now form one batch: three WR_ACC before the first MAC
    first_mac = next(i for i, ins in enumerate(after.instrs) if ins.op is Op.MAC_AB)
    assert sum(1 for ins in after.instrs[:first_mac] if ins.op is Op.WR_ACC) == 3


def test_pass_does_not_slow_the_modelled_step(tiny):
    from nhil.timing.report import analyze

    for inorder in (False, True):
        before = analyze(tiny, inorder=inorder)["cycles_per_token"]
        after = analyze(apply_passes(tiny, ["gemv-batch"]), inorder=inorder)["cycles_per_token"]
        assert after <= before
