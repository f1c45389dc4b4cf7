"""Vectorised binding of instruction runs: KV-cache appends and GEMV sequences, many instructions at once.

A decode step appends one K burst per KV head-group slice and one Vᵀ element per
(head, dim) pair, each a ``WR_SBK`` template with position flags; a prefill program
(``nhil.compiler.prefill``) repeats them for every prompt token. Bound one by one they
are two thirds of the instructions the runtime handles. :class:`KvRun` holds a maximal
run of consecutive such templates as arrays, and :meth:`KvRun.bind` applies the binding
rules of ``docs/isa.md`` "Position-relative instructions" (the same rules
``Runner._resolve`` applies to one instruction) to all of them with numpy, giving a
:class:`nhil.targets.base.ResolvedRun`.

:class:`GemvRun` holds a maximal run of consecutive GEMV instructions without position flags
(``WR_GB`` of an activation slice, ``WR_ACC`` of partial sums, ``MAC_AB``/``MAC_SB``/``MAC_ABV``,
``RD_ACC``: the other third); its fields never change, so binding only gathers the payloads from the block's host
buffers, giving a :class:`nhil.targets.base.ResolvedGemvRun` that a target runs in one call.

``tests/test_prefill.py`` / ``tests/test_kv_fp8.py`` / ``tests/test_bind_runs.py`` check that a bound run
equals the per-instruction binding field for field and payload bit for bit.
"""

from __future__ import annotations

import numpy as np

from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Op
from nhil.numerics.bf16 import f32_to_bf16_bits
from nhil.numerics.kv_fp8 import V_HEADER, v_positions_per_row
from nhil.targets.base import ResolvedGemvRun, ResolvedRun

# Instr field columns
_FLAGS, _CH, _BANK, _ROW, _COL, _K, _IMM, _TOK = 1, 2, 3, 4, 5, 8, 9, 10


def _starts(buffers: list[str], sizes: dict[str, int]) -> dict[str, int]:
    """Where each of ``buffers`` starts in their concatenation (what ``bind`` gathers payloads from)."""
    return dict(zip(buffers, np.cumsum([0] + [sizes[b] for b in buffers[:-1]]).tolist()))


def is_run_member(ins) -> bool:
    """True for a ``WR_SBK`` with a position flag (a KV-cache append template)."""
    return ins.op is Op.WR_SBK and bool(ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL))


class KvRun:
    """Templates ``index`` (consecutive position-relative ``WR_SBK``) of ``program``, as arrays.

    Args:
        program: the Program; index: instruction indices (all :func:`is_run_member`).
        raw: names of raw-word buffers (``program.info["raw_buffers"]``).
        sizes: element count of every host buffer (``program.buffers``).
    """

    def __init__(self, program, index: list[int], raw: frozenset, sizes: dict[str, int]) -> None:
        d = program.device
        L = d.lanes
        self.index = np.asarray(index, np.int64)
        ins = [program.instrs[i] for i in index]
        fields = np.array([(int(x.op), x.flags, x.ch, x.bank, x.row, x.col, x.n, x.operand, x.k, x.imm, x.tok) for x in ins], np.int64)
        self.fields = fields
        f = fields[:, _FLAGS]
        slot = (f & FLAG_POS_SLOT) != 0
        col = (f & FLAG_POS_COL) != 0
        fp8 = col & (fields[:, _K] == 3)  # fp8 Vᵀ byte (nhil.numerics.kv_fp8)
        self.si, self.ci, self.vi = np.flatnonzero(slot), np.flatnonzero(col & ~fp8), np.flatnonzero(fp8)
        self.li = np.flatnonzero(col)  # one element to one lane
        self.bi = np.flatnonzero(~col)  # POS_SLOT only: the operand's elements from lane 0, zero-padded to the burst
        self.tok = fields[:, _TOK].copy()
        self.base = fields.copy()  # bound fields before the position: flags cleared, tok 0
        self.base[:, _FLAGS] &= ~(FLAG_POS_SLOT | FLAG_POS_COL)
        self.base[:, _TOK] = 0
        ops = [program.operands[x.operand] for x in ins]
        self.buffers = list(dict.fromkeys(o.buffer for o in ops))
        self.rounds = not raw.intersection(self.buffers)  # every payload is bf16 of fp32 host values (no raw words)
        start = _starts(self.buffers, sizes)
        src = np.array([start[o.buffer] + o.offset for o in ops], np.int64)  # into the buffers' bits, concatenated
        cnt = np.array([o.count for o in ops], np.int64)
        self.lane_src = src[self.li]
        k = np.arange(L)
        take = k[None, :] < cnt[self.bi, None]
        self.burst_take = take
        self.burst_src = np.where(take, src[self.bi, None] + k[None, :], 0)
        self.lanes, self.cols, self.banks, self.slots = L, d.cols, d.banks, d.slots
        self._vp = v_positions_per_row(d.cols, L)
        self._lane = np.zeros(len(index), np.int64)  # scratch: lane of each one-element append

    def __len__(self) -> int:
        return int(self.index.size)

    def bind(self, pos: int, bits_of, bufs=None) -> ResolvedRun:
        """Bind every template for cache position ``pos``.

        Args:
            pos: the step's ``$pos`` (a template's ``tok`` adds to it).
            bits_of: ``buffer name -> uint16 [len]`` bits of the whole buffer (bf16 of the fp32 values, or the raw words).
            bufs: ``buffer name -> float32 [len]`` the host buffers: where no buffer of the run holds raw words, their
                concatenation is rounded to bf16 in one call (the same bits as rounding each: RNE is elementwise; a
                64-token prefill's run of appends reads 128 buffers), else each buffer's bits come from ``bits_of``.
        Returns:
            the bound run (fields without position flags, ``tok`` 0; payload uint16 ``[m, lanes]``).
        """
        L = self.lanes
        f = self.base.copy()
        t = pos + self.tok
        s = self.si
        if s.size:  # POS_SLOT: slot = t % S -> (ch, bank), row += t // S
            ts = t[s]
            sl = ts % self.slots
            f[s, _CH] = sl // self.banks
            f[s, _BANK] = sl % self.banks
            f[s, _ROW] += ts // self.slots
        lane = self._lane
        c = self.ci
        if c.size:  # POS_COL: one element of a position-major row
            tc = t[c]
            lane[c] = tc % L
            f[c, _ROW] += tc // self.cols
            f[c, _COL] = (tc % self.cols) // L
        v = self.vi
        if v.size:  # fp8 Vᵀ append: byte j = 4 + t % P of row t // P (nhil.numerics.kv_fp8.bind_v_byte)
            tv = t[v]
            j = V_HEADER + tv % self._vp
            word = j // 2
            f[v, _ROW] += tv // self._vp
            f[v, _COL] = word // L
            lane[v] = word % L
            f[v, _K] = 1 + j % 2
        if bufs is not None and self.rounds and len(self.buffers) > 1:
            allbits = f32_to_bf16_bits(np.concatenate([bufs[b] for b in self.buffers]))
        else:
            parts = [bits_of(b) for b in self.buffers]
            allbits = np.concatenate(parts) if len(parts) > 1 else parts[0]
        payload = np.zeros((t.size, L), np.uint16)
        li = self.li
        if li.size:
            ln = lane[li]
            f[li, _IMM] = np.left_shift(1, ln)
            payload[li, ln] = allbits[self.lane_src]
        if self.bi.size:
            payload[self.bi] = np.where(self.burst_take, allbits[self.burst_src], 0)
        return ResolvedRun(self.index, f, payload)



GEMV_OPS = frozenset({Op.WR_GB, Op.WR_ACC, Op.MAC_AB, Op.MAC_SB, Op.MAC_ABV, Op.RD_ACC})


def is_gemv_member(program, ins) -> bool:
    """True for a GEMV instruction without position flags whose payload binds as ``Runner._resolve`` binds it
    without error (an operand that exists; ``WR_GB``: at most ``n * lanes`` elements; ``WR_ACC``: exactly ``n``)."""
    if ins.op not in GEMV_OPS or ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL):
        return False
    if ins.op is Op.WR_GB or ins.op is Op.WR_ACC:
        if ins.operand >= len(program.operands):
            return False
        cnt = program.operands[ins.operand].count
        return cnt <= ins.n * program.device.lanes if ins.op is Op.WR_GB else cnt == ins.n
    return True


class GemvRun:
    """Instructions ``index`` (consecutive :func:`is_gemv_member`) of ``program``, as arrays.

    Args:
        program: the Program; index: instruction indices.
        raw: names of raw-word buffers: a run that reads none gathers its payload as fp32 and rounds it to bf16 in one
            call (the same bits as rounding each buffer: the rounding is elementwise); otherwise through ``bits_of``.
        sizes: element count of every host buffer (``program.buffers``).
    """

    def __init__(self, program, index: list[int], raw: frozenset, sizes: dict[str, int]) -> None:
        L = program.device.lanes
        self.lanes = L
        self.index = np.asarray(index, np.int64)
        ins = [program.instrs[i] for i in index]
        self.fields = np.array([(int(x.op), x.flags, x.ch, x.bank, x.row, x.col, x.n, x.operand, x.k, x.imm, x.tok) for x in ins], np.int64)
        self.offset = np.zeros(len(ins), np.int64)
        gb = [(j, x, program.operands[x.operand]) for j, x in enumerate(ins) if x.op is Op.WR_GB]
        acc = [(j, x, program.operands[x.operand]) for j, x in enumerate(ins) if x.op is Op.WR_ACC]
        self.gb_buffers = list(dict.fromkeys(o.buffer for _, _, o in gb))
        self.gb_rounds = not raw.intersection(self.gb_buffers)  # every GB payload is bf16 of fp32 host values
        self.acc_buffers = list(dict.fromkeys(o.buffer for _, _, o in acc))
        start = _starts(self.gb_buffers, sizes)
        src, take, at = [], [], 0
        for j, x, o in gb:  # payload: the operand's elements from lane 0 of the first burst, zero-padded to n bursts
            n = x.n * L
            self.offset[j] = at
            k = np.arange(n)
            src.append(np.where(k < o.count, start[o.buffer] + o.offset + k, 0))
            take.append(k < o.count)
            at += n
        self.gb_src = np.concatenate(src) if src else np.zeros(0, np.int64)
        self.gb_take = np.concatenate(take) if take else np.zeros(0, bool)
        self.gb_full = bool(self.gb_take.all())
        start = _starts(self.acc_buffers, sizes)
        src, at = [], 0
        for j, x, o in acc:
            self.offset[j] = at
            src.append(start[o.buffer] + o.offset + np.arange(o.count))
            at += o.count
        self.acc_src = np.concatenate(src) if src else np.zeros(0, np.int64)
        self._zero_values: np.ndarray | None = None  # WR_ACC payload when every source buffer is all +0 (bind)

    def __len__(self) -> int:
        return int(self.index.size)

    def bind(self, pos: int, bits_of, bufs: dict) -> ResolvedGemvRun:
        """Gather the payloads of the run from the block's host buffers (the fields carry no position).

        Args:
            pos: unused (no member has position flags).
            bits_of: ``buffer name -> uint16 [len]`` bits of the whole buffer (bf16 of the fp32 values, or the raw words).
            bufs: ``buffer name -> float32 [len]`` the host buffers (``WR_ACC`` payloads are their values).
        """
        bits = np.zeros(0, np.uint16)
        if self.gb_buffers and self.gb_rounds:  # gather the fp32 payload, then one rounding (prefill runs: 16 buffers)
            parts = [np.asarray(bufs[b], dtype=np.float32) for b in self.gb_buffers]
            allf = np.concatenate(parts) if len(parts) > 1 else parts[0]
            bits = f32_to_bf16_bits(allf[self.gb_src])
            if not self.gb_full:
                bits[~self.gb_take] = 0
        elif self.gb_buffers:
            parts = [bits_of(b) for b in self.gb_buffers]
            allbits = np.concatenate(parts) if len(parts) > 1 else parts[0]
            bits = allbits[self.gb_src]
            if not self.gb_full:
                bits[~self.gb_take] = 0
        values = np.zeros(0, np.float32)
        if self.acc_buffers:
            parts = [np.asarray(bufs[b], dtype=np.float32) for b in self.acc_buffers]
            if not any(p.view(np.uint32).any() for p in parts):  # every source all +0 (the accumulator reset: ZEROS)
                if self._zero_values is None:  # one +0 payload per run, reused by every bind (read, never written)
                    self._zero_values = np.zeros(self.acc_src.size, np.float32)
                values = self._zero_values
            else:
                allv = np.concatenate(parts) if len(parts) > 1 else parts[0]
                values = allv[self.acc_src]
        return ResolvedGemvRun(self.index, self.fields, self.offset, bits, values, self, self.lanes)
