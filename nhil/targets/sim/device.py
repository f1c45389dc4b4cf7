"""Architectural state of the PIM device and the exact semantics of each ISA v0 instruction.

State (``docs/isa.md`` section "State"):

* ``BANK[ch][bank][row][col]``: bf16 bits (uint16). Only rows in use are allocated: a
  row table maps a row index to a slot, grown on first write. A row never written reads as zero.
  The storage is bank-minor, ``mem_t`` = uint16 ``[channels, slots, cols, banks]`` (lane ``i`` of
  every bank of a channel contiguous: the SIMD axis of the fast path's MAC kernels,
  ``nhil.targets.sim.kernels``); ``mem`` is its ``[channels, banks, slots, cols]`` view, which every
  other reader and writer indexes. Every writer of a row slot calls ``drop_decoded(slot)`` first (cached
  decoded rows, and the fast path's all-zero marks, are dropped there, and the slot is marked ``written``:
  ``reload_images``, behind ``SimTarget.reload``, restores only the written slots for the next run).
* ``GB[ch][i]``: global buffer, bf16 bits, ``gb_elems`` per channel; with the prefill extension ``vectors``
  of them, ``GB_j`` = ``gbs[j]`` (``gb`` is set 0).
* ``ACC[ch][bank][k]``: fp32 accumulators; with the prefill extension (``DeviceConfig.vectors`` > 1)
  ``vectors`` sets of them, ``ACC_j`` = ``accs[j]`` (``acc`` is set 0, the only set of ISA v0).
* ``CFR[ch][reg]``: configuration registers (reg 0 = RD_ACC format: 0 fp32, 1 bf16;
  reg 1 = W_FMT, the weight format MACs read rows in: 0 bf16, else a code of
  ``nhil.numerics.formats``).

The MAC arithmetic is ``nhil.numerics.mac`` (fixed-order fp32, RNE, canonical NaN); with
W_FMT != 0 a row's bytes are decoded per the format (``WeightFormat.unpack_row``) and
the MAC is ``nhil.numerics.formats.mac_bursts_q`` (``docs/numerics.md``). Decoded rows
are cached per (row, format) and dropped when the row is written.
"""

from __future__ import annotations

import numpy as np

from nhil.errors import RunError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, CFR_W_FMT, Instr, Op
from nhil.isa.semantics import check_instr
from nhil.numerics.bf16 import bf16_bits_to_f32, round_to_bf16
from nhil.numerics.mac import mac_bursts


class PimState:
    """Mutable device state plus ``step(instr, payload)`` implementing each opcode.

    Args:
        device: sizes of the device.
        reserve_rows: row slots to pre-allocate (growth beyond is automatic).
    """

    def __init__(self, device: DeviceConfig, reserve_rows: int = 8) -> None:
        self.d = device
        c, b = device.channels, device.banks
        self.row_slot = np.full(device.rows, -1, dtype=np.int64)
        self._store(np.zeros((c, max(1, reserve_rows), device.cols, b), dtype=np.uint16))
        self.n_slots = 0
        self.gbs = np.zeros((device.vectors, c, device.gb_elems), dtype=np.uint16)  # global buffers (prefill extension)
        self.gb = self.gbs[0]  # GB set 0: the global buffer of ISA v0 (a view)
        self.accs = np.zeros((device.vectors, c, b, device.accumulators), dtype=np.float32)  # accumulator sets
        self.acc = self.accs[0]  # set 0: the accumulators of ISA v0 (a view)
        self.cfr = np.zeros((c, 4), dtype=np.int64)
        self.counts: dict[str, int] = {}
        self.macs = 0
        self._qcache: dict[tuple[int, int], object] = {}  # (row slot, W_FMT) -> decoded MacOperands of the row

    def _store(self, mem_t: np.ndarray) -> None:
        """Make ``mem_t`` (uint16 ``[channels, slots, cols, banks]``) the bank storage; ``mem`` its bank-major view."""
        self.mem_t = mem_t
        self.mem = mem_t.transpose(0, 3, 1, 2)  # [channels, banks, slots, cols], writes go through to mem_t
        w = np.zeros(mem_t.shape[1], np.bool_)
        old = getattr(self, "written", None)
        if old is not None:
            w[: old.size] = old
        self.written = w  # [slots]: written since load_images finished (drop_decoded marks it; reload_images reads it)

    # ------------------------------------------------------------ row table
    def slot(self, row: int, allocate: bool) -> int:
        """Slot index of ``row`` (-1 when unallocated and ``allocate`` is False)."""
        s = int(self.row_slot[row])
        if s >= 0 or not allocate:
            return s
        if self.n_slots == self.mem_t.shape[1]:
            grow = np.zeros_like(self.mem_t[:, : max(8, self.n_slots)])
            self._store(np.concatenate([self.mem_t, grow], axis=1))
        s = self.n_slots
        self.n_slots += 1
        self.row_slot[row] = s
        return s

    def reset_keep(self, keep: np.ndarray) -> None:
        """Clear the state except the bank rows where ``keep`` (bool ``[rows]``) is set: every other row reads as
        zero again; GB, ACC and CFRs are zeroed (the state after ``load`` of a program whose images are the kept rows)."""
        rows = np.flatnonzero((self.row_slot >= 0) & ~keep)
        for s in self.row_slot[rows]:
            self.drop_decoded(int(s))
        self.mem_t[:, self.row_slot[rows]] = 0
        self.gbs[:] = 0
        self.accs[:] = 0
        self.cfr[:] = 0

    def row_image(self, row: int) -> np.ndarray:
        """uint16 ``[channels, banks, cols]`` copy of row ``row`` of every bank (zeros when never written)."""
        s = self.slot(row, allocate=False)
        if s < 0:
            return np.zeros((self.d.channels, self.d.banks, self.d.cols), np.uint16)
        return np.ascontiguousarray(self.mem[:, :, s, :])

    def rows_allocated(self) -> int:
        """Number of rows that hold data (memory actually allocated = this x channels x banks x row_bytes)."""
        return self.n_slots

    # ------------------------------------------------------------ checks
    def _err(self, idx: int, ins: Instr, msg: str) -> RunError:
        return RunError(f"instruction {idx} ({ins.op.name}): {msg}")

    # bounds come from the device-semantics table (nhil.isa.semantics.check_instr, run first in step);
    # these only build the slices an instruction addresses
    def _chans(self, idx: int, ins: Instr) -> slice:
        return slice(0, self.d.channels) if ins.flags & ALL_CH else slice(ins.ch, ins.ch + 1)

    def _span(self, idx: int, ins: Instr, limit: int, what: str) -> slice:
        return slice(ins.col * self.d.lanes, (ins.col + ins.n) * self.d.lanes)

    def _payload(self, idx: int, ins: Instr, payload, n: int, dtype) -> np.ndarray:
        if payload is None or payload.size != n or payload.dtype != dtype:
            got = "none" if payload is None else f"{payload.size} x {payload.dtype}"
            raise self._err(idx, ins, f"payload must be {n} x {np.dtype(dtype)}, got {got}")
        return payload

    # ------------------------------------------------------------ execute
    def step(self, idx: int, ins: Instr, payload: np.ndarray | None) -> np.ndarray | None:
        """Execute one resolved instruction; returns readback data for data-out opcodes.

        Raises:
            RunError: any address, size or payload outside the device (names the instruction).
        """
        op = ins.op
        why = check_instr(ins, self.d)  # the one device-semantics table (also run by Program.validate at load)
        if why:
            raise self._err(idx, ins, why)
        self.counts[op.name] = self.counts.get(op.name, 0) + 1
        d = self.d
        L = d.lanes
        if op is Op.MAC_AB or op is Op.MAC_SB:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins, d.cols, "row")
            s = self.slot(ins.row, allocate=False)
            bs = slice(None) if op is Op.MAC_AB else slice(ins.bank, ins.bank + 1)
            wf = self.cfr[cs, CFR_W_FMT]
            if wf.any():
                self._mac_quantized(idx, ins, cs, bs, s, int(wf[0]) if (wf == wf[0]).all() else -1)
                return None
            if s < 0:
                w = np.zeros((cs.stop - cs.start, d.banks if op is Op.MAC_AB else 1, sp.stop - sp.start), np.float32)
            else:
                w = bf16_bits_to_f32(self.mem[cs, bs, s, sp])
            a = bf16_bits_to_f32(self.gb[cs, sp])[:, None, :]
            self.acc[cs, bs, ins.k] = mac_bursts(self.acc[cs, bs, ins.k], w, a)
            self.macs += w.size
            return None
        if op is Op.MAC_ABV:
            self._mac_vectors(idx, ins)
            return None
        if op is Op.RD_ACC or op is Op.WR_ACC:
            cs = self._chans(idx, ins)
            acc = self.accs[ins.bank]  # the bank field selects the accumulator set
            flat = acc[cs, :, ins.k].reshape(-1)
            if op is Op.WR_ACC:
                p = self._payload(idx, ins, payload, ins.n, np.float32)
                flat[ins.col : ins.col + ins.n] = p
                acc[cs, :, ins.k] = flat.reshape(cs.stop - cs.start, d.banks)
                return None
            out = flat[ins.col : ins.col + ins.n].copy()
            if self.cfr[cs.start, CFR_ACC_RD_FMT] == 1:
                out = round_to_bf16(out)
            return out
        if op is Op.WR_GB:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins, d.gb_elems, "global buffer")
            self.gbs[ins.bank, cs, sp] = self._payload(idx, ins, payload, sp.stop - sp.start, np.uint16)  # bank = GB set
            return None
        if op is Op.WR_SBK:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins._replace(n=1), d.cols, "row")
            p = self._payload(idx, ins, payload, L, np.uint16)
            s = self.slot(ins.row, allocate=True)
            self.drop_decoded(s)
            lanes = ((ins.imm >> np.arange(L)) & 1).astype(bool)
            seg = self.mem[cs, ins.bank, s, sp]
            if ins.k in (1, 2):  # byte write mask: the low (k=1) or high (k=2) byte of each lane, from the payload's low byte
                keep, sh = (np.uint16(0xFF00), 0) if ins.k == 1 else (np.uint16(0x00FF), 8)
                p = (seg & keep) | ((p & np.uint16(0xFF)) << np.uint16(sh)).astype(np.uint16)
            elif ins.k:
                raise self._err(idx, ins, f"WR_SBK k={ins.k}: the byte select is 0 (words), 1 (low byte) or 2 (high byte)")
            seg[:, lanes] = p[..., lanes] if p.ndim == 2 else p[lanes]
            self.mem[cs, ins.bank, s, sp] = seg
            return None
        if op is Op.WR_ABK:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins, d.cols, "row")
            p = self._payload(idx, ins, payload, sp.stop - sp.start, np.uint16)
            s = self.slot(ins.row, allocate=True)
            self.drop_decoded(s)
            self.mem[cs, :, s, sp] = p
            return None
        if op is Op.RD_SBK:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins, d.cols, "row")
            s = self.slot(ins.row, allocate=False)
            if s < 0:
                return np.zeros(sp.stop - sp.start, np.uint16)
            return self.mem[cs.start, ins.bank, s, sp].copy()
        if op is Op.COPY_BK_GB or op is Op.COPY_GB_BK:
            cs = self._chans(idx, ins)
            sp = self._span(idx, ins, min(d.cols, d.gb_elems), "row/global buffer")
            if op is Op.COPY_BK_GB:
                s = self.slot(ins.row, allocate=False)
                self.gb[cs, sp] = 0 if s < 0 else self.mem[cs, ins.bank, s, sp]
            else:
                s = self.slot(ins.row, allocate=True)
                self.drop_decoded(s)
                self.mem[cs, ins.bank, s, sp] = self.gb[cs, sp]
            return None
        if op is Op.SET_CFR:
            cs = self._chans(idx, ins)
            self.cfr[cs, ins.k] = ins.imm
            return None
        if op in (Op.NOP, Op.SYNC, Op.EOC):
            return None
        if op in (Op.EWMUL, Op.EWADD, Op.AF):
            self._elementwise(ins)
            return None
        raise self._err(idx, ins, "opcode not implemented by the simulator")

    # ------------------------------------------------------------ elementwise ops (docs/isa.md "Elementwise ops")
    def _elementwise(self, ins: Instr) -> None:
        """EWMUL / EWADD / AF on the accumulators of every bank of the addressed channels (``nhil.numerics.ew``)."""
        from nhil.numerics.ew import af_apply, ew_add, ew_mul

        cs = self._chans(0, ins)
        a = self.acc[cs, :, ins.k]
        if ins.op is Op.AF:
            self.acc[cs, :, ins.k] = af_apply(a, ins.imm)
        else:
            self.acc[cs, :, ins.k] = (ew_mul if ins.op is Op.EWMUL else ew_add)(a, self.acc[cs, :, ins.imm])

    def _mac_vectors(self, idx: int, ins: Instr) -> None:
        """MAC_ABV (``docs/isa.md`` "Prefill extension"): bursts ``[col, col+n)`` of row ``row`` of every bank, read
        once, MAC'd with the same bursts of each global buffer ``GB_j``, ``j < V = imm``, into accumulator ``k`` of
        set ``j``; each set's arithmetic is exactly MAC_AB's (``mac_bursts``)."""
        cs = self._chans(idx, ins)
        if self.cfr[cs, CFR_W_FMT].any():
            raise self._err(idx, ins, "MAC_ABV reads bf16 rows only (CFR W_FMT must be 0); quantized rows take MAC_AB per token")
        d = self.d
        L, n = d.lanes, ins.n
        sp = slice(ins.col * L, (ins.col + n) * L)
        s = self.slot(ins.row, allocate=False)
        nc = cs.stop - cs.start
        w = np.zeros((nc, d.banks, n * L), np.float32) if s < 0 else bf16_bits_to_f32(self.mem[cs, :, s, sp])
        for j in range(ins.imm):
            a = bf16_bits_to_f32(self.gbs[j, cs, sp])[:, None, :]
            self.accs[j, cs, :, ins.k] = mac_bursts(self.accs[j, cs, :, ins.k], w, a)
        self.macs += w.size * ins.imm

    # ------------------------------------------------------------ quantized weights
    def drop_decoded(self, s: int) -> None:
        """Forget decoded copies of row slot ``s`` and mark it written (call on every write to it)."""
        self.written[s] = True
        if self._qcache:
            for key in [k for k in self._qcache if k[0] == s]:
                del self._qcache[key]

    def _mac_quantized(self, idx: int, ins: Instr, cs: slice, bs: slice, s: int, code: int) -> None:
        """MAC_AB/MAC_SB with CFR W_FMT != 0: decode the row per the format, then ``mac_bursts_q``."""
        from nhil.numerics.formats import BY_CODE, mac_bursts_q

        if code < 0:
            raise self._err(idx, ins, "the addressed channels have different CFR W_FMT values")
        fmt = BY_CODE[code]
        d = self.d
        ops = self._qcache.get((s, code))
        if ops is None:
            raw = np.zeros((d.channels, d.banks, d.cols), np.uint16) if s < 0 else self.mem[:, :, s, :]
            ops = fmt.unpack_row(np.ascontiguousarray(raw, dtype="<u2").view(np.uint8), d.cols)
            if s >= 0:
                self._qcache[(s, code)] = ops
        sub = ops.bursts(ins.col, ins.col + ins.n)
        pick = lambda x: None if x is None else x[cs, bs]  # noqa: E731
        sub = type(sub)(sub.e[cs, bs], pick(sub.c1), pick(sub.c2), pick(sub.m))
        a = bf16_bits_to_f32(self.gb[cs, ins.col * d.lanes : (ins.col + ins.n) * d.lanes])[:, None, :]
        self.acc[cs, bs, ins.k] = mac_bursts_q(self.acc[cs, bs, ins.k], sub, a)
        self.macs += sub.e.size

    def load_images(self, images) -> None:
        """Write bank images (``BankImage`` list) into fresh state."""
        for img in images:
            s = self.slot(img.row, allocate=True)
            self.drop_decoded(s)
            if img.data is not None:  # written in storage order (bank-minor): the destination's pages in sequence
                self.mem_t[:, s] = np.asarray(img.data).transpose(0, 2, 1)
        self.image_slots = self.n_slots  # slots [0, image_slots) hold the images; later ones are rows the program wrote
        self.written[:] = False

    def reload_images(self, images) -> list:
        """Bring the state loaded by ``load_images(images)`` back to the state right after that call, rewriting only
        what the program changed: the image slots written since (their image again, or zeros), and the rows first
        written after the load (unallocated again, so they read as zero); GB, ACC, CFRs and counters zeroed.

        ``images`` must be the list ``load_images`` wrote (``SimTarget.reload`` checks it is the same program).
        Returns the images it rewrote (a subclass refreshes what it derives from them)."""
        k = self.image_slots
        for s in np.flatnonzero(self.written).tolist():
            self.drop_decoded(s)
        self.mem_t[:, k : self.n_slots] = 0
        self.row_slot[self.row_slot >= k] = -1
        self.n_slots = k
        redo = [img for img in images if self.written[self.row_slot[img.row]]]
        for img in redo:
            s = int(self.row_slot[img.row])
            self.mem_t[:, s] = 0 if img.data is None else np.asarray(img.data).transpose(0, 2, 1)
        self.written[:] = False
        self.gbs[:] = 0
        self.accs[:] = 0
        self.cfr[:] = 0
        self.counts = {}
        self.macs = 0
        return redo
