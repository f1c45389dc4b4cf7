"""Scheduling and placement passes: named and toggleable (run by ``nhil.compiler.pipeline.PassManager``).

Every optimisation the compiler makes for device bandwidth is a named pass; the *naive
baseline* is the program compiled with none of them, and the default pipeline
(:data:`PIPELINE`) has all of them on. Passes run at one of three stages:

* ``lower``: read by :class:`~nhil.compiler.builder.ProgramBuilder` while it places and
  emits GEMVs (it is built with the pass list: ``lower_decode_graph(..., passes=)``, which
  ``nhil.compiler.pipeline`` passes explicitly);
* ``program``: functions ``Program -> Program`` over the instruction stream;
* ``command``: decisions of the command-level schedule (L1 -> L2), recorded in
  ``program.info["passes"]`` and honoured by the timing model (``nhil.timing``).

Passes (in pipeline order) and what their absence means:

* ``bank-spread`` (lower): a bf16 weight matrix's output rows go to every slot of the
  device (slot ``o % slots``: all channels x all banks MAC at once). Baseline: the
  matrix fills channel 0's banks row after row (``banks`` outputs per row-group; MAC_AB,
  WR_ACC and RD_ACC address channel 0 only), as a plain DRAM allocation would.
* ``row-locality`` (lower): each all-bank MAC_AB streams a whole row chunk, so every row
  is activated once per GEMV. Baseline: each chunk's MACs are cut into
  :data:`NAIVE_PIECES` column pieces interleaved across the batch's accumulators
  (piece 0 of every row-group, then piece 1, ...), so every row is activated
  ``NAIVE_PIECES`` times (row-interleaved placement without locality).
* ``vector-reuse`` (program): a WR_GB of the vector the global buffer already holds is
  dropped (one broadcast per chunk serves all accumulators). Baseline: the builder
  re-broadcasts the input chunk before every MAC_AB (per accumulator).
* ``handoff-batch`` (program): a SYNC is kept only where the host must hold read-back
  data (before a HOST call, before a WR_* that sends back a buffer read since the last
  barrier, at the end of the step); GEMVs between two host kernels then run as one
  device block. Baseline: one host/PIM hand-off (SYNC) after every GEMV.
* ``gemv-batch`` (program): broadcast-vector and accumulator reuse across matrices that
  read the same input (q/k/v of one x; gate/up of one x; the experts of one token): their
  accumulator units are regrouped into batches of ``accumulators`` units, so each input
  chunk is written once per batch instead of once per matrix-batch.
* ``gb-overlap`` (command): global-buffer writes (WR_GB of the next chunk) and
  accumulator readbacks/zeroing (RD_ACC/WR_ACC) are interleaved with the MAC bursts on
  the command bus (WRGB and MAC use different buses, as AiM's command scheduler
  allows). Baseline: commands issue in program order, so these serialise with the MACs
  (``TimingEngine(inorder=True)``).

Opt-in passes (``PassInfo.default = False``: not in :data:`PIPELINE`, so the zoo programs are
unchanged; :data:`ORDER` is the order of every pass): ``ew-swiglu`` and ``ew-residual``
(``nhil.compiler.ew_lower``: SwiGLU gating and residual adds as the in-device EWMUL / EWADD / AF;
``ew-swiglu`` changes values, to what ``info["ew_silu"]`` tells the reference) and ``host-overlap``
(``nhil.compiler.host_overlap``: device work next to the host kernels it does not depend on, timed
with host/device overlap).

Numerics: no default pass changes any value. Every accumulator receives the same bursts (rows,
columns, global-buffer contents) in the same order (a MAC of ``n`` bursts accumulates
burst by burst, ``nhil.numerics.mac.mac_bursts``, so cutting it into column pieces is
exact), and the placement only moves whole output rows between slots; outputs are **bit-identical** for every
subset of passes (``tests/test_schedule.py`` runs llama-tiny on the simulator).
"""


from __future__ import annotations

import dataclasses
from typing import Callable

from nhil.errors import SetupError
from nhil.isa.instr import ALL_CH, OPINFO, Instr, Op
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
    """The ``gemv-batch`` pass (module docstring); declines on runs it does not recognise (e.g. MACs cut into column pieces)."""
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
    return _replace_instrs(p, out, "gemv-batch")


def _replace_instrs(p: Program, instrs: list[Instr], name: str) -> Program:
    info = dict(p.info)
    info["schedule"] = list(info.get("schedule", [])) + [name]
    q = dataclasses.replace(p, instrs=instrs, info=info)
    q.validate()
    return q


def vector_reuse(p: Program) -> Program:
    """The ``vector-reuse`` pass: drop a WR_GB whose (operand, col, n) the global buffer already holds.

    The GB's content is tracked per written range from the WR_GBs of the current device
    run; a barrier (SYNC/HOST/EOC: the host may rewrite the operand's buffer), a
    COPY_BK_GB (bank -> GB) or a readback into the operand's buffer forgets it, so only
    provably redundant writes are dropped.
    """
    out: list[Instr] = []
    held: list[tuple[int, int, int]] = []  # (col, n, operand) ranges the GB holds
    for ins in p.instrs:
        op = ins.op
        if op in BARRIERS or op is Op.COPY_BK_GB:
            held = []
        elif op is Op.WR_GB and ins.flags & ALL_CH:
            key = (ins.col, ins.n, ins.operand)
            if key in held:
                continue
            held = [h for h in held if h[0] + h[1] <= ins.col or ins.col + ins.n <= h[0]] + [key]
        elif op is Op.WR_GB:
            held = []  # a single-channel write makes channels differ: forget everything
        elif OPINFO[op].data_out and ins.operand < len(p.operands):
            buf = p.operands[ins.operand].buffer
            held = [h for h in held if p.operands[h[2]].buffer != buf]
        out.append(ins)
    return _replace_instrs(p, out, "vector-reuse")


def handoff_batch(p: Program) -> Program:
    """The ``handoff-batch`` pass: remove every SYNC the host does not need (module docstring)."""
    out: list[Instr] = []
    pending: set[str] = set()
    instrs = p.instrs
    for i, ins in enumerate(instrs):
        op = ins.op
        if op is Op.SYNC:
            nxt = instrs[i + 1].op if i + 1 < len(instrs) else Op.EOC
            if nxt in BARRIERS or _needs_before_next_barrier(instrs, i, pending, p.operands):
                out.append(ins)
                pending = set()
            continue
        if op in BARRIERS:
            pending = set()
        elif OPINFO[op].data_out:
            pending.add(p.operands[ins.operand].buffer)
        out.append(ins)
    return _replace_instrs(p, out, "handoff-batch")


def _needs_before_next_barrier(instrs: list[Instr], i: int, pending: set[str], operands) -> bool:
    """Does a data-in instruction after ``i`` (before the next barrier) send a buffer read back since the last kept barrier?"""
    for ins in instrs[i + 1 :]:
        if ins.op in BARRIERS:
            return False
        if OPINFO[ins.op].data_in and operands[ins.operand].buffer in pending:
            return True
    return False


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """A pass: its ``name``, ``stage`` (``lower`` / ``program`` / ``command``), what it does and what its absence means."""

    name: str
    stage: str
    does: str
    baseline: str
    fn: Callable[[Program], Program] | None = None
    default: bool = True  # in the default pipeline (PIPELINE); opt-in passes (False) reorder or change the zoo programs


PASS_INFO: dict[str, PassInfo] = {
    "bank-spread": PassInfo("bank-spread", "lower", "weights over every channel x bank: all banks MAC", "a matrix fills channel 0's banks row after row (single-channel MACs)"),
    "row-locality": PassInfo("row-locality", "lower", "one activate per row: each MAC_AB streams a whole row chunk", "MACs cut into column pieces interleaved across accumulators (each row activated per piece)"),
    "vector-reuse": PassInfo("vector-reuse", "program", "one GB broadcast of the input chunk serves every accumulator", "input chunk re-broadcast (WR_GB) before every MAC_AB", vector_reuse),
    "handoff-batch": PassInfo("handoff-batch", "program", "SYNC only where the host needs read-back data", "one host/PIM hand-off (SYNC) after every GEMV", handoff_batch),
    "gemv-batch": PassInfo("gemv-batch", "program", "accumulator batches span matrices that share an input (q/k/v, gate/up)", "batches of one matrix at a time", gemv_batch),
    "gb-overlap": PassInfo("gb-overlap", "command", "WR_GB / RD_ACC / WR_ACC bursts interleaved with MAC bursts", "commands issue in program order (GB writes serialised with MACs)"),
}


def _host_overlap(p: Program) -> Program:
    from nhil.compiler.host_overlap import host_overlap

    return host_overlap(p)


def _ew_swiglu(p: Program) -> Program:
    from nhil.compiler.ew_lower import ew_swiglu

    return ew_swiglu(p)


def _ew_residual(p: Program) -> Program:
    from nhil.compiler.ew_lower import ew_residual

    return ew_residual(p)


# opt-in passes (issue 17 item 4; not in the default pipeline: they reorder / change the zoo programs)
PASS_INFO["ew-swiglu"] = PassInfo("ew-swiglu", "program", "SwiGLU's silu(g)*u in the device: AF silu + EWMUL on the gate/up accumulators (values: LUT SiLU, docs/isa.md)",
                                  "HOST silu_mul on read-back gate and up", _ew_swiglu, default=False)
PASS_INFO["ew-residual"] = PassInfo("ew-residual", "program", "residual adds after o_proj / down in the device: WR_ACC x + EWADD (bit-identical)",
                                    "HOST add on the read-back GEMV output", _ew_residual, default=False)
PASS_INFO["host-overlap"] = PassInfo("host-overlap", "program", "device work independent of a host kernel moved next to it; the timing model overlaps them",
                                     "host kernels and hand-offs idle the device", _host_overlap, default=False)
ORDER: tuple[str, ...] = tuple(PASS_INFO)  # every pass, in the order a pass list runs them
PIPELINE: tuple[str, ...] = tuple(n for n in ORDER if PASS_INFO[n].default)  # the default pipeline, in this order
OPT_IN: tuple[str, ...] = tuple(n for n in ORDER if not PASS_INFO[n].default)
PASSES: dict[str, Callable[[Program], Program]] = {n: i.fn for n, i in PASS_INFO.items() if i.stage == "program"}  # Program -> Program passes
NAIVE_PIECES = 4  # column pieces per row chunk without row-locality

def apply_passes(p: Program, names: list[str]) -> Program:
    """Run the named program-stage passes in the given order (no lowering change)."""
    for n in names:
        if n not in PASSES:
            raise SetupError(f"unknown program pass {n!r}; program passes: {', '.join(PASSES)}")
        p = PASSES[n](p)
    return p
