"""Device semantics of ISA v0, one table: per opcode the fields it uses, their bounds against the
``DeviceConfig``, the operand it carries, and its pseudocode (``docs/isa.md``).

``check_instr(ins, device, operand_count)`` returns the first violation as a message naming the
field, its value and the bound, or None. ``Program.validate`` runs it on every instruction when
a program is loaded, so a program whose static fields fall outside the device is refused at load
(LOAD_FAIL naming the file, the instruction index and the field), not at run time as RUN_FAIL at
instruction N. Fields that the runtime binds per position (``POS_SLOT``: ch, bank and a row
offset; ``POS_COL``: col, imm and a row offset) are checked for the position 0 the runtime
starts from; the simulator (``nhil.targets.sim.device``) still checks every resolved
instruction at run time with the same bounds.

Bounds (d = the device; L = d.lanes; bursts of a row = d.cols / L; of the global buffer =
d.gb_elems / L):

| op | ch | bank | row | k | col, n | operand elements |
|---|---|---|---|---|---|---|
| WR_GB | < channels or ALL_CH | GB set < vectors | | | n >= 1, col + n <= gb bursts | 1 .. n*L in |
| WR_ACC | same | accumulator set < vectors | | < accumulators | n >= 1, col + n <= channels addressed * banks | n in |
| MAC_AB | same | | < rows | < accumulators | n >= 1, col + n <= row bursts | |
| MAC_SB | same | < banks | < rows | < accumulators | same | |
| RD_ACC | same | accumulator set < vectors | | < accumulators | as WR_ACC | 1 .. n out |
| WR_SBK | same | < banks | < rows | | col < row bursts | 1 .. L in |
| RD_SBK | one channel (ALL_CH only on a 1-channel device) | < banks | < rows | | n >= 1, col + n <= row bursts | 1 .. n*L out |
| WR_ABK | same as WR_GB | | < rows | | n >= 1, col + n <= row bursts | 1 .. n*L in |
| COPY_BK_GB, COPY_GB_BK | < channels or ALL_CH | < banks | < rows | | n >= 1, col + n <= min(row, gb) bursts | |
| SET_CFR | < channels or ALL_CH | | | register 0 (imm 0/1) or 1 (weight format code) | | |
| MAC_ABV | same as MAC_AB | | < rows | < accumulators | n >= 1, col + n <= min(row, gb) bursts; imm = V vectors, 1 <= V <= vectors | |
| NOP, SYNC, EOC, HOST | | | | | | |
| EWMUL, EWADD | same as WR_GB | | | < accumulators (and imm < accumulators) | | |
| AF | same | | | < accumulators (imm: a function id of ``nhil.numerics.ew.AF_FUNCS``) | | |

The elementwise opcodes (EWMUL, EWADD, AF) are claimed by the simulator only: a target that does not
claim them refuses the program at load (``nhil.targets.base.check_program_fits``).
"""

from __future__ import annotations

import dataclasses

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, FLAG_POS_COL, FLAG_POS_SLOT, Instr, Op


@dataclasses.dataclass(frozen=True)
class OpSemantics:
    """Static semantics of one opcode (see the module table).

    Attributes:
        chan: ``"any"`` (ch < channels, or ALL_CH), ``"one"`` (ch < channels, ALL_CH refused), or None.
        bank / row: the field is an address checked against banks / rows.
        k: ``"acc"`` (accumulator index), ``"cfr"`` (CFR register), or None.
        span: which burst range col..col+n must fit: ``"row"``, ``"gb"``, ``"row_gb"``,
            ``"acc"`` (accumulator slots), ``"one_burst"`` (col only), or None.
        elems: operand elements the instruction moves, as a function of (ins, device): the
            operand's count must be in ``1 .. elems`` (WR_ACC: exactly ``n``); None: no operand.
        pseudo: pseudocode (``docs/isa.md``).
    """

    chan: str | None = None
    bank: bool = False
    row: bool = False
    k: str | None = None
    span: str | None = None
    elems: object = None
    pseudo: str = ""


def _n_lanes(ins: Instr, d: DeviceConfig) -> int:
    return ins.n * d.lanes


SEMANTICS: dict[Op, OpSemantics] = {
    Op.NOP: OpSemantics(pseudo="nothing"),
    Op.SYNC: OpSemantics(pseudo="wait until every earlier instruction completed; readbacks reach the host"),
    Op.EOC: OpSemantics(pseudo="end of command stream"),
    Op.HOST: OpSemantics(pseudo="host_ops[imm](inputs) -> outputs on the host (never sent to a device)"),
    Op.WR_GB: OpSemantics("any", span="gb", elems=_n_lanes, pseudo="GB_bank[ch][col*L : (col+n)*L] = bf16(operand); bank = GB set"),
    Op.WR_ACC: OpSemantics("any", k="acc", span="acc", elems=lambda i, d: i.n, pseudo="ACC_bank[ch][:, k].flat[col : col+n] = operand (fp32); bank = accumulator set"),
    Op.MAC_AB: OpSemantics("any", row=True, k="acc", span="row", pseudo="for every bank b: ACC[ch][b][k] += dot(ROW[ch][b][row][bursts col..col+n), GB[ch][same])"),
    Op.MAC_SB: OpSemantics("any", bank=True, row=True, k="acc", span="row", pseudo="ACC[ch][bank][k] += dot(ROW[ch][bank][row][bursts col..col+n), GB[ch][same])"),
    Op.RD_ACC: OpSemantics("any", k="acc", span="acc", elems=lambda i, d: i.n, pseudo="operand = ACC_bank[ch][:, k].flat[col : col+n]; bank = accumulator set"),
    Op.WR_SBK: OpSemantics("any", bank=True, row=True, span="one_burst", elems=lambda i, d: d.lanes, pseudo="ROW[ch][bank][row][burst col][lanes in imm] = bf16(operand) (k=1/2: only the low/high byte of each lane)"),
    Op.RD_SBK: OpSemantics("one", bank=True, row=True, span="row", elems=_n_lanes, pseudo="operand = ROW[ch][bank][row][bursts col..col+n)"),
    Op.WR_ABK: OpSemantics("any", row=True, span="row", elems=_n_lanes, pseudo="for every bank b: ROW[ch][b][row][bursts col..col+n) = bf16(operand)"),
    Op.COPY_BK_GB: OpSemantics("any", bank=True, row=True, span="row_gb", pseudo="GB[ch][bursts col..col+n) = ROW[ch][bank][row][same]"),
    Op.COPY_GB_BK: OpSemantics("any", bank=True, row=True, span="row_gb", pseudo="ROW[ch][bank][row][bursts col..col+n) = GB[ch][same]"),
    Op.SET_CFR: OpSemantics("any", k="cfr", pseudo="CFR[ch][k] = imm"),
    Op.MAC_ABV: OpSemantics("any", row=True, k="acc", span="row_gb",
                            pseudo="for every bank b, j < imm: ACC_j[ch][b][k] += dot(ROW[ch][b][row][bursts col..col+n), GB_j[ch][same])"),
    Op.EWMUL: OpSemantics("any", k="acc", pseudo="for every bank b: ACC[ch][b][k] = fp32(ACC[ch][b][k] * ACC[ch][b][imm])"),
    Op.EWADD: OpSemantics("any", k="acc", pseudo="for every bank b: ACC[ch][b][k] = fp32(ACC[ch][b][k] + ACC[ch][b][imm])"),
    Op.AF: OpSemantics("any", k="acc", pseudo="for every bank b: ACC[ch][b][k] = LUT_imm[bf16(ACC[ch][b][k])] (nhil.numerics.ew)"),
}


def check_instr(ins: Instr, d: DeviceConfig, operand_count: int | None = None) -> str | None:
    """The first field of ``ins`` outside device ``d`` (a message naming field, value and bound), or None.

    Args:
        ins: a decoded instruction.
        d: the device the program was compiled for.
        operand_count: element count of the instruction's operand (None if it has none).
    """
    s = SEMANTICS.get(ins.op)
    if s is None:
        return None
    pos_slot, pos_col = bool(ins.flags & FLAG_POS_SLOT), bool(ins.flags & FLAG_POS_COL)
    all_ch = bool(ins.flags & ALL_CH)
    # messages are the simulator's run-time ones (nhil.targets.sim.device), field name first
    if s.chan == "one" and all_ch and d.channels != 1:
        return f"{ins.op.name} reads one channel; ALL_CH is not allowed"
    if s.chan and not all_ch and not pos_slot and ins.ch >= d.channels:
        return f"channel {ins.ch} >= {d.channels}"
    if s.row and ins.row >= d.rows:
        return f"row {ins.row} >= {d.rows}"
    if s.k == "acc" and ins.k >= d.accumulators:
        return f"accumulator {ins.k} >= {d.accumulators}"
    if s.bank and not pos_slot and ins.bank >= d.banks:
        return f"bank {ins.bank} >= {d.banks}"
    if ins.op in (Op.WR_ACC, Op.RD_ACC, Op.WR_GB) and ins.bank >= d.vectors:
        what = "global buffer" if ins.op is Op.WR_GB else "accumulator set"
        return f"{what} {ins.bank} >= {d.vectors} (the bank field of {ins.op.name} selects a set of the prefill extension; device {d.name} has {d.vectors})"
    if ins.op is Op.MAC_ABV and not 1 <= ins.imm <= d.vectors:
        return f"MAC_ABV of {ins.imm} vectors: device {d.name} has {d.vectors} global buffers / accumulator sets (1 <= imm <= {d.vectors})"
    if ins.op is Op.WR_SBK and ins.k not in ((0, 1, 2, 3) if pos_col else (0, 1, 2)):
        return f"WR_SBK byte select k={ins.k}: 0 (words), 1 / 2 (low / high byte), 3 (byte bound from the position, POS_COL only)"
    why = _check_ew(ins, d)
    if why:
        return why
    if s.k == "cfr":
        from nhil.isa.instr import CFR_ACC_RD_FMT, CFR_W_FMT

        if ins.k == CFR_W_FMT:
            from nhil.numerics.formats import BY_CODE

            if ins.imm != 0 and ins.imm not in BY_CODE:
                return (f"unknown weight format code 0x{ins.imm:x} for CFR W_FMT (known: 0 bf16, "
                        f"{', '.join(f'0x{c:x} {f.name}' for c, f in sorted(BY_CODE.items()))})")
        elif ins.k != CFR_ACC_RD_FMT or ins.imm not in (0, 1):
            return f"unknown CFR register {ins.k} or value {ins.imm} (v0 has reg 0 = RD_ACC format, values 0/1; reg 1 = W_FMT)"
    row_b, gb_b = d.cols // d.lanes, d.gb_elems // d.lanes
    what = {"row": "row", "gb": "global buffer", "row_gb": "row/global buffer", "one_burst": "row"}
    limit = {"row": row_b, "gb": gb_b, "row_gb": min(row_b, gb_b), "one_burst": row_b,
             "acc": (d.channels if all_ch else 1) * d.banks}.get(s.span)
    if limit is not None and not pos_col:
        n = 1 if s.span == "one_burst" else ins.n
        if s.span == "acc":
            if n == 0 or ins.col + n > limit:
                return f"slots [{ins.col}, {ins.col + n}) outside the {limit} accumulators addressed"
        elif n == 0 or ins.col + n > limit:
            return f"bursts [{ins.col}, {ins.col + n}) outside the {what[s.span]} of {limit} bursts"
    if s.elems is not None and operand_count is not None:
        most = s.elems(ins, d)
        if ins.op is Op.WR_ACC and operand_count != most:
            return f"operand of {operand_count} elements, WR_ACC n={ins.n} writes exactly {most}"
        if not 1 <= operand_count <= max(most, 1):
            return f"operand of {operand_count} elements, the instruction moves at most {most}"
    return None


def _check_ew(ins: Instr, d: DeviceConfig) -> str | None:
    """The ``imm`` operand of the elementwise ops: a second accumulator (EWMUL / EWADD) or a known AF function."""
    if ins.op in (Op.EWMUL, Op.EWADD) and ins.imm >= d.accumulators:
        return f"second accumulator (imm) {ins.imm} >= {d.accumulators}"
    if ins.op is Op.AF:
        from nhil.numerics.ew import AF_FUNCS

        if ins.imm not in AF_FUNCS:
            return f"unknown AF function {ins.imm} (known: {', '.join(f'{k} {v}' for k, v in AF_FUNCS.items())})"
    return None
