"""Optional timing model for the ``sim`` target (off by default).

``TimedSimTarget`` is the functional simulator plus a :class:`nhil.timing.TimingEngine`
fed with every resolved instruction it executes, so a functional run also reports
modelled cycles per decode step, per instruction kind and per layer
(``stats()["timing"]``). Host kernels never reach a target; the hook charges them from
the program (the instructions between two device blocks).

Cost control: the timing of a step depends on the position only through the KV-append
addresses, so by default every ``every``-th step is timed (the first always) and the
others repeat the last timed step's cycles (``timed_steps`` says which were timed).
``every=1`` times every step.
"""

from __future__ import annotations

import time

from nhil.isa.instr import Op
from nhil.isa.program import Program
from nhil.targets.base import ResolvedInstr
from nhil.targets.sim.target import SimTarget
from nhil.timing.engine import TimingEngine
from nhil.timing.overlap import engine_for
from nhil.timing.table import TimingTable, timing_for


class TimedSimTarget(SimTarget):
    """``SimTarget`` with the timing model switched on (see the module docstring)."""

    name = "sim"
    takes_runs = False  # the timing engine reads one ResolvedInstr per instruction

    def __init__(self, device=None, table: TimingTable | None = None, every: int = 8, **kw) -> None:
        super().__init__(device, **kw)
        self._table = table
        self.every = max(1, int(every))
        self.engine: TimingEngine | None = None
        self.program: Program | None = None
        self.step_cycles: list[int] = []
        self.timed_steps: list[int] = []
        self._last = -1
        self._step = 0
        self._on = True
        self.engine_seconds = 0.0  # wall time spent in the timing model (its cost)

    def _started(self, program: Program) -> None:  # after load and reload: a new timing engine for the run
        self.program = program
        d = self.state.d
        self.engine = engine_for(program, d, self._table or timing_for(d))  # host/device overlap iff the program's passes hold host-overlap
        self.step_cycles, self.timed_steps, self._last, self._step, self._on = [], [], -1, 0, True

    def execute(self, block: list[ResolvedInstr]) -> list:
        out = super().execute(block)
        eng = self.engine
        if eng is None or not block:
            return out
        if self._on:
            t0 = time.perf_counter()
            for i in range(self._last + 1, block[0].index):  # host kernels between device blocks
                ins = self.program.instrs[i]
                if ins.op is Op.HOST:
                    eng.add(i, ins)
            for r in block:
                eng.add(r.index, r.instr)
            self.engine_seconds += time.perf_counter() - t0
        self._last = block[-1].index
        if block[-1].instr.op is Op.EOC:
            if self._on:
                self.step_cycles.append(eng.stats.steps[-1])
                self.timed_steps.append(self._step)
            else:
                self.step_cycles.append(self.step_cycles[-1])
            self._step += 1
            self._last = -1
            self._on = self._step % self.every == 0
        return out

    def stats(self) -> dict:
        s = super().stats()
        if self.engine is not None:
            st = self.engine.stats
            s["timing"] = {
                "table": self.engine.t.name,
                "tck_ns": self.engine.t.tck_ns,
                "step_cycles": list(self.step_cycles),
                "engine_seconds": self.engine_seconds,
                "timed_steps": list(self.timed_steps),
                "exposed_by_kind": dict(st.exposed_by_kind),
                "exposed_by_layer": dict(st.exposed_by_layer),
            }
        return s
