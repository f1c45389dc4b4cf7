"""L2 device commands and the deterministic unroller from ISA v0 instructions.

An ISA v0 instruction (L1) becomes, per channel it addresses, a short list of *command
groups* (``Plan`` entries); a group of a column kind carries a burst count ``n`` and
stands for ``n`` commands at consecutive columns. The unroller decides only *which*
commands are needed, from the open-row state of the channel (open-page policy: a row
stays open until another row of the bank is needed); *when* they issue is the timing
engine's job (``nhil.timing.engine``), and whether the timed stream obeys the table is
the legality checker's (``nhil.timing.check``).

Rules (``docs/timing-model.md``):

* ``MAC_AB row col n k``: ``PRE`` (all banks) if any bank has another row open, ``ACT``
  (all banks) if the row is not open in every bank, then ``n`` x ``MAC`` (all banks).
* ``MAC_ABV row col n k imm=V`` (prefill extension): as ``MAC_AB``, then ``V`` groups of ``n`` x ``MAC``
  on the same open row, group ``j`` reading global buffer ``j`` into accumulator ``k`` of set ``j``
  (the bank's MAC unit takes one burst per nCCD, so V vectors cost V times the MAC bursts, one ACT).
  GB bursts of set ``j`` are numbered ``j * gb_bursts + c`` in the hazard tables (``Plan.g``).
* ``MAC_SB``/``WR_SBK``/``RD_SBK``/``COPY_*``: the same with one bank (``PRE``/``ACT`` of that bank).
* ``WR_ABK``: all-bank ``PRE``/``ACT``, ``n`` x ``WR`` (all banks).
* ``WR_GB col n``: ``n`` x ``WRGB``. ``WR_ACC``/``RD_ACC``: ``ceil(4*m/32)`` x ``WRACC``/``RDACC``
  bursts for the ``m`` accumulators of the channel the slot range covers (none if ``m = 0``).
* ``EWMUL``/``EWADD``/``AF``: one ``EW`` command (all banks; accumulators only, no row, no bus burst).
* ``SET_CFR``, ``NOP``: no command. ``SYNC``, ``EOC``, ``HOST``: no command (barriers and
  host time are handled by the engine).
* ``REF`` is never produced by the unroller; the engine inserts it.
"""

from __future__ import annotations

from typing import NamedTuple

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, Instr, Op

ALL = -1  # bank = ALL: an all-bank command (ACT16 / PRE_AB / MAC16 / WR to every bank)

# command kinds
ACT, PRE, MAC, WRGB, WRACC, RDACC, WR, RD, RDCP, WRCP, REF = "ACT", "PRE", "MAC", "WRGB", "WRACC", "RDACC", "WR", "RD", "RDCP", "WRCP", "REF"
EW = "EW"  # an elementwise op on the accumulators (EWMUL / EWADD / AF): col = the second accumulator, k = the first
KINDS = (ACT, PRE, MAC, WRGB, WRACC, RDACC, WR, RD, RDCP, WRCP, REF, EW)
BANK_COLUMN = frozenset({MAC, WR, RD, RDCP, WRCP})  # column commands on the bank side (nCCD apart)
EXT_BUS = frozenset({WRGB, WRACC, RDACC, WR, RD})  # commands moving a burst over the external bus (nBL apart)
READS = frozenset({MAC, RD, RDCP})  # read-type bank access (nRTP before PRE)
WRITES = frozenset({WR, WRCP})  # write-type bank access (nCWL+nBL+nWR before PRE)
ACC_BYTES = 4  # an accumulator crosses the bus as fp32
BURST_BYTES = 32


class Cmd(NamedTuple):
    """One timed device command.

    ``t`` is the issue cycle (command clock), ``bank`` is :data:`ALL` for all-bank
    commands, ``col`` the burst (column) index or GB burst, ``k`` the accumulator,
    ``instr`` the index of the ISA instruction it came from (-1 for REF).
    """

    t: int
    ch: int
    kind: str
    bank: int = ALL
    row: int = -1
    col: int = -1
    k: int = -1
    instr: int = -1


class Plan(NamedTuple):
    """An untimed command group: ``n`` commands of ``kind`` at columns ``col .. col+n-1``."""

    kind: str
    bank: int = ALL
    row: int = -1
    col: int = 0
    n: int = 1
    k: int = -1
    g: int = 0  # MAC / WRGB: column c touches GB burst c + g (global buffer j of the prefill extension: g = j * gb bursts)


def acc_key(d: DeviceConfig, acc_set: int, k: int) -> int:
    """Index of accumulator ``k`` of set ``acc_set`` in the engine's per-accumulator hazard tables (set 0: ``k``)."""
    return acc_set * d.accumulators + k


def channels_of(ins: Instr, d: DeviceConfig) -> range:
    """The channels an instruction addresses."""
    return range(d.channels) if ins.flags & ALL_CH else range(ins.ch, ins.ch + 1)


def acc_bursts(ins: Instr, d: DeviceConfig, ch: int) -> int:
    """Bursts of a WR_ACC/RD_ACC in channel ``ch``: its accumulators in the slot range, 4 bytes each."""
    base = (ch if ins.flags & ALL_CH else 0) * d.banks
    lo, hi = max(ins.col, base), min(ins.col + ins.n, base + d.banks)
    m = max(0, hi - lo)
    return -(-m * ACC_BYTES // BURST_BYTES)


def _open(plan: list, open_rows: list[int], bank: int, row: int) -> None:
    """PRE/ACT needed so that ``row`` is open in ``bank`` (or every bank); updates ``open_rows``."""
    if bank == ALL:
        if all(o == row for o in open_rows):
            return
        if any(o != -1 for o in open_rows):
            plan.append(Plan(PRE, ALL))
        plan.append(Plan(ACT, ALL, row))
        open_rows[:] = [row] * len(open_rows)
        return
    if open_rows[bank] == row:
        return
    if open_rows[bank] != -1:
        plan.append(Plan(PRE, bank))
    plan.append(Plan(ACT, bank, row))
    open_rows[bank] = row


def unroll_instr(ins: Instr, d: DeviceConfig, ch: int, open_rows: list[int]) -> list[Plan]:
    """Command groups of one instruction in channel ``ch``; ``open_rows`` (per bank, -1 closed) is updated.

    Position-relative flags must already be bound (``nhil.runtime.executor``); a program
    template is unrolled as if ``$pos = 0`` by :func:`nhil.timing.engine.bind_template`.
    """
    op = ins.op
    plan: list[Plan] = []
    if op is Op.MAC_AB:
        _open(plan, open_rows, ALL, ins.row)
        plan.append(Plan(MAC, ALL, ins.row, ins.col, ins.n, ins.k))
    elif op is Op.MAC_ABV:
        _open(plan, open_rows, ALL, ins.row)
        for j in range(ins.imm):
            plan.append(Plan(MAC, ALL, ins.row, ins.col, ins.n, acc_key(d, j, ins.k), j * (d.gb_elems // d.lanes)))
    elif op is Op.MAC_SB:
        _open(plan, open_rows, ins.bank, ins.row)
        plan.append(Plan(MAC, ins.bank, ins.row, ins.col, ins.n, ins.k))
    elif op is Op.WR_GB:
        plan.append(Plan(WRGB, ALL, -1, ins.col, ins.n, g=ins.bank * (d.gb_elems // d.lanes)))
    elif op is Op.WR_ACC or op is Op.RD_ACC:
        nb = acc_bursts(ins, d, ch)
        if nb:
            plan.append(Plan(WRACC if op is Op.WR_ACC else RDACC, ALL, -1, 0, nb, acc_key(d, ins.bank, ins.k)))
    elif op is Op.WR_SBK:
        _open(plan, open_rows, ins.bank, ins.row)
        plan.append(Plan(WR, ins.bank, ins.row, ins.col, 1))
    elif op is Op.RD_SBK:
        _open(plan, open_rows, ins.bank, ins.row)
        plan.append(Plan(RD, ins.bank, ins.row, ins.col, ins.n))
    elif op is Op.WR_ABK:
        _open(plan, open_rows, ALL, ins.row)
        plan.append(Plan(WR, ALL, ins.row, ins.col, ins.n))
    elif op is Op.COPY_BK_GB:
        _open(plan, open_rows, ins.bank, ins.row)
        plan.append(Plan(RDCP, ins.bank, ins.row, ins.col, ins.n))
    elif op is Op.COPY_GB_BK:
        _open(plan, open_rows, ins.bank, ins.row)
        plan.append(Plan(WRCP, ins.bank, ins.row, ins.col, ins.n))
    elif op in (Op.EWMUL, Op.EWADD, Op.AF):  # one all-bank command, no row, no bus burst
        plan.append(Plan(EW, ALL, -1, ins.k if op is Op.AF else ins.imm, 1, ins.k))
    return plan
