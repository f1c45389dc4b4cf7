"""The cross-target check: a target that differs from the simulator is stopped at the first differing readback."""

import numpy as np
import pytest

from nhil.compiler.builder import ProgramBuilder
from nhil.isa import DEVICE_PRESETS
from nhil.runtime.executor import Runner
from nhil.targets.base import DelegatingTarget
from nhil.targets.lockstep import LockstepTarget, Mismatch
from nhil.targets.sim import SimTarget

DEV = DEVICE_PRESETS["rtl-tiny"]


def _program():
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(0)
    b.buffer("x", 32)
    b.buffer("y", 20)
    b.host_image("x0", rng.normal(size=32).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", rng.normal(size=(20, 32)).astype(np.float32)), "x", "y")
    return b.finish({"inputs": {}, "outputs": {"y": "y"}}, {})


class OffByOneUlpInBank5(DelegatingTarget):
    """A target whose bank 5 accumulator reads back one ulp high (a datapath bug)."""

    def execute(self, block):
        out = self.inner.execute(block)
        for o in out:
            if o.dtype == np.float32 and o.size > 5:
                o.view(np.uint32)[5] += 1
        return out


def test_identical_target_passes_and_counts_comparisons():
    t = LockstepTarget(SimTarget(device=DEV))
    r = Runner(_program(), t)
    r.reset()
    r.step(0, 0)
    ls = t.stats()["lockstep"]
    assert ls["first_mismatch"] is None and ls["readbacks_compared"] == 2 and ls["syncs_compared"] >= 1


def test_one_ulp_difference_is_caught_at_the_instruction_and_bank():
    t = LockstepTarget(OffByOneUlpInBank5(SimTarget(device=DEV)))
    r = Runner(_program(), t)
    r.reset()
    with pytest.raises(Mismatch) as e:
        r.step(0, 0)
    d = e.value.detail
    assert d["disasm"].startswith("RD_ACC") and d["bank"] == 5 and d["element"] == 5 and d["differing_elements"] == 1
    assert e.value.outcome == "MISMATCH"
