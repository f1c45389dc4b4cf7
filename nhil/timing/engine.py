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

Modules: the channel state is :mod:`nhil.timing.chan`, the channel groups, bus slots, refresh
and ACT/PRE are :mod:`nhil.timing.controller` (this engine's base class), the statistics and
what the engine reads from a program are :mod:`nhil.timing.accounting` (re-exported here).

Cycle accounting: every instruction's *exposed* cycles are how far it pushed the end
of the timeline (its completion minus the latest completion before it, if positive);
they sum to the total, so the breakdown per instruction kind and per layer is exact.
"""

from __future__ import annotations

import math

from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, Instr, Op
from nhil.isa.program import Program
from nhil.timing.accounting import (  # noqa: F401  (re-exported: nhil.timing.engine is where callers import them from)
    TimingStats,
    bind_template,
    host_op_cycles,
    instr_kind,
    kv_row_set,
    layer_map,
    mac_useful_elems,
    timed_order,
    useful_elems,
    useful_rect,
)
from nhil.timing.chan import NEG, Chan, Segment  # noqa: F401  (re-exported)
from nhil.timing.commands import acc_bursts, ACT, ALL, EW, MAC, PRE, RD, RDACC, RDCP, WR, WRACC, WRCP, WRGB, Cmd, unroll_instr
from nhil.timing.controller import ChannelController
from nhil.timing.table import TimingTable, timing_for


class TimingEngine(ChannelController):
    """Schedules instructions on a device (see the module docstring).

    Args:
        device: the device.
        table: its timing table (default: ``timing_for(device)``).
        record: keep every timed command (``commands()``) for the legality checker.
        inorder: model a simple in-order sequencer (each command issues after the
            previous one of its channel) instead of a controller that lets a command
            take an earlier free cycle when the table and the hazards allow.
        program: the program being timed, for host-op costs, layer and KV-row attribution.

    Raises:
        ValueError: ``table.forward_latency_ns`` is set and the engine does not model it (``MODELS_FORWARD``).
    """

    MODELS_FORWARD = False  # whether the engine models TimingTable.forward_latency_ns (HostOverlapEngine does)

    def __init__(self, device: DeviceConfig, table: TimingTable | None = None, record: bool = False, program: Program | None = None, inorder: bool = False) -> None:
        self.d = device
        self.inorder = inorder
        self.t = table or timing_for(device)
        if self.t.forward_latency_ns is not None and not self.MODELS_FORWARD:  # a what-if this engine would ignore
            raise ValueError(f"{type(self).__name__} does not model TimingTable.forward_latency_ns: time the program with "
                             "nhil.timing.overlap.HostOverlapEngine (its passes hold host-overlap), or leave it None")
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
