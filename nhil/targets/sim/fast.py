"""The simulator's fast path: the same ISA semantics as ``PimState.step``, fewer Python steps per instruction.

``FastPimState.run_block`` executes a block of resolved instructions and gives the same
state, readbacks, counters and errors as calling ``PimState.step`` on each in turn
(``SimTarget(reference=True)`` keeps that per-instruction path as the reference):

* **bf16 MACs** (``MAC_AB``/``MAC_SB`` with CFR ``W_FMT`` = 0) run in the compiled kernel
  of ``nhil.targets.sim.kernels``: weights are read from the bank state in place (no
  per-MAC copy and fp32 decode of the row), bursts summed in their fixed order. An
  instruction's bounds are checked once per distinct instruction word (cached); one that
  fails its checks goes to ``PimState.step``, which raises the named error.
* **MAC_ABV** (prefill extension, bf16 rows) runs in ``kernels.mac_bf16_vec``: each weight burst read once for
  every vector.
* **GEMV runs** (``ResolvedGemvRun``: consecutive WR_GB / WR_ACC / MAC_AB / MAC_SB / MAC_ABV / RD_ACC
  without position flags, bound as arrays by ``nhil.runtime.bind_runs``) run in one call of ``kernels.gemv_run``:
  each instruction is checked against the device-semantics table once per run (cached on its binding
  plan), then executed in order with ``step``'s semantics; a run that fails a check, or meets rows in a
  quantized format (CFR W_FMT != 0), runs instruction by instruction as below (so does every run while
  ``kernels.mac_bf16`` or ``mac_bf16_vec`` is replaced, as a test's mutant replaces it: ``gemv_run`` calls the
  compiled ones).
* **Padding rows**: a GEMV run's MAC on a channel whose part of the row is all ``+0`` (``FastPimState.zero_rows``,
  marked at ``load_images``, dropped by every write through ``drop_decoded``) is skipped where that provably leaves
  every accumulator bit as it is (``kernels._zero_row_mac_is_noop_py``): the unfilled last tile of a GEMV whose
  outputs are not a multiple of channels x banks (SmolLM2's 576- and 192-wide projections) reads no weights.
* **Runs of WR_SBK** (KV-cache appends: one per burst of K, one per element of Vᵀ) to
  distinct locations become one scatter into the bank state, whether they arrive as
  ``ResolvedInstr`` or as one ``ResolvedRun`` (bound as arrays by ``nhil.runtime.bind_runs``).
* **WR_GB, WR_ACC, RD_ACC** are executed here without the per-instruction bounds table once their
  word has passed it (cached), with ``PimState.step``'s semantics (set selection, bf16 readback).
* **SYNC** cuts the readback digest here once its word has passed the table (cached).
* Everything else (and quantized MACs, whose decoded rows ``PimState`` already caches per
  (row, format)) is ``PimState.step``.
"""

from __future__ import annotations

import weakref

import numpy as np

from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, CFR_W_FMT, Instr, Op
from nhil.isa.semantics import check_instr
from nhil.numerics.bf16 import round_to_bf16
from nhil.targets.base import ReadbackRun, ResolvedGemvRun, ResolvedInstr, ResolvedRun
from nhil.targets.sim import kernels, wr_sbk
from nhil.targets.sim.kernel_threads import spans_at_once, threads
from nhil.targets.sim.device import PimState


_GEMV_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # GemvRun plan -> {device: table or None}
THREADED_MIN_MACS = 1 << 18  # a GEMV run with fewer MACs runs on the caller's thread: a hand-off costs more than it saves



def _channel_rows(tab: np.ndarray, channels: int, banks: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, ptr)``: the rows of GEMV-run table ``tab`` (``G_*`` columns) that touch each channel, in table order,
    as one index array and its offsets (``rows[ptr[c]:ptr[c + 1]]`` for channel ``c``, ``ptr`` int64 [channels + 1]),
    so that a channel's pass over a run skips the instructions that touch only other channels without reading them:
    single-channel ones, and a WR_ACC / RD_ACC whose elements ``[col, col + n)`` (element ``q`` in channel
    ``c0 + q // banks``) hold none of the channel's (a prefill's score readbacks: 80 elements, 5 of 32 channels)."""
    c = np.arange(channels)[:, None]
    c0 = tab[None, :, kernels.G_C0]
    hit = (c0 <= c) & (c < tab[None, :, kernels.G_C1])  # [channels, m]
    acc = np.isin(tab[:, kernels.G_CODE], (kernels.G_WR_ACC, kernels.G_RD_ACC))[None, :]
    first = c0 + tab[None, :, kernels.G_COL] // banks  # channel of the first / last element of a WR_ACC / RD_ACC
    last = c0 + (tab[None, :, kernels.G_COL] + tab[None, :, kernels.G_N] - 1) // banks
    hit &= ~acc | ((first <= c) & (c <= last) & (tab[None, :, kernels.G_N] > 0))
    ch, rows = np.nonzero(hit)
    ptr = np.zeros(channels + 1, np.int64)
    np.cumsum(np.bincount(ch, minlength=channels), out=ptr[1:])
    return rows.astype(np.int64), ptr


class FastPimState(PimState):
    """``PimState`` plus :meth:`run_block` (see the module docstring)."""

    def __init__(self, device, reserve_rows: int = 8) -> None:
        super().__init__(device, reserve_rows)
        self._mac_ok: dict = {}  # instruction word -> (c0, c1, b0, b1) once its bounds passed
        self._kernels = kernels.AVAILABLE and device.lanes == 16  # the compiled kernels assume 16 lanes per burst
        self.kernel_threads = threads() if self._kernels else 1  # GEMV runs: channel spans run at once (kernel_threads.threads)

    def _store(self, mem_t: np.ndarray) -> None:
        """``PimState._store``, with :attr:`zero_rows` grown to the new slot count (new slots: not known zero)."""
        super()._store(mem_t)
        z = np.zeros(mem_t.shape[:2], np.bool_)  # [channels, slots]
        old = getattr(self, "zero_rows", None)
        if old is not None:
            z[:, : old.shape[1]] = old
        self.zero_rows = z  # [c, s]: channel c's part of row slot s is known to be all +0 bits (set by load_images)

    def load_images(self, images) -> None:
        """``PimState.load_images``, then :attr:`zero_rows` of each image: the channels whose part of the row is all
        zero bits (the padding of a GEMV whose outputs do not fill its last tile), which ``kernels.gemv_run`` may skip."""
        super().load_images(images)
        self._mark_zero_rows(images)

    def reload_images(self, images) -> list:
        """``PimState.reload_images``, then :attr:`zero_rows` of the images it rewrote."""
        redo = super().reload_images(images)
        self._mark_zero_rows(redo)
        return redo

    def _mark_zero_rows(self, images) -> None:
        for img in images:
            if img.data is not None:
                s = int(self.row_slot[img.row])
                self.zero_rows[:, s] = ~self.mem_t[:, s].any(axis=(1, 2))

    def drop_decoded(self, s: int) -> None:
        """``PimState.drop_decoded`` (every write to slot ``s`` calls it), and slot ``s`` no longer known zero."""
        self.zero_rows[:, s] = False
        super().drop_decoded(s)

    def run_block(self, block, digest) -> list[np.ndarray]:
        """Execute ``block`` (``ResolvedInstr`` list) in order; readbacks are returned and fed to ``digest``.

        Raises:
            RunError: as ``PimState.step`` (the first failing instruction, by name).
        """
        out = []
        whole = None  # a GEMV run's ReadbackRun while it holds every readback of the block so far (returned as is)
        n = len(block)
        i = 0
        while i < n:
            item = block[i]
            if item.__class__ is ResolvedGemvRun:
                rr = self._gemv_run(item, digest)
                if whole is None and not out and rr.__class__ is ReadbackRun:
                    whole = rr
                else:
                    if whole is not None:
                        out[:0] = whole
                        whole = None
                    out.extend(rr)
                i += 1
                continue
            if item.__class__ is ResolvedRun:
                self._run_of_appends(item)
                i += 1
                continue
            idx, ins, payload = item
            op = ins.op
            if (op is Op.MAC_AB or op is Op.MAC_SB) and self._kernels and self._mac(ins):
                i += 1
                continue
            if op is Op.MAC_ABV and self._kernels and self._mac_v(ins):
                i += 1
                continue
            if op is Op.WR_GB or op is Op.WR_ACC or op is Op.RD_ACC:
                r = self._gb_acc(idx, ins, payload)
                if r is not False:
                    if r is not None:
                        out.append(r)
                        digest.add(r)
                    i += 1
                    continue
            if op is Op.SYNC and self._checked(ins) is not None:
                self.counts["SYNC"] = self.counts.get("SYNC", 0) + 1
                digest.sync(idx)
                i += 1
                continue
            if op is Op.WR_SBK:
                j = i + 1
                while j < n and block[j].__class__ is ResolvedInstr and block[j][1].op is Op.WR_SBK:
                    j += 1
                if j - i > 1 and self._wr_sbk_run(block, i, j):
                    i = j
                    continue
            r = self.step(idx, ins, payload)
            if r is not None:
                out.append(r)
                digest.add(r)
            elif op is Op.SYNC:
                digest.sync(idx)
            i += 1
        if whole is not None:
            return whole if not out else list(whole) + out
        return out

    def _mac(self, ins) -> bool:
        """One bf16 MAC through the kernel; False (nothing done) when it needs ``step`` (bad bounds, quantized rows)."""
        d = self.d
        v = self._mac_ok.get(ins)
        if v is None:
            if ins.row >= d.rows or ins.k >= d.accumulators or ins.n == 0 or (ins.col + ins.n) * d.lanes > d.cols:
                return False
            if ins.flags & ALL_CH:
                c0, c1 = 0, d.channels
            elif ins.ch < d.channels:
                c0, c1 = ins.ch, ins.ch + 1
            else:
                return False
            if ins.op is Op.MAC_SB:
                if ins.bank >= d.banks:
                    return False
                b0, b1 = ins.bank, ins.bank + 1
            else:
                b0, b1 = 0, d.banks
            v = self._mac_ok[ins] = (c0, c1, b0, b1)
        c0, c1, b0, b1 = v
        if self.cfr[c0:c1, CFR_W_FMT].any():
            return False
        name = ins.op.name
        self.counts[name] = self.counts.get(name, 0) + 1
        kernels.mac_bf16(self.mem_t, self.gb, self.acc, c0, c1, b0, b1, int(self.row_slot[ins.row]), ins.k, ins.col, ins.n)
        self.macs += (c1 - c0) * (b1 - b0) * ins.n * d.lanes
        return True

    def _checked(self, ins):
        """Channel range ``(c0, c1)`` of ``ins`` once its word passed the device-semantics table (cached per word), else None."""
        v = self._mac_ok.get(ins)
        if v is None:
            if check_instr(ins, self.d):
                return None
            v = self._mac_ok[ins] = (0, self.d.channels) if ins.flags & ALL_CH else (ins.ch, ins.ch + 1)
        return v

    def _gb_acc(self, idx, ins, payload):
        """WR_GB / WR_ACC / RD_ACC as ``PimState.step`` does them (readback array or None); False when ``step`` must
        run it (its word not yet checked against the device, or a payload of another size)."""
        d = self.d
        v = self._checked(ins)
        if v is None:
            return False
        c0, c1 = v
        op = ins.op
        if op is Op.WR_GB:
            n = ins.n * d.lanes
            if payload is None or payload.size != n or payload.dtype != np.uint16:
                return False
            self.gbs[ins.bank, c0:c1, ins.col * d.lanes : ins.col * d.lanes + n] = payload
        elif op is Op.WR_ACC:
            if payload is None or payload.size != ins.n or payload.dtype != np.float32:
                return False
            acc = self.accs[ins.bank]
            flat = acc[c0:c1, :, ins.k].reshape(-1)
            flat[ins.col : ins.col + ins.n] = payload
            acc[c0:c1, :, ins.k] = flat.reshape(c1 - c0, d.banks)
        else:
            out = self.accs[ins.bank, c0:c1, :, ins.k].reshape(-1)[ins.col : ins.col + ins.n].copy()
            if self.cfr[c0, CFR_ACC_RD_FMT] == 1:
                out = round_to_bf16(out)
            self.counts["RD_ACC"] = self.counts.get("RD_ACC", 0) + 1
            return out
        self.counts[op.name] = self.counts.get(op.name, 0) + 1
        return None

    def _mac_v(self, ins) -> bool:
        """One MAC_ABV through the kernel; False (nothing done) when it needs ``step`` (bad fields, quantized rows)."""
        d = self.d
        v = self._checked(ins)
        if v is None:
            return False
        c0, c1 = v
        if self.cfr[c0:c1, CFR_W_FMT].any():
            return False
        self.counts["MAC_ABV"] = self.counts.get("MAC_ABV", 0) + 1
        kernels.mac_bf16_vec(self.mem_t, self.gbs, self.accs, c0, c1, int(self.row_slot[ins.row]), ins.k, ins.col, ins.n, ins.imm)
        self.macs += (c1 - c0) * d.banks * ins.n * d.lanes * ins.imm
        return True

    def _gemv_run(self, run: ResolvedGemvRun, digest) -> list[np.ndarray]:
        """A :class:`ResolvedGemvRun` in one kernel call; its readbacks (fp32, or bf16-rounded where CFR reg 0 says so;
        views of one array) are fed to ``digest`` end to end. Falls back to :meth:`run_block` on its instructions (which gives the
        named error of a bad one) when the run fails a check or the weight format of a channel is not bf16."""
        if kernels.mac_bf16 is not kernels._mac_bf16 or kernels.mac_bf16_vec is not kernels._mac_bf16_vec:
            # a MAC kernel replaced (a test's mutant): honour it, instruction by instruction
            return self.run_block(run.instrs(), digest)
        tables = _GEMV_TABLES.setdefault(run.plan, {})  # per binding plan and device: survives reset and reload
        plan = tables.get(self.d, False)
        if plan is False:
            plan = tables[self.d] = self._gemv_table(run)
        if plan is None:
            return self.run_block(run.instrs(), digest)
        tab, rows, ptr, total, spans, has_mac, counts, macs = plan
        if has_mac and self.cfr[:, CFR_W_FMT].any():  # quantized rows: PimState's decoded-row path
            return self.run_block(run.instrs(), digest)
        res = np.empty(total, np.float32)
        spans_at_once(kernels.gemv_run, (self.mem_t, self.row_slot, self.zero_rows, self.gbs, self.accs, self.cfr, tab, rows, ptr, run.bits, run.values, res),
                       self.d.channels, self.kernel_threads if macs >= THREADED_MIN_MACS else 1)
        res.flags.writeable = False  # the digest may hash it later (ReadbackDigest.add_many): nobody writes to it
        if len(spans):
            digest.add_many(res, len(spans))
        for name, c in counts:
            self.counts[name] = self.counts.get(name, 0) + c
        self.macs += macs
        return ReadbackRun(res, spans)

    def _gemv_table(self, run: ResolvedGemvRun):
        """The kernel table of a GEMV run (``kernels.G_*`` columns), its rows per channel (:func:`_channel_rows`) and its
        readback spans, counts and MACs, or None
        when an instruction fails the device-semantics table or a check of the kernel path (``step`` must run it)."""
        d = self.d
        if not self._kernels:
            return None
        m = run.fields.shape[0]
        tab = np.zeros((m, 12), np.int64)
        rd_off, rd_n, counts, macs, at = [], [], {}, 0, 0
        code = {Op.WR_GB: kernels.G_WR_GB, Op.WR_ACC: kernels.G_WR_ACC, Op.MAC_AB: kernels.G_MAC, Op.MAC_SB: kernels.G_MAC,
                Op.RD_ACC: kernels.G_RD_ACC, Op.MAC_ABV: kernels.G_MAC_V}
        for r, (f, po) in enumerate(zip(run.fields.tolist(), run.offset.tolist())):
            ins = Instr(Op(f[0]), *f[1:])
            if check_instr(ins, d) or ins.op not in code:
                return None
            c0, c1 = (0, d.channels) if ins.flags & ALL_CH else (ins.ch, ins.ch + 1)
            b0, b1 = 0, d.banks
            if ins.op is Op.MAC_SB:
                b0, b1 = ins.bank, ins.bank + 1
            if ins.op in (Op.MAC_AB, Op.MAC_SB, Op.MAC_ABV):  # bf16 rows: W_FMT is checked at run time
                if ins.n == 0 or ins.row >= d.rows:
                    return None
                macs += (c1 - c0) * (b1 - b0) * ins.n * d.lanes * (ins.imm if ins.op is Op.MAC_ABV else 1)
            elif ins.op in (Op.WR_ACC, Op.RD_ACC) and ins.col + ins.n > (c1 - c0) * d.banks:
                return None
            st = ins.imm if ins.op is Op.MAC_ABV else ins.bank
            tab[r] = (code[ins.op], c0, c1, b0, b1, ins.row, ins.k, ins.col, ins.n, st, po, at)
            if ins.op is Op.RD_ACC:
                rd_off.append(at)
                rd_n.append(ins.n)
                at += ins.n
            counts[ins.op.name] = counts.get(ins.op.name, 0) + 1
        has_mac = bool(np.isin(tab[:, 0], (kernels.G_MAC, kernels.G_MAC_V)).any())
        spans = np.array([(o, o + n) for o, n in zip(rd_off, rd_n)], np.int64).reshape(-1, 2)
        rows, ptr = _channel_rows(tab, d.channels, d.banks)
        return tab, rows, ptr, at, spans, has_mac, tuple(counts.items()), macs

    def _wr_sbk_run(self, block, i: int, j: int) -> bool:
        """WR_SBK ``block[i:j]`` (ResolvedInstr) as one scatter (:meth:`_scatter_sbk`); False when it cannot be."""
        run = block[i:j]
        pays = [r[2] for r in run]
        if any(p is None or p.size != self.d.lanes or p.dtype != np.uint16 for p in pays):
            return False
        f = np.array([tuple(r[1])[1:] for r in run], dtype=np.int64)  # [m, 10]: Instr fields after op
        return self._scatter_sbk(f, np.stack(pays).reshape(len(run), -1))

    def _scatter_sbk(self, f: np.ndarray, pay: np.ndarray) -> bool:
        """WR_SBK of every row of ``f`` (int64 ``[m, 10]``, Instr fields after op) with ``pay`` (uint16 ``[m, lanes]``)
        as one scatter into the bank state; False (no element written) unless every one is single-channel, in bounds,
        without position flags, and no two write the same element (then ``step`` runs them one by one, for the named
        error or the last-write-wins order; rows it allocated first are the rows ``step`` allocates, in the same order)."""
        d = self.d
        L = d.lanes
        flags, ch, bank, row, col, k, imm = f[:, 0], f[:, 1], f[:, 2], f[:, 3], f[:, 4], f[:, 7], f[:, 8]
        if ((flags != 0).any() or k.any() or (ch >= d.channels).any() or (bank >= d.banks).any() or (row >= d.rows).any()
                or ((col + 1) * L > d.cols).any() or (f[:, 9] != 0).any() or pay.shape != (f.shape[0], L) or pay.dtype != np.uint16):
            return False
        slots = self.row_slot[row]
        if (slots < 0).any():  # rows written for the first time: allocate in instruction order, as step would
            for r in dict.fromkeys(row[slots < 0].tolist()):
                self.slot(r, allocate=True)
            slots = self.row_slot[row]
        self.zero_rows[:, slots] = False  # written: no longer known zero
        self.written[slots] = True  # (what drop_decoded marks, which this path calls only with decoded rows cached)
        if self._qcache:
            for s in np.unique(slots).tolist():
                self.drop_decoded(s)
        if self._kernels:
            if not wr_sbk.scatter_sbk(self.mem_t, slots, ch, bank, col, imm, pay):
                return False  # two writes to one element: step runs them in order (the last wins)
        else:
            mask = ((imm[:, None] >> np.arange(L)) & 1).astype(bool)  # [m, L]
            tt, lane = np.nonzero(mask)
            key = ((ch[tt] * d.banks + bank[tt]) * self.mem_t.shape[1] + slots[tt]) * d.cols + col[tt] * L + lane
            if np.unique(key).size != key.size:
                return False
            self.mem[ch[tt], bank[tt], slots[tt], col[tt] * L + lane] = pay[tt, lane]
        self.counts["WR_SBK"] = self.counts.get("WR_SBK", 0) + int(f.shape[0])
        return True

    def _run_of_appends(self, run: ResolvedRun) -> list:
        """A :class:`ResolvedRun` of KV appends: one scatter, or (a run the scatter refuses) ``step`` per instruction."""
        if not self._scatter_sbk(run.fields[:, 1:], run.payload):
            for idx, ins, payload in run.instrs():
                self.step(idx, ins, payload)
        return []
