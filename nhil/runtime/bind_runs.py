"""Vectorised binding of KV-cache append runs: many position-relative ``WR_SBK`` at once.

A decode step appends one K burst per KV head-group slice and one Vᵀ element per
(head, dim) pair, each a ``WR_SBK`` template with position flags; a prefill program
(``nhil.compiler.prefill``) repeats them for every prompt token. Bound one by one they
are two thirds of the instructions the runtime handles. :class:`KvRun` holds a maximal
run of consecutive such templates as arrays, and :meth:`KvRun.bind` applies the binding
rules of ``docs/isa.md`` "Position-relative instructions" (the same rules
``Runner._resolve`` applies to one instruction) to all of them with numpy, giving a
:class:`nhil.targets.base.ResolvedRun`.

``tests/test_prefill.py`` / ``tests/test_kv_fp8.py`` check that the bound run equals the
per-instruction binding field for field and payload bit for bit.
"""

from __future__ import annotations

import numpy as np

from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Op
from nhil.numerics.kv_fp8 import V_HEADER, v_positions_per_row
from nhil.targets.base import ResolvedRun

# Instr field columns
_FLAGS, _CH, _BANK, _ROW, _COL, _K, _IMM, _TOK = 1, 2, 3, 4, 5, 8, 9, 10


def is_run_member(ins) -> bool:
    """True for a ``WR_SBK`` with a position flag (a KV-cache append template)."""
    return ins.op is Op.WR_SBK and bool(ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL))


class KvRun:
    """Templates ``index`` (consecutive position-relative ``WR_SBK``) of ``program``, as arrays.

    Args:
        program: the Program; index: instruction indices (all :func:`is_run_member`).
        raw: names of raw-word buffers (``program.info["raw_buffers"]``).
    """

    def __init__(self, program, index: list[int], raw: frozenset) -> None:
        d = program.device
        self.index = np.asarray(index, np.int64)
        ins = [program.instrs[i] for i in index]
        self.fields = np.array([(int(x.op), x.flags, x.ch, x.bank, x.row, x.col, x.n, x.operand, x.k, x.imm, x.tok) for x in ins], np.int64)
        f = self.fields[:, _FLAGS]
        self.slot = (f & FLAG_POS_SLOT) != 0
        col = (f & FLAG_POS_COL) != 0
        self.fp8 = col & (self.fields[:, _K] == 3)  # fp8 Vᵀ byte (nhil.numerics.kv_fp8)
        self.col = col & ~self.fp8
        ops = [program.operands[x.operand] for x in ins]
        self.buffers = list(dict.fromkeys(o.buffer for o in ops))
        self.raw = [b in raw for b in self.buffers]
        where = {b: j for j, b in enumerate(self.buffers)}
        self.buf = np.array([where[o.buffer] for o in ops], np.int64)
        self.off = np.array([o.offset for o in ops], np.int64)
        self.cnt = np.array([o.count for o in ops], np.int64)
        self.lanes, self.cols, self.banks, self.slots = d.lanes, d.cols, d.banks, d.slots
        self._vp = v_positions_per_row(d.cols, d.lanes)

    def __len__(self) -> int:
        return int(self.index.size)

    def bind(self, pos: int, bits_of) -> ResolvedRun:
        """Bind every template for cache position ``pos``.

        Args:
            pos: the step's ``$pos`` (a template's ``tok`` adds to it).
            bits_of: ``buffer name -> uint16 [len]`` bits of the whole buffer (bf16 of the fp32 values, or the raw words).
        Returns:
            the bound run (fields without position flags, ``tok`` 0; payload uint16 ``[m, lanes]``).
        """
        L = self.lanes
        f = self.fields.copy()
        t = pos + f[:, _TOK]
        s = self.slot
        if s.any():  # POS_SLOT: slot = t % S -> (ch, bank), row += t // S
            sl = t[s] % self.slots
            f[s, _CH] = sl // self.banks
            f[s, _BANK] = sl % self.banks
            f[s, _ROW] += t[s] // self.slots
        lane = np.full(t.size, -1, np.int64)
        c = self.col
        if c.any():  # POS_COL: one element of a position-major row
            tc = t[c]
            lane[c] = tc % L
            f[c, _ROW] += tc // self.cols
            f[c, _COL] = (tc % self.cols) // L
        v = self.fp8
        if v.any():  # fp8 Vᵀ append: byte j = 4 + t % P of row t // P (nhil.numerics.kv_fp8.bind_v_byte)
            tv = t[v]
            j = V_HEADER + tv % self._vp
            word = j // 2
            f[v, _ROW] += tv // self._vp
            f[v, _COL] = word // L
            lane[v] = word % L
            f[v, _K] = 1 + j % 2
        one = lane >= 0
        f[one, _IMM] = np.left_shift(1, lane[one])
        f[:, _FLAGS] &= ~(FLAG_POS_SLOT | FLAG_POS_COL)
        f[:, _TOK] = 0
        parts = [bits_of(b) for b in self.buffers]
        base = np.cumsum([0] + [p.size for p in parts[:-1]])
        allbits = np.concatenate(parts) if len(parts) > 1 else parts[0]
        src = base[self.buf] + self.off
        payload = np.zeros((t.size, L), np.uint16)
        r = np.flatnonzero(one)
        payload[r, lane[r]] = allbits[src[r]]
        burst = np.flatnonzero(~one)
        if burst.size:  # POS_SLOT only: the operand's elements from lane 0, zero-padded to the burst
            k = np.arange(L)
            take = k[None, :] < self.cnt[burst, None]
            idx = np.where(take, src[burst, None] + k[None, :], 0)
            payload[burst] = np.where(take, allbits[idx], 0)
        return ResolvedRun(self.index, f, payload)
