"""``SimTarget.reload``: a second run of the same program restores only the rows the first run wrote, and the
state it leaves is the state a fresh ``load`` gives, bit for bit (``Target.reload``'s contract)."""

from __future__ import annotations

import numpy as np
import pytest

from nhil.runtime.executor import Runner
from nhil.targets.sim import SimTarget

from tests.test_sim_fast import _compile


def _state(t: SimTarget) -> dict:
    st = t.state
    n = st.n_slots
    out = {"n_slots": n, "row_slot": st.row_slot.copy(), "mem": st.mem_t[:, :n].copy(), "gbs": st.gbs.copy(),
           "accs": st.accs.view(np.uint32).copy(), "cfr": st.cfr.copy(), "counts": dict(st.counts), "macs": st.macs}
    if hasattr(st, "zero_rows"):
        out["zero_rows"] = st.zero_rows[:, :n].copy()
    return out


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].shape == b[k].shape and np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _run(r: Runner, n: int) -> tuple[list, list]:
    r.reset()
    logits = [r.step(7 + 3 * p, p)["logits"].view(np.uint32).copy() for p in range(n)]
    return logits, [s.digest for s in r.t.trace()]


@pytest.fixture(scope="module")
def program():
    # a q4_1 program: quantized rows go through the decoded-row cache, which reload must drop for written rows only
    return _compile("llama-tiny", quant="q4_1:lm_head=bf16")


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_reload_restores_the_fresh_load_state_and_the_same_run(program, reference):
    fresh = SimTarget(reference=reference)
    fresh.load(program)
    want = _state(fresh)
    t = SimTarget(reference=reference)
    r = Runner(program, t)
    logits, trace = _run(r, 6)
    state = t.state
    assert state.written.any()  # the run wrote its KV rows (images of zeros): there is something to undo
    r.reset()
    assert t.state is state  # restored in place, not loaded again
    _assert_same_state(_state(t), want)
    logits2, trace2 = _run(r, 6)
    assert t.state is state
    assert all(np.array_equal(a, b) for a, b in zip(logits, logits2)) and trace2 == trace


def test_reload_of_an_edited_image_loads_again(program):
    t = SimTarget()
    r = Runner(program, t)
    _run(r, 2)
    state = t.state
    img = next(i for i in program.bank_images if i.data is not None)
    old = img.data
    try:
        img.data = np.ascontiguousarray(old ^ np.uint16(0x4000))  # a new array: the target cannot assume its rows
        r.reset()
        assert t.state is not state
        assert np.array_equal(t.state.mem[:, :, int(t.state.row_slot[img.row])], img.data)
    finally:
        img.data = old


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_reload_unallocates_rows_first_written_after_the_load(reference):
    """Hand-built: one weight image, then writes to it and to rows outside the images by every bank writer
    (WR_SBK as a scatter run, WR_ABK, COPY_GB_BK), GB, ACC and CFR writes; reload equals a fresh load."""
    from nhil.compiler.builder import ProgramBuilder
    from nhil.isa import DEVICE_PRESETS, Instr, Op
    from nhil.isa.instr import ALL_CH
    from nhil.isa.program import BankImage
    from nhil.numerics.bf16 import f32_to_bf16_bits
    from nhil.targets.base import ResolvedInstr

    d = DEVICE_PRESETS["rtl-tiny"]
    rng = np.random.default_rng(5)
    prog = ProgramBuilder(d).finish({"inputs": {}, "outputs": {}}, {})
    prog.bank_images.append(BankImage(3, f32_to_bf16_bits(rng.standard_normal((d.channels, d.banks, d.cols)).astype(np.float32))))
    L = d.lanes
    pay = lambda n: f32_to_bf16_bits(rng.standard_normal(n).astype(np.float32))  # noqa: E731
    items = [(Instr(Op.WR_SBK, 0, bank=b, row=r, col=c, imm=0xFFFF), pay(L)) for b, r, c in [(0, 3, 0), (1, 9, 2), (2, 11, 1)]]
    items += [(Instr(Op.WR_GB, ALL_CH, col=0, n=2), pay(2 * L)), (Instr(Op.MAC_AB, ALL_CH, row=3, n=2), None),
              (Instr(Op.WR_ABK, ALL_CH, row=12, col=1, n=1), pay(L)), (Instr(Op.COPY_GB_BK, ALL_CH, bank=1, row=13, col=0, n=1), None),
              (Instr(Op.SET_CFR, ALL_CH, k=0, imm=1), None)]
    fresh = SimTarget(device=d, reference=reference)
    fresh.load(prog)
    want = _state(fresh)
    t = SimTarget(device=d, reference=reference)
    t.load(prog)
    t.execute([ResolvedInstr(i, ins, p) for i, (ins, p) in enumerate(items)])
    state = t.state
    assert state.n_slots == 5 and state.accs.any() and state.cfr.any()  # rows 9, 11, 12, 13 allocated by the run
    t.reload(prog)
    assert t.state is state
    _assert_same_state(_state(t), want)
    assert t.read_row(0, 1, 9).any() == False and t.state.slot(9, allocate=False) == -1  # noqa: E712


def test_a_timed_target_restarts_its_timing_engine_on_reload(program):
    from nhil.targets.sim.timing import TimedSimTarget

    t = TimedSimTarget(every=1)
    r = Runner(program, t)
    _run(r, 3)
    first, state = list(t.step_cycles), t.state
    assert len(first) == 3
    _run(r, 3)  # reset -> reload in place: the engine starts again, so the same steps cost the same cycles
    assert t.state is state and t.step_cycles == first
