"""Host/device overlap in the timing model (issue 17 item 4; ``docs/timing-model.md`` "Host overlap").

:class:`TimingEngine` treats ``SYNC`` and ``HOST`` as device barriers: after a hand-off the
device idles for ``host_latency_ns``, during a host kernel it idles for the kernel's time.
:class:`HostOverlapEngine` keeps the device barrier of ``SYNC`` (every earlier device
instruction completes before a later one issues) but puts the hand-off latency and the
host kernels on a **host timeline**, and makes device instructions wait only for the
host data they need (buffer-level data dependence):

* ``SYNC`` at device completion ``D``: the buffers read back since the previous SYNC reach
  the host at ``D + host_latency``; the device may issue again at ``D``;
* ``HOST k``: starts when the host is free and every input buffer is on the host (its
  readback delivered, or the host kernel that wrote it finished), takes the kernel's
  time (``host_op_cycles``), then its outputs are available;
* a data-in instruction (``WR_GB``, ``WR_ACC``, ``WR_SBK``, ``WR_ABK``) waits until its
  operand buffer is available on the host; every later instruction of its channel
  stays behind it (the command queue is in order up to the controller's reordering);
* a data-out instruction (``RD_ACC``, ``RD_SBK``) waits until every host kernel reading
  its buffer finished (the host must not see its input overwritten);
* ``EOC`` ends the step when the last readbacks are on the host and the host is idle;
* with ``TimingTable.forward_latency_ns`` set (a what-if study, not a device), a buffer no host
  kernel reads is available ``forward_latency_ns`` after its SYNC instead of ``host_latency_ns``.

So device work that does not depend on a host kernel (the V append while the host ropes
q and k, the next batch's accumulator zeroing, ...) runs while the host computes; the
``host-overlap`` program pass (``nhil.compiler.host_overlap``) moves such work next to the
host kernels. A chain in which every device instruction depends on the host output before
it costs what :class:`TimingEngine` charges, except that device work not needing the host
data (e.g. ``WR_ACC`` of constant zeros) is no longer delayed by the hand-off latency.

Accounting: exposed cycles (how far an instruction moved the end of the timeline) as in
the base engine; time the timeline waits for a readback to reach the host is charged to
``SYNC``, a host kernel's own time to ``HOST.<kernel>``. They still sum to the total.
"""

from __future__ import annotations

import math

from nhil.isa.instr import NO_OPERAND, OPINFO, Instr, Op
from nhil.isa.program import Program
from nhil.timing.engine import Segment, TimingEngine, host_op_cycles, instr_kind

OVERLAP_PASS = "host-overlap"


def overlap_for(program: Program) -> bool:
    """Whether ``program`` is timed with host/device overlap: its ``info["passes"]`` holds ``host-overlap``."""
    return OVERLAP_PASS in (program.info.get("passes") or ())


def engine_for(program: Program, device=None, table=None, *, inorder: bool = False, overlap: bool | None = None, record: bool = False) -> TimingEngine:
    """The timing engine of ``program``: :class:`HostOverlapEngine` if ``overlap`` (default :func:`overlap_for`), else :class:`TimingEngine`."""
    if overlap is None:
        overlap = overlap_for(program)
    cls = HostOverlapEngine if overlap else TimingEngine
    return cls(device or program.device, table, record=record, program=program, inorder=inorder)


class HostOverlapEngine(TimingEngine):
    """:class:`TimingEngine` with host kernels and hand-offs on their own timeline (module docstring).

    Needs ``program`` (host ops and operand buffers). Attributes beyond the base engine:
    ``host_free`` (cycle the host finishes its last kernel), ``avail`` (buffer -> cycle it is on the host).
    """

    MODELS_FORWARD = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        if self.program is None:
            raise ValueError("HostOverlapEngine needs the program (host ops and operand buffers)")
        self.host_free = 0
        self.avail: dict[str, int] = {}  # buffer -> cycle from which the host holds it
        self.pending: set[str] = set()  # buffers read back since the last SYNC
        self.host_reads: dict[str, int] = {}  # buffer -> end of the latest host kernel reading it
        self.last_delivery = 0
        fwd = self.t.forward_latency_ns
        self.fwd_lat = None if fwd is None else int(math.ceil(fwd / self.t.tck_ns))
        self.host_inputs = {b for h in self.program.host_ops for b in h.inputs}  # buffers some host kernel reads

    # ------------------------------------------------------------ helpers
    def _dev_end(self) -> int:
        return max(max(s.done, s.floor) for s, _ in self._all_groups())

    def _charge(self, idx: int, kind: str, before: int) -> None:
        exposed = self.end - before
        self.stats.exposed_by_kind[kind] += exposed
        if self.layers is not None and idx < len(self.layers):
            self.stats.exposed_by_layer[self.layers[idx]] += exposed
        self.stats.cycles = self.end

    def _advance(self, idx: int, t: int, kind: str) -> None:
        """Move the end of the timeline to ``t`` (if later), charging the wait to ``kind``."""
        if t > self.end:
            before = self.end
            self.end = t
            self._charge(idx, kind, before)

    def _wait(self, t: int) -> None:
        """Every channel issues nothing before cycle ``t`` (the device waits for host data); cuts the segment."""
        dev = self._dev_end()
        if t <= dev:
            for s, _ in self._all_groups():
                s.floor = max(s.floor, t)
            return
        seg = self._seg
        if seg.instrs:
            seg.cycles = dev - self._seg_floor
            self.segments.append(seg)
        self._seg = Segment()
        self._seg_floor = t
        for s, _ in self._all_groups():
            if s.idle_from is None:
                s.idle_from = dev
            s.floor = t
            s.bus = {x for x in s.bus if x >= t}

    def _device_barrier(self) -> int:
        """SYNC's device side: all channels wait for the device work issued so far (not for the host)."""
        saved = self.end
        self.end = self._dev_end()
        b = self._barrier(0)
        self.end = max(saved, b)
        return b

    # ------------------------------------------------------------ public
    def add(self, idx: int, ins: Instr) -> None:
        """Time one instruction (position flags bound) with host/device overlap."""
        op = ins.op
        p = self.program
        if op is Op.SYNC:
            self.stats.count_by_kind["SYNC"] += 1
            before = self.end
            d = self._device_barrier()
            t = d + self.host_lat
            for b in self.pending:
                fwd = self.fwd_lat is not None and b not in self.host_inputs
                self.avail[b] = d + self.fwd_lat if fwd else t
            self.last_delivery = max((self.avail[b] for b in self.pending), default=t)  # t for every buffer unless forwarded
            self.pending = set()
            self._charge(idx, "SYNC", before)
            return
        if op is Op.HOST:
            h = p.host_ops[ins.imm]
            kind = instr_kind(ins, self.kv_rows, p.host_ops)
            self.stats.count_by_kind[kind] += 1
            if any(b in self.pending for b in h.inputs):  # read back without a SYNC: deliver now
                self.add(idx, Instr(Op.SYNC))
                self.stats.count_by_kind["SYNC"] -= 1
            t_in = max([self.host_free] + [self.avail.get(b, 0) for b in h.inputs])
            self._advance(idx, t_in, "SYNC")  # waiting for the hand-off
            end = t_in + host_op_cycles(p, h, self.t)
            self.host_free = end
            for o in h.outputs:
                self.avail[o] = end
            for b in h.inputs:
                self.host_reads[b] = max(self.host_reads.get(b, 0), end)
            self._advance(idx, end, kind)
            return
        if op is Op.EOC:
            self._advance(idx, max(self.last_delivery, self.host_free), "SYNC")
            super().add(idx, ins)
            return
        info = OPINFO[op]
        if ins.operand != NO_OPERAND and ins.operand < len(p.operands) and (info.data_in or info.data_out):
            buf = p.operands[ins.operand].buffer
            if info.data_in:
                t = self.avail.get(buf, 0)
                if t > self._dev_end() or any(s.floor < t for s, _ in self._all_groups()):
                    self._advance(idx, t, "SYNC")
                    self._wait(t)
            else:
                t = self.host_reads.get(buf, 0)
                if t:
                    self._wait(t)
                self.pending.add(buf)
        super().add(idx, ins)
