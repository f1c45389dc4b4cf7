"""Scheduling passes over a lowered :class:`~nhil.isa.program.Program`.

A pass is a function ``Program -> Program`` that reorders or regroups device
instructions without changing any value the program computes: every accumulator sees
the same MACs (rows, columns, global-buffer contents) in the same order, so outputs
are bit-identical (``tests/test_schedule.py`` runs the simulator before and after).
Passes only touch the instruction stream; placement and images are unchanged. Each pass
declines (leaves a device run as it is) when the run holds anything it does not
recognise.

Passes:

* ``gemv-batch`` (broadcast-vector and accumulator reuse): within a device run (the
  instructions between two barriers), the accumulator *units* of GEMVs that read the
  same input chunks (q/k/v projections of one x; gate/up of one x; the experts of one
  token) are regrouped into batches of ``accumulators`` units across matrices, so each
  input chunk is written to the global buffer once per batch instead of once per
  matrix-batch, and fewer accumulators are reused back to back (a WR_ACC waits for the
  RD_ACC before it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from nhil.isa.instr import ALL_CH, Instr, Op
from nhil.isa.program import Program

BARRIERS = frozenset({Op.SYNC, Op.HOST, Op.EOC})


@dataclasses.dataclass
class _Unit:
    """One accumulator lifetime of a GEMV: zero, MAC over chunks, read back."""

    wr: Instr
    macs: list  # (MAC_AB instr, gb key) per chunk
    rd: Instr | None = None

    @property
    def sig(self) -> tuple:
        return tuple(g for _, g in self.macs)


def _parse_gemv_run(run: list[Instr], kv_rows: set[int]) -> list[_Unit] | None:
    """Units of a run made only of GEMV instructions at column 0; ``None`` if anything else is there."""
    units: list[_Unit] = []
    open_: dict[int, _Unit] = {}
    gb = None
    gb_instr: dict[tuple, Instr] = {}
    for ins in run:
        if not ins.flags & ALL_CH:
            return None
        if ins.op is Op.WR_ACC and ins.col == 0:
            if ins.k in open_:
                return None
            open_[ins.k] = _Unit(ins, [])
        elif ins.op is Op.WR_GB and ins.col == 0:
            gb = (ins.operand, ins.n)
            gb_instr[gb] = ins
        elif ins.op is Op.MAC_AB and ins.col == 0 and ins.row not in kv_rows:
            u = open_.get(ins.k)
            if u is None or gb is None or ins.n > gb[1]:
                return None
            u.macs.append((ins, gb))
        elif ins.op is Op.RD_ACC and ins.col == 0:
            u = open_.pop(ins.k, None)
            if u is None or not u.macs:
                return None
            u.rd = ins
            units.append(u)
        else:
            return None
    if open_:
        return None
    _parse_gemv_run.gb_instr = gb_instr  # type: ignore[attr-defined]
    return units


def _emit_batched(units: list[_Unit], gb_instr: dict, acc: int) -> list[Instr]:
    groups: dict[tuple, list[_Unit]] = {}
    for u in units:
        groups.setdefault(u.sig, []).append(u)
    out: list[Instr] = []
    cur = None
    for sig, us in groups.items():
        for b0 in range(0, len(us), acc):
            batch = us[b0 : b0 + acc]
            for k, u in enumerate(batch):
                out.append(u.wr._replace(k=k))
            for j, g in enumerate(sig):
                if g != cur:
                    out.append(gb_instr[g])
                    cur = g
                for k, u in enumerate(batch):
                    out.append(u.macs[j][0]._replace(k=k))
            for k, u in enumerate(batch):
                out.append(u.rd._replace(k=k))
    return out


def gemv_batch(p: Program) -> Program:
    """The ``gemv-batch`` pass (module docstring)."""
    from nhil.timing.engine import kv_row_set

    kv = kv_row_set(p)
    out: list[Instr] = []
    run: list[Instr] = []

    def flush():
        units = _parse_gemv_run(run, kv) if run else None
        if units:
            new = _emit_batched(units, _parse_gemv_run.gb_instr, p.device.accumulators)  # type: ignore[attr-defined]
            if len(new) <= len(run):
                out.extend(new)
                run.clear()
                return
        out.extend(run)
        run.clear()

    for ins in p.instrs:
        if ins.op in BARRIERS:
            flush()
            out.append(ins)
        else:
            run.append(ins)
    flush()
    info = dict(p.info)
    info["schedule"] = list(info.get("schedule", [])) + ["gemv-batch"]
    q = dataclasses.replace(p, instrs=out, info=info)
    q.validate()
    return q


PASSES: dict[str, Callable[[Program], Program]] = {"gemv-batch": gemv_batch}


def apply_passes(p: Program, names: list[str]) -> Program:
    """Run the named passes in order."""
    for n in names:
        p = PASSES[n](p)
    return p
