"""What the timing engine attributes its cycles to, and how it reads a program (``nhil.timing.engine``).

* :class:`TimingStats`: total cycles, exposed cycles per instruction kind and per layer, counts;
* the program's layout facts the engine needs: rows holding KV cache (:func:`kv_row_set`), the
  used rectangle of every weight row (:func:`useful_rect`), the layer of every instruction
  (:func:`layer_map`), the issue order of one decode step (:func:`timed_order`, MoE experts at
  their dispatch), a host kernel's cost (:func:`host_op_cycles`) and a template bound at a
  position (:func:`bind_template`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Instr, Op
from nhil.isa.program import Program
from nhil.timing.table import TimingTable

def useful_rect(program: Program) -> dict[int, tuple[int, int]]:
    """Row -> (slots, elements from column 0) of weights placed in it: ``info['row_use']`` or the bank images' used rectangle."""
    ru = program.info.get("row_use")
    if ru:
        return {int(r): (int(u[0]), int(u[1])) for r, u in ru.items()}
    from nhil.isa.program import _used_rect

    out = {}
    for img in program.bank_images:
        if img.data is not None:
            out[img.row] = tuple(int(v) for v in _used_rect(img.data, program.device))
    return out


def useful_elems(program: Program) -> dict[int, int]:
    """Row -> weight elements placed in it (all slots)."""
    return {r: s_ * c_ for r, (s_, c_) in useful_rect(program).items()}


def mac_useful_elems(rect: tuple[int, int] | None, col: int, n: int, lanes: int) -> int:
    """Weight elements (all slots) a MAC over bursts ``[col, col+n)`` of a row with used rectangle ``rect`` reads."""
    if rect is None:
        return 0
    s_, c_ = rect
    return s_ * max(0, min(c_, (col + n) * lanes) - col * lanes)


@dataclasses.dataclass
class TimingStats:
    """What the engine measured (cycles are command-clock cycles of the table)."""

    cycles: int = 0
    exposed_by_kind: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    exposed_by_layer: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    count_by_kind: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    mac_bursts: int = 0  # all-bank MAC bursts summed over channels (x banks = bank bursts)
    mac_bank_bursts: int = 0
    weight_bank_bursts: int = 0  # bank bursts of MACs on weight rows (GEMV)
    acts: int = 0
    refs: int = 0
    steps: list = dataclasses.field(default_factory=list)  # cycles per program run (EOC to EOC)

    def to_json(self) -> dict:
        return {
            "cycles": self.cycles,
            "exposed_by_kind": dict(self.exposed_by_kind),
            "exposed_by_layer": dict(self.exposed_by_layer),
            "count_by_kind": dict(self.count_by_kind),
            "mac_bank_bursts": self.mac_bank_bursts,
            "weight_bank_bursts": self.weight_bank_bursts,
            "acts": self.acts,
            "refs": self.refs,
            "steps": list(self.steps),
        }


def instr_kind(ins: Instr, kv_rows: set[int] | None, host_ops=None) -> str:
    """Accounting class of an instruction: ``MAC_AB.gemv`` / ``MAC_AB.attn``, ``HOST.<kernel>``, or the opcode."""
    if ins.op is Op.MAC_AB or ins.op is Op.MAC_SB or ins.op is Op.MAC_ABV:
        return f"{ins.op.name}.{'attn' if kv_rows and ins.row in kv_rows else 'gemv'}"
    if ins.op is Op.HOST and host_ops is not None:
        return f"HOST.{host_ops[ins.imm].kernel}"
    return ins.op.name


def kv_row_set(program: Program) -> set[int]:
    """Rows holding KV cache (from ``info['kv_layout']``)."""
    rows: set[int] = set()
    for kv in (program.info.get("kv_layout") or {}).values():
        rows.update(range(kv["k_base"], kv["k_base"] + kv["k_rows"]))
        rows.update(range(kv["v_base"], kv["v_base"] + kv["v_rows_per_group"] * kv["v_groups"]))
    return rows


def layer_map(program: Program) -> list[str]:
    """Layer of every instruction: ``embed``, ``L<i>`` (up to the host op producing layer i's output), ``head``."""
    ends: dict[str, int] = {}
    for k, v in program.io.get("outputs", {}).items():
        if k.startswith("act.model.layers."):
            ends[v] = int(k.split("@")[0].rsplit(".", 1)[1])  # a prefill program's outputs end in @<token>
    nlayers = len(set(ends.values()))
    out = []
    cur = 0
    started = False
    read_end = None  # a layer output read back from the device (ew-residual): the layer ends at the next barrier
    for ins in program.instrs:
        if ins.op is Op.HOST:
            h = program.host_ops[ins.imm]
            if h.kernel != "embedding":
                started = True
        if read_end is not None and ins.op in (Op.SYNC, Op.HOST):
            cur, read_end = read_end, None
        label = f"L{cur}" if started else "embed"
        if cur >= nlayers and ends:
            label = "head"
        out.append(label)
        if ins.op is Op.HOST:
            for o in program.host_ops[ins.imm].outputs:
                if o in ends:
                    cur = ends[o] + 1
        elif ins.op is Op.RD_ACC and ins.operand < len(program.operands) and program.operands[ins.operand].buffer in ends:
            read_end = ends[program.operands[ins.operand].buffer] + 1
    return out


def timed_order(program: Program) -> list[int]:
    """Instruction indices in the order one decode step issues them.

    Without MoE this is the program order. MoE expert sub-programs (``HOST moe_expert``
    marker up to the next marker or ``HOST moe_dispatch``, ``nhil.compiler.lower_moe``) are
    not part of the linear stream: the runtime runs the routed ones at the dispatch
    (``nhil.runtime.executor.Runner``). The timing runs the sub-programs of the first
    ``top_k`` experts there: every expert of a layer has the same placement shape, so the
    time does not depend on which experts the router picks. The markers themselves are
    not issued (the runtime skips them too).
    """
    instrs, hops = program.instrs, program.host_ops
    if not any(h.kernel == "moe_dispatch" for h in hops):
        return list(range(len(instrs)))
    linear: list[int] = []
    subs: dict[int, list[int]] = {}  # marker host-op index -> its instructions
    cur = None
    for i, ins in enumerate(instrs):
        kern = hops[ins.imm].kernel if ins.op is Op.HOST else None
        if kern == "moe_expert":
            cur = subs.setdefault(ins.imm, [])
            continue
        if kern == "moe_dispatch":
            h = hops[ins.imm]
            for m in h.attrs["experts"][: int(h.attrs["top_k"])]:
                linear.extend(subs.get(m, []))
            cur = None
        (linear if cur is None else cur).append(i)
    return linear


def host_op_cycles(program: Program, hop, t: TimingTable) -> int:
    """Host kernel time: fixed call cost + bytes moved (outputs x (inputs + 1), fp32) at ``host_gbs``.

    ``moe_dispatch`` reads the route and the ``top_k`` routed experts' outputs only.
    """
    out_elems = sum(program.buffers.get(o, 0) for o in hop.outputs)
    n_in = 1 + int(hop.attrs["top_k"]) if hop.kernel == "moe_dispatch" else len(hop.inputs)
    nbytes = 4 * out_elems * (1 + n_in)
    ns = t.host_op_ns + nbytes / t.host_gbs
    return int(math.ceil(ns / t.tck_ns))


def bind_template(ins: Instr, d: DeviceConfig, pos: int = 0) -> Instr:
    """Bind position-relative flags as the runtime does (``docs/isa.md``), for timing a template
    (a prefill template's ``tok`` adds to ``pos``)."""
    if ins.tok:
        pos += ins.tok
        ins = ins._replace(tok=0)
    if ins.flags & FLAG_POS_SLOT:
        slot = pos % d.slots
        ins = ins._replace(flags=ins.flags & ~FLAG_POS_SLOT, ch=slot // d.banks, bank=slot % d.banks, row=ins.row + pos // d.slots)
    if ins.flags & FLAG_POS_COL:
        ins = ins._replace(flags=ins.flags & ~FLAG_POS_COL, row=ins.row + pos // d.cols, col=(pos % d.cols) // d.lanes, imm=1 << (pos % d.lanes))
    return ins
