"""Timing engine: schedules the unrolled command stream of a program against a timing table.

Each channel has its own controller. Commands are placed in program order, each at the
earliest cycle that satisfies the table and the data hazards, with these resources:

* the **command bus** (one command per cycle; a later command may take a free earlier
  cycle, e.g. a WRGB between two MACs);
* per bank: ACT/PRE/column timing (nRCD*, nRAS, nRC, nRP, nRTP, nWR);
* per channel, in order: activates (nRRD, nFAW), bank-side column commands (nCCD) and
  external-bus bursts (nBL);
* data hazards: a MAC reads GB burst ``c`` only after the WRGB that wrote it
  (+nCWLGB) and a WRGB overwrites it only after the last MAC that read it; an
  accumulator is read (RDACC) ``nMACLAT`` after its last MAC and rewritten (WRACC)
  only after it was read;
* ``SYNC``: a barrier across channels plus one host hand-off (``host_latency_ns``);
  ``HOST`` adds the host kernel's time; the device idles meanwhile;
* refresh: one REF per ``nREFI`` on average per channel, issued into idle gaps
  (pulled in by up to ``max_ref_slack``) or forced before an ACT once
  ``max_ref_slack`` are owed.

Channels that received the same commands share one state object (copy on write) so
an all-channel program costs about one channel's work; ``record=True`` keeps every
timed command (one state per channel) for the legality checker.

Cycle accounting: every instruction's *exposed* cycles are how far it pushed the end
of the timeline (its completion minus the latest completion before it, if positive);
they sum to the total, so the breakdown per instruction kind and per layer is exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, FLAG_POS_COL, FLAG_POS_SLOT, Instr, Op
from nhil.isa.program import Program
from nhil.timing.commands import acc_bursts, ACT, ALL, EW, MAC, PRE, RD, RDACC, RDCP, REF, WR, WRACC, WRCP, WRGB, Cmd, unroll_instr
from nhil.timing.table import TimingTable, timing_for

NEG = -(1 << 40)


class Chan:
    """Controller state of one channel (or of several identical channels)."""

    __slots__ = ("nb", "bus", "open", "act_t", "pre_t", "rd_t", "wr_t", "rd_all", "acts", "col_t", "ext_t", "gb_w", "gb_r", "acc_w", "acc_mac", "acc_r", "floor", "done", "refs", "ref_t", "idle_from", "cmds", "busy", "last")

    def __init__(self, d: DeviceConfig, row_buffers: int = 1) -> None:
        self.nb = d.banks
        self.bus: set[int] = set()
        nv = d.banks * row_buffers  # one entry per (row buffer, bank): index buffer * banks + bank
        self.open = [-1] * nv
        self.act_t = [NEG] * nv
        self.pre_t = [NEG] * nv
        self.rd_t = [NEG] * nv
        self.wr_t = [NEG] * nv
        self.rd_all = NEG
        self.acts: list[int] = []
        self.col_t = NEG
        self.ext_t = NEG
        g = max(1, d.gb_elems // d.lanes) * d.vectors  # every burst of every global buffer (commands.Plan.g)
        self.gb_w = [NEG] * g
        self.gb_r = [NEG] * g
        na = d.accumulators * d.vectors  # every accumulator of every set (commands.acc_key)
        self.acc_w = [NEG] * na
        self.acc_mac = [NEG] * na
        self.acc_r = [NEG] * na
        self.floor = 0
        self.done = 0
        self.refs = 0
        self.ref_t = NEG
        self.idle_from: int | None = 0
        self.cmds: list | None = None
        self.busy = 0
        self.last = NEG  # issue cycle of the latest command (in-order controllers issue after it)

    def clone(self) -> "Chan":
        c = Chan.__new__(Chan)
        for s in Chan.__slots__:
            v = getattr(self, s)
            setattr(c, s, v.copy() if isinstance(v, (list, set)) else v)
        return c

    def key(self, horizon: int) -> tuple:
        """State after a barrier, with times that can no longer constrain anything (older than ``floor - horizon``) folded to NEG."""
        lim = self.floor - horizon

        def n(t):
            return t if t > lim else NEG

        return (
            tuple(self.open), tuple(map(n, self.act_t)), tuple(map(n, self.pre_t)), tuple(map(n, self.rd_t)), tuple(map(n, self.wr_t)), n(self.rd_all),
            tuple(map(n, self.acts[-4:])), n(self.col_t), n(self.ext_t), tuple(map(n, self.gb_w)), tuple(map(n, self.gb_r)),
            tuple(map(n, self.acc_w)), tuple(map(n, self.acc_mac)), tuple(map(n, self.acc_r)), self.floor, self.done, self.refs, n(self.ref_t), self.idle_from,
        )


@dataclasses.dataclass
class Segment:
    """Device work between two barriers (SYNC/HOST): a GEMV group, an attention phase, ..."""

    kind: str = "idle"  # gemv (weight MACs only), attn (KV-row MACs), other (no MAC), idle
    cycles: int = 0
    useful_bytes: int = 0  # bytes of real weight elements streamed by the MACs (padding excluded)
    bank_bursts: int = 0  # bank bursts of all MACs in the segment
    instrs: int = 0


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


class TimingEngine:
    """Schedules instructions on a device (see the module docstring).

    Args:
        device: the device.
        table: its timing table (default: ``timing_for(device)``).
        record: keep every timed command (``commands()``) for the legality checker.
        inorder: model a simple in-order sequencer (each command issues after the
            previous one of its channel) instead of a controller that lets a command
            take an earlier free cycle when the table and the hazards allow.
        program: the program being timed, for host-op costs, layer and KV-row attribution.
    """

    def __init__(self, device: DeviceConfig, table: TimingTable | None = None, record: bool = False, program: Program | None = None, inorder: bool = False) -> None:
        self.d = device
        self.inorder = inorder
        self.t = table or timing_for(device)
        self.record = record
        self.stats = TimingStats()
        self.nbuf = max(1, int(self.t.row_buffers))
        base = Chan(device, self.nbuf)
        if record:
            self.st = [base.clone() for _ in range(device.channels)]
            for s in self.st:
                s.cmds = []
        else:
            self.st = [base] * device.channels
        self._refcount: dict[int, int] = {id(base): device.channels} if not record else {id(s): 1 for s in self.st}
        self.end = 0  # latest completion so far (all channels)
        self.step_start = 0
        self.program = program
        self.kv_rows = kv_row_set(program) if program is not None else set()
        self.layers = layer_map(program) if program is not None else None
        self.host_lat = int(math.ceil(self.t.host_latency_ns / self.t.tck_ns))
        T = self.t
        self.horizon = max(T.nRFC, T.nRC, T.nRAS, T.nFAW, T.nCWL + T.nBL + T.nWR, T.nRCDRDCP, T.nMACLAT, T.nRTP, T.nRRD) + 1
        self._groups: list | None = None
        self.row_useful = useful_rect(program) if program is not None else {}
        self.segments: list[Segment] = []
        self._seg = Segment()
        self._seg_floor = 0

    # ------------------------------------------------------------------ helpers
    def _all_groups(self) -> list[tuple[Chan, list[int]]]:
        if self._groups is None:
            self._groups = self._unique(range(self.d.channels))
        return self._groups

    def _unique(self, chans) -> list[tuple[Chan, list[int]]]:
        seen: dict[int, tuple[Chan, list[int]]] = {}
        for c in chans:
            s = self.st[c]
            e = seen.get(id(s))
            if e is None:
                seen[id(s)] = (s, [c])
            else:
                e[1].append(c)
        return list(seen.values())

    def _own(self, ch: int) -> Chan:
        s = self.st[ch]
        if self._refcount.get(id(s), 1) > 1:
            self._groups = None
            self._refcount[id(s)] -= 1
            s = s.clone()
            self.st[ch] = s
            self._refcount[id(s)] = 1
        return s

    def _split_by(self, f) -> None:
        """Split channel groups whose members would get different commands (``f(channel)`` differs)."""
        for s, chans in list(self._all_groups()):
            parts: dict = {}
            for c in chans:
                parts.setdefault(f(c), []).append(c)
            if len(parts) == 1:
                continue
            self._groups = None
            for i, part in enumerate(parts.values()):
                if i == 0:
                    self._refcount[id(s)] = len(part)
                    continue
                n = s.clone()
                self._refcount[id(n)] = len(part)
                for c in part:
                    self.st[c] = n

    def _slot(self, s: Chan, t: int) -> int:
        if self.inorder and t <= s.last:
            t = s.last + 1
        bus = s.bus
        while t in bus:
            t += 1
        bus.add(t)
        if t > s.last:
            s.last = t
        return t

    def _emit(self, s: Chan, t: int, kind: str, bank=ALL, row=-1, col=-1, k=-1, idx=-1, chans=None) -> None:
        if s.cmds is not None:
            s.cmds.append(Cmd(t, chans[0] if chans else -1, kind, bank, row, col, k, idx))

    # ------------------------------------------------------------------ refresh
    def _ref_owed(self, s: Chan, t: int) -> int:
        return t // self.t.nREFI - s.refs

    def _issue_ref(self, s: Chan, t: int, idx: int, chans) -> int:
        T = self.t
        for u in range(self.nbuf):
            if any(o != -1 for o in s.open[u * s.nb : (u + 1) * s.nb]):
                t = self._pre(s, ALL, t, idx, chans, u * s.nb)
        t = max(t, max(s.pre_t) + T.nRP, max(s.act_t) + T.nRC, s.ref_t + T.nRFC, s.floor)
        t = self._slot(s, t)
        s.ref_t = t
        s.refs += 1
        self.stats.refs += len(chans) if chans else 1
        self._emit(s, t, REF, idx=-1, chans=chans)
        s.done = max(s.done, t + T.nRFC)
        return t

    def _idle_refresh(self, s: Chan, chans) -> None:
        """Fill the idle gap before a barrier with refreshes (pull-in up to the slack)."""
        T = self.t
        if s.idle_from is None:
            return
        t0, end = s.idle_from, s.floor
        s.idle_from = None
        while True:
            owed = self._ref_owed(s, end)
            if owed <= -T.max_ref_slack:
                return
            need_pre = any(o != -1 for o in s.open)
            start = max(t0, s.ref_t + T.nRFC, max(s.act_t) + (T.nRAS if need_pre else T.nRC))
            if start + (T.nRP + 1 if need_pre else 0) + T.nRFC > end:
                return
            saved_floor = s.floor
            s.floor = start
            self._issue_ref(s, start, -1, chans)
            s.floor = saved_floor
            t0 = s.ref_t + 1

    # ------------------------------------------------------------------ row commands
    def _pre(self, s: Chan, bank: int, t0: int, idx: int, chans, base: int = 0) -> int:
        T = self.t
        banks = range(base, base + s.nb) if bank == ALL else (base + bank,)
        t = t0
        for b in banks:
            if s.open[b] != -1:
                t = max(t, s.act_t[b] + T.nRAS, max(s.rd_t[b], s.rd_all) + T.nRTP, s.wr_t[b] + T.nCWL + T.nBL + T.nWR)
        t = self._slot(s, max(t, s.floor))
        for b in banks:
            s.pre_t[b] = t
            s.open[b] = -1
        self._emit(s, t, PRE, bank, idx=idx, chans=chans)
        return t

    def _act(self, s: Chan, bank: int, row: int, t0: int, idx: int, chans, base: int = 0) -> int:
        T = self.t
        banks = range(base, base + s.nb) if bank == ALL else (base + bank,)
        while True:  # refresh first while max_ref_slack are owed at the ACT's cycle
            t = max(t0, s.floor, s.ref_t + T.nRFC)
            for b in banks:
                t = max(t, s.pre_t[b] + T.nRP, s.act_t[b] + T.nRC)
            if s.acts:
                t = max(t, s.acts[-1] + T.nRRD)
                if len(s.acts) >= 4:
                    t = max(t, s.acts[-4] + T.nFAW)
            if self._ref_owed(s, t) < T.max_ref_slack:
                break
            self._issue_ref(s, max(t0, s.floor), idx, chans)
        t = self._slot(s, t)
        for b in banks:
            s.act_t[b] = t
            s.open[b] = row
        s.acts.append(t)
        if len(s.acts) > 8:
            del s.acts[:4]
        self.stats.acts += len(chans)
        self._emit(s, t, ACT, bank, row, idx=idx, chans=chans)
        return t

    def _buffer(self, s: Chan, ins: Instr) -> int:
        """Row buffer an instruction's row uses (``row_buffers`` > 1): the one holding the row open, else the least recently activated."""
        nb = s.nb
        if ins.op is Op.MAC_AB or ins.op is Op.WR_ABK:
            sel = range(nb)
        elif ins.op in (Op.MAC_SB, Op.WR_SBK, Op.RD_SBK, Op.COPY_BK_GB, Op.COPY_GB_BK):
            sel = (ins.bank,)
        else:
            return 0
        for u in range(self.nbuf):
            if all(s.open[u * nb + b] == ins.row for b in sel):
                return u
        return min(range(self.nbuf), key=lambda u: (max(s.act_t[u * nb + b] for b in sel), u))

    # ------------------------------------------------------------------ one instruction in one channel state
    def _run(self, s: Chan, ins: Instr, idx: int, ch: int, chans) -> int:
        """Schedule ``ins`` on state ``s`` (representing ``chans``); returns its completion cycle."""
        T = self.t
        if s.idle_from is not None:
            self._idle_refresh(s, chans)
        nb = s.nb
        base = self._buffer(s, ins) * nb if self.nbuf > 1 else 0
        open_rows = s.open[base : base + nb]
        plan = unroll_instr(ins, self.d, ch, open_rows)
        end = s.floor
        first = None
        for p in plan:
            kind = p.kind
            if kind == PRE:
                tt = self._pre(s, p.bank, s.floor, idx, chans, base)
                end = max(end, tt)
            elif kind == ACT:
                tt = self._act(s, p.bank, p.row, s.floor, idx, chans, base)
                end = max(end, tt)
            elif kind == MAC:
                banks = range(base, base + nb) if p.bank == ALL else (base + p.bank,)
                ready = max(s.act_t[b] for b in banks) + T.nRCDRDMAC
                k = p.k
                t_min = max(ready, s.floor, s.acc_w[k] + T.nCWLREG, s.acc_r[k] + 1)
                t = s.col_t
                gb_w, gb_r, bus = s.gb_w, s.gb_r, s.bus
                ccd, cwl = T.nCCD, T.nCWLGB
                rec = s.cmds is not None
                inorder = self.inorder
                g = p.g
                for c in range(p.col + g, p.col + p.n + g):  # GB bursts (the row's columns in GB set g / gb bursts)
                    t = max(t + ccd, t_min, gb_w[c] + cwl)
                    if inorder and t <= s.last:
                        t = s.last + 1
                    while t in bus:
                        t += 1
                    bus.add(t)
                    if t > s.last:
                        s.last = t
                    gb_r[c] = t
                    if rec:
                        s.cmds.append(Cmd(t, chans[0], MAC, p.bank, p.row, c, k, idx))
                s.col_t = t
                if p.bank == ALL and self.nbuf == 1:
                    s.rd_all = t
                else:
                    for b in banks:
                        s.rd_t[b] = t
                s.acc_mac[k] = t
                end = max(end, t + T.nMACLAT)
                nbk = len(banks)
                self.stats.mac_bursts += p.n * len(chans)
                self.stats.mac_bank_bursts += p.n * nbk * len(chans)
                if p.row not in self.kv_rows:
                    self.stats.weight_bank_bursts += p.n * nbk * len(chans)
            elif kind == WRGB:
                t = s.ext_t
                gb_w, gb_r, bus = s.gb_w, s.gb_r, s.bus
                rec = s.cmds is not None
                for c in range(p.col + p.g, p.col + p.n + p.g):
                    t = max(t + T.nBL, s.floor, gb_r[c] + 1, gb_w[c] + 1)
                    if self.inorder and t <= s.last:
                        t = s.last + 1
                    while t in bus:
                        t += 1
                    bus.add(t)
                    if t > s.last:
                        s.last = t
                    gb_w[c] = t
                    if rec:
                        s.cmds.append(Cmd(t, chans[0], WRGB, ALL, -1, c, -1, idx))
                s.ext_t = t
                end = max(end, t + T.nCWLGB)
            elif kind == WRACC or kind == RDACC:
                k = p.k
                if kind == WRACC:
                    t0 = max(s.floor, s.acc_mac[k] + T.nMACLAT, s.acc_r[k] + 1)
                else:
                    t0 = max(s.floor, s.acc_mac[k] + T.nMACLAT, s.acc_w[k] + T.nCWLREG)
                t = s.ext_t
                for i in range(p.n):
                    t = self._slot(s, max(t + T.nBL, t0))
                    self._emit(s, t, kind, ALL, -1, i, k, idx, chans)
                s.ext_t = t
                if kind == WRACC:
                    s.acc_w[k] = t
                    end = max(end, t + T.nCWLREG)
                else:
                    s.acc_r[k] = t
                    end = max(end, t + T.nCLREG + T.nBL)
            elif kind == EW:
                from nhil.timing.ew import schedule_ew

                end = max(end, schedule_ew(self, s, p, idx, chans))
            else:  # WR, RD, RDCP, WRCP: bank data accesses
                b = p.bank
                banks = range(base, base + nb) if b == ALL else (base + b,)
                rcd = {WR: T.nRCDWR, RD: T.nRCDRD, RDCP: T.nRCDRDCP, WRCP: T.nRCDWRCP}[kind]
                ready = max(s.act_t[x] for x in banks) + rcd
                t = s.col_t
                te = s.ext_t
                for c in range(p.col, p.col + p.n):
                    lo = max(t + T.nCCD, ready, s.floor)
                    if kind in (WR, RD):
                        lo = max(lo, te + T.nBL)
                    if kind == WRCP:
                        lo = max(lo, s.gb_w[c] + T.nCWLGB)
                    if kind == RDCP:
                        lo = max(lo, s.gb_r[c] + 1)
                    t = self._slot(s, lo)
                    if kind in (WR, RD):
                        te = t
                    if kind == RDCP:
                        s.gb_w[c] = t
                    if kind == WRCP:
                        s.gb_r[c] = t
                    self._emit(s, t, kind, b, p.row, c, -1, idx, chans)
                s.col_t = t
                s.ext_t = te
                for x in banks:
                    if kind in (WR, WRCP):
                        s.wr_t[x] = t
                    else:
                        s.rd_t[x] = t
                lat = {WR: T.nCWL + T.nBL, RD: T.nCL + T.nBL, RDCP: T.nCWLGB, WRCP: T.nCWL}[kind]
                end = max(end, t + lat)
            if first is None:
                first = s.floor
        s.done = max(s.done, end)
        return end

    # ------------------------------------------------------------------ public
    def _barrier(self, extra: int) -> int:
        """All channels wait for everything issued, plus ``extra`` cycles; returns the new floor."""
        uniq = self._all_groups()
        dev_done = max(max(s.done for s, _ in uniq), self.end)
        b = dev_done + extra
        seg = self._seg
        if seg.instrs:
            seg.cycles = dev_done - self._seg_floor
            self.segments.append(seg)
        self._seg = Segment()
        self._seg_floor = b
        for s, chans in uniq:
            if s.idle_from is None:
                s.idle_from = dev_done  # device-wide, so that identical channels stay identical
            s.done = dev_done
            s.floor = b
            s.bus = {x for x in s.bus if x >= b}
        self._merge()
        return b

    def _merge(self) -> None:
        if self.record:
            return
        uniq = self._all_groups()
        if len(uniq) == 1:
            return
        self._groups = None
        by_key: dict[tuple, Chan] = {}
        for s, chans in uniq:
            kk = s.key(self.horizon)
            keep = by_key.setdefault(kk, s)
            if keep is not s:
                for c in chans:
                    self.st[c] = keep
                self._refcount[id(keep)] = self._refcount.get(id(keep), 0) + len(chans)
                self._refcount.pop(id(s), None)

    def add(self, idx: int, ins: Instr) -> None:
        """Time one instruction (position flags bound; HOST/SYNC/EOC included)."""
        op = ins.op
        kind = instr_kind(ins, self.kv_rows, self.program.host_ops if self.program is not None else None)
        self.stats.count_by_kind[kind] += 1
        before = self.end
        if op is Op.SYNC:
            self.end = self._barrier(self.host_lat)
        elif op is Op.HOST:
            cost = host_op_cycles(self.program, self.program.host_ops[ins.imm], self.t) if self.program is not None else 0
            self.end = self._barrier(cost)
        elif op is Op.EOC:
            self.end = self._barrier(0)
            self.stats.steps.append(self.end - self.step_start)
            self.step_start = self.end
        elif op in (Op.NOP, Op.SET_CFR):
            pass
        else:
            seg = self._seg
            seg.instrs += 1
            if op is Op.MAC_AB or op is Op.MAC_SB or op is Op.MAC_ABV:
                nch = self.d.channels if ins.flags & ALL_CH else 1
                nb = self.d.banks if op is not Op.MAC_SB else 1
                seg.bank_bursts += ins.n * nb * nch
                if ins.row in self.kv_rows:
                    seg.kind = "attn"
                else:
                    if seg.kind != "attn":
                        seg.kind = "gemv"
                    rect = self.row_useful.get(ins.row)
                    if rect is not None and not ins.flags & ALL_CH:  # used slots of this channel (rows are filled from slot 0)
                        rect = (max(0, min(self.d.banks, rect[0] - ins.ch * self.d.banks)), rect[1])
                    u = mac_useful_elems(rect, ins.col, ins.n, self.d.lanes)
                    if op is Op.MAC_SB:
                        u = u // self.d.banks
                    seg.useful_bytes += 2 * u
            elif seg.kind == "idle":
                seg.kind = "other"
            if ins.flags & ALL_CH:
                if (op is Op.WR_ACC or op is Op.RD_ACC) and not (ins.col == 0 and ins.n >= self.d.slots):
                    self._split_by(lambda c: acc_bursts(ins, self.d, c))
                groups = self._all_groups()
                ends = [self._run(s, ins, idx, chans[0], chans) for s, chans in groups]
            else:
                s = self._own(ins.ch)
                ends = [self._run(s, ins, idx, ins.ch, [ins.ch])]
            self.end = max(self.end, max(ends))
        exposed = self.end - before
        self.stats.exposed_by_kind[kind] += exposed
        if self.layers is not None and idx < len(self.layers):
            self.stats.exposed_by_layer[self.layers[idx]] += exposed
        self.stats.cycles = self.end

    def run_program(self, program: Program | None = None, pos: int = 0) -> TimingStats:
        """Time one run of ``program`` (position-relative instructions bound at ``pos``)."""
        p = program or self.program
        for i in timed_order(p):
            self.add(i, bind_template(p.instrs[i], self.d, pos))
        return self.stats

    def commands(self) -> list[Cmd]:
        """Every timed command (``record=True`` only), ordered by channel and time."""
        out = []
        for ch, s in enumerate(self.st):
            out.extend(c._replace(ch=ch) for c in (s.cmds or []))
        out.sort(key=lambda c: (c.ch, c.t))
        return out
