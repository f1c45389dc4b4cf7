"""Cross-target check: run every block on a target and on the functional simulator in lockstep.

``LockstepTarget(dut)`` forwards each call to the device under test (rtl, fpga, a
plugin) and to a fresh :class:`~nhil.targets.sim.SimTarget` loaded with the same
program, then compares their readbacks bit for bit at every SYNC. The first difference
is recorded (instruction index, disassembly, slot/bank, both values) and, with
``stop_on_mismatch`` (default), raised as :class:`Mismatch` so no later result is
reported as correct. This is the "RTL == simulator at every SYNC" check of
``docs/isa.md``; the simulator is the reference because it *is* the documented semantics.
"""

from __future__ import annotations

import numpy as np

from nhil.errors import NhilError
from nhil.isa.asm import format_instr
from nhil.isa.instr import OPINFO, Op
from nhil.isa.program import Program
from nhil.targets.base import DelegatingTarget, ResolvedInstr, Target
from nhil.targets.sim import SimTarget


class Mismatch(NhilError):
    """The target and the simulator disagree; ``detail`` holds the first difference."""

    outcome = "MISMATCH"

    def __init__(self, msg: str, detail: dict) -> None:
        super().__init__(msg)
        self.detail = detail


class LockstepTarget(DelegatingTarget):
    """Wraps ``dut`` and checks it against the simulator at every SYNC (see module docstring)."""

    def __init__(self, dut: Target, stop_on_mismatch: bool = True) -> None:
        super().__init__(dut)
        self.dut = dut
        self.ref = SimTarget()
        self.name = f"{dut.name}+sim-lockstep"
        self.stop = stop_on_mismatch
        self.program: Program | None = None
        self.first_mismatch: dict | None = None
        self.syncs_compared = 0
        self.readbacks_compared = 0

    def load(self, program: Program) -> None:
        self.program = program
        self.dut.load(program)
        self.ref.load(program)

    def reload(self, program: Program) -> None:
        """The device under test reloads its way (the FPGA keeps verified rows); the simulator reference loads afresh."""
        self.program = program
        self.dut.reload(program)
        self.ref.load(program)

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        got = self.dut.execute(block)
        want = self.ref.execute(block)
        outs = [r for r in block if OPINFO[r.instr.op].data_out]
        if len(got) != len(want):
            self._record(outs[min(len(got), len(want))] if outs else block[-1], None, None, f"target returned {len(got)} readbacks, simulator {len(want)}")
        for r, g, w in zip(outs, got, want):
            self.readbacks_compared += 1
            gb, wb = np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8)
            if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(gb, wb):
                self._record(r, g, w, "readback differs")
                break
        self.syncs_compared += sum(1 for r in block if r.instr.op is Op.SYNC)
        return got

    def _record(self, r: ResolvedInstr, got, want, why: str) -> None:
        detail = {"instruction": r.index, "disasm": format_instr(r.instr, self.program), "why": why}
        if got is not None and want is not None and got.shape == want.shape:
            gi = got.view(np.uint32 if got.dtype == np.float32 else np.uint16)
            wi = want.view(gi.dtype)
            diff = np.nonzero(gi != wi)[0]
            if diff.size:
                i = int(diff[0])
                slot = r.instr.col + i if r.instr.op is Op.RD_ACC else None
                detail.update(
                    element=i,
                    differing_elements=int(diff.size),
                    target_value=f"{float(got[i])!r} (0x{int(gi[i]):x})",
                    sim_value=f"{float(want[i])!r} (0x{int(wi[i]):x})",
                )
                if slot is not None and self.program is not None:
                    banks = self.program.device.banks
                    detail.update(channel=slot // banks, bank=slot % banks)
        if self.first_mismatch is None:
            self.first_mismatch = detail
        if self.stop:
            where = f"bank {detail['bank']} " if "bank" in detail else ""
            raise Mismatch(
                f"{self.dut.name} differs from the simulator at instruction {detail['instruction']} ({detail['disasm']}): {why}; "
                f"{where}element {detail.get('element', '?')}: target {detail.get('target_value', '?')} vs sim {detail.get('sim_value', '?')}",
                detail,
            )

    def write_row(self, ch, bank, row, data):
        self.dut.write_row(ch, bank, row, data)
        self.ref.write_row(ch, bank, row, data)

    def stats(self) -> dict:
        s = dict(self.dut.stats())
        s["lockstep"] = {"syncs_compared": self.syncs_compared, "readbacks_compared": self.readbacks_compared, "first_mismatch": self.first_mismatch}
        return s
