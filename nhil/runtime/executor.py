"""Runs one program step on a target: host kernels, operand binding, device blocks.

The instruction stream is split into device blocks at ``HOST`` instructions and after
every ``SYNC`` (the compiler puts a SYNC between a readback and any later instruction
that sends the read data back to the device). For each
step the runner binds the step's inputs (``$token``, ``$pos``), resolves every device
instruction (position-relative flags -> concrete addresses, operand -> payload bytes)
and hands each block to ``target.execute``; readbacks are scattered into their
destination buffers.

Binding rules (``docs/isa.md`` section "Position-relative instructions"), ``t = pos``,
``S = channels*banks``:

* ``POS_SLOT``: ``slot = t % S``, ``ch = slot // banks``, ``bank = slot % banks``, ``row += t // S``.
* ``POS_COL``: ``row += t // cols``, ``col = (t % cols) // lanes``, ``imm = 1 << (t % lanes)``;
  the one-element payload goes to lane ``t % lanes``.
* ``POS_COL`` on a WR_SBK with ``k = 3`` (fp8 Vᵀ append, ``nhil.numerics.kv_fp8``): byte
  ``j = 4 + t % P`` of row ``row + t // P``: ``col = (j // 2) // lanes``, lane ``(j // 2) % lanes``,
  ``k = 1 + j % 2`` (low / high byte).
* A template's ``tok`` byte (prefill programs, ``nhil.compiler.prefill``) adds to the position:
  ``t = pos + tok``; a prefill program's host call ``i`` runs with ``$token`` = prompt token
  ``host_token[i]`` and ``$pos`` = ``pos + host_token[i]``.
* Payloads of ``WR_GB``/``WR_SBK``/``WR_ABK`` are the operand's fp32 values rounded to bf16
  (RNE, ``nhil.numerics.bf16``), zero-padded to whole bursts; ``WR_ACC`` payloads stay fp32.
  Buffers in ``program.info["raw_buffers"]`` hold 16-bit words as exact fp32 integers and are
  sent as those words (fp8 KV rows).
"""

from __future__ import annotations

import numpy as np

from nhil.errors import RunError
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, OPINFO, Instr, Op
from nhil.isa.program import Program
from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from nhil.numerics.kv_fp8 import bind_v_byte
from nhil.runtime.bind_runs import GemvRun, KvRun, is_gemv_member, is_run_member
from nhil.runtime.host_batch import BATCHED, group_host_calls
from nhil.runtime.host_kernels import KERNELS
from nhil.runtime.host_threads import one_thread, serial_ok
from nhil.runtime.readback_scatter import ReadbackScatter
from nhil.runtime.token_rows import rows_of, token_rows
from nhil.targets.base import ReadbackRun, ResolvedInstr, Target

_INSTR_NEW = tuple.__new__  # builds a bound Instr from its 11 fields in one call (NamedTuple._replace costs three)


class Runner:
    """Executes ``program`` step by step on ``target`` (which must be open).

    Args:
        program: a decode-step Program.
        target: an opened Target.
    Raises:
        RunError: a HOST instruction names an unknown kernel.
    """

    def __init__(self, program: Program, target: Target) -> None:
        self.p = program
        self.t = target
        self.d = program.device
        for h in program.host_ops:
            if h.kernel not in KERNELS:
                raise RunError(f"program calls unknown host kernel {h.kernel!r}; this nhil has {', '.join(sorted(KERNELS))}")
        pf = program.info.get("prefill") if isinstance(program.info, dict) else None
        self.prefill_tokens = int(pf["tokens"]) if pf else 0  # a prefill program (nhil.compiler.prefill): tokens per run
        # a prefill program's T copies of a tensor are the rows of one [T, n] array (nhil.runtime.token_rows)
        self.bufs, self._rows = token_rows(program.buffers, self.prefill_tokens)
        self.raw = frozenset(program.info.get("raw_buffers", ()))
        # writable copies: a decoded program's images are read-only views of the file bytes
        self.images = {n: np.array(a, dtype=np.float32) for n, a in program.host_images.items()}
        self.segments: list[tuple[str, object]] = []
        # MoE expert sub-programs (docs/isa.md "Runtime: data-dependent MoE dispatch"): the
        # instructions after a ``HOST moe_expert`` marker up to the next marker or
        # ``HOST moe_dispatch`` are not part of the linear stream; they run from the dispatch.
        self.expert_segments: dict[int, list[tuple[str, object]]] = {}
        target = self.segments
        cur: list[int] = []
        for i, ins in enumerate(program.instrs):
            if ins.op is Op.HOST:
                if cur:
                    target.append(("dev", cur))
                    cur = []
                kern = program.host_ops[ins.imm].kernel
                if kern == "moe_expert":
                    target = self.expert_segments.setdefault(ins.imm, [])
                    continue
                if kern == "moe_dispatch":
                    target = self.segments
                target.append(("host", ins.imm))
            else:
                cur.append(i)
                if ins.op is Op.SYNC:  # a SYNC ends a block: readbacks reach the host before what follows
                    target.append(("dev", cur))
                    cur = []
        if cur:
            target.append(("dev", cur))
        if target is not self.segments:
            raise RunError("program ends inside a MoE expert sub-program (no moe_dispatch after its moe_expert marker)")
        for h in program.host_ops:
            if h.kernel == "moe_dispatch":
                missing = [m for m in h.attrs["experts"] if m not in self.expert_segments]
                if missing or len(h.attrs["experts"]) != h.attrs["num_experts"]:
                    raise RunError(f"moe_dispatch of layer {h.attrs.get('layer')} names expert markers {missing} that open no sub-program")
        self.device_instructions = sum(len(s[1]) for s in self.segments if s[0] == "dev")  # linear stream only
        self.expert_device_instructions = {m: sum(len(s[1]) for s in segs if s[0] == "dev") for m, segs in self.expert_segments.items()}
        self.moe_trace: list[tuple[int, list[int]]] = []  # (MoE layer, routed expert ids in slot order) per dispatch
        self.steps = 0
        self._loaded = False
        self._static: dict[int, ResolvedInstr] = {}  # instruction index -> its binding, for instructions without position flags or data
        self._plans: dict[int, tuple] = {}  # instruction index -> how it binds (:meth:`_plan`)
        self._seg_plans: dict[int, tuple] = {}  # id(segment) -> :meth:`_segment_plan`
        self._serial: dict[int, bool] = {}  # host op -> runs on one torch thread (nhil.runtime.host_threads)
        self._geom = (self.d.slots, self.d.banks, self.d.lanes, self.d.cols)
        self._sizes = {n: int(c) for n, c in program.buffers.items()}
        self._scatters: dict[int, ReadbackScatter | None] = {}  # id(segment) -> its readbacks' block copies (or None: slice by slice)
        self._group_io: dict[int, tuple] = {}  # id(host group) -> its inputs and outputs (:meth:`_run_host_group`)
        self._host_token = list(pf["host_token"]) if pf else None
        self._prefill_segments: list | None = None  # self.segments with batched host calls (nhil.runtime.host_batch)

    def attach(self, other: "Runner") -> None:
        """Run on the device state ``other`` loaded (a prefill program over its decode program's placement)
        instead of loading this program: ``reset`` then reloads nothing."""
        if other.p.device != self.p.device or len(other.p.bank_images) != len(self.p.bank_images):
            raise RunError("a prefill program runs only on the device state of the decode program it was made from")
        self._loaded = True
        self._attached = other

    def reset(self) -> None:
        """Load the program into the target (weights, zeroed KV rows); later calls ``reload`` it, which a target with
        an expensive load (the FPGA link) may do without sending the weights again (``Target.reload``)."""
        if getattr(self, "_attached", None) is not None:
            self.steps = 0
            return
        if self._loaded:
            self.t.reload(self.p)
        else:
            self.t.load(self.p)
            self._loaded = True
        self.steps = 0

    def _val(self, name: str, ctx: dict):
        if name.startswith("$"):
            return ctx[name[1:]]
        if name in self.bufs:
            return self.bufs[name]
        return self.images[name]

    def _segment_plan(self, seg: list[int]) -> tuple[list, list]:
        """``(items, reads)`` of a device segment, built once: ``items`` are instruction indices and, on a target that
        ``takes_runs``, :class:`KvRun` for each run of two or more KV-append templates and :class:`GemvRun` for each
        run of two or more GEMV instructions without position flags; ``reads`` is
        ``(buffer, offset, count, is RD_SBK)`` per data-out instruction, in order."""
        items: list = []
        run: list[int] = []
        kind = None  # the class of the run being collected

        def flush():
            if len(run) > 1:
                items.append(kind(self.p, run, self.raw, self._sizes))
            else:
                items.extend(run)
            run.clear()

        takes = bool(getattr(self.t, "takes_runs", False))
        lanes = self.d.lanes
        for i in seg:
            ins = self.p.instrs[i]
            if takes:
                if is_run_member(ins) and ins.operand < len(self.p.operands) and self.p.operands[ins.operand].count <= lanes:
                    k = KvRun
                elif is_gemv_member(self.p, ins):
                    k = GemvRun
                else:
                    k = None
                if k is not None:
                    if kind is not k:
                        flush()
                        kind = k
                    run.append(i)
                    continue
            flush()
            items.append(i)
        flush()
        reads = []
        for i in seg:
            ins = self.p.instrs[i]
            if OPINFO[ins.op].data_out:
                o = self.p.operands[ins.operand]
                reads.append((o.buffer, o.offset, o.count, ins.op is Op.RD_SBK))
        return items, reads

    def _bits(self, buf: str, bits: dict) -> np.ndarray:
        """uint16 bits of host buffer ``buf`` for the current block (cached in ``bits``): bf16 (RNE) of its fp32
        values, or the words themselves for a raw buffer (fp8 KV rows)."""
        b = bits.get(buf)
        if b is None:
            a = self.bufs[buf]
            b = bits[buf] = a.astype(np.uint16) if buf in self.raw else f32_to_bf16_bits(a)
        return b

    def _plan(self, i: int) -> tuple:
        """How instruction ``i`` binds, derived once per run of the program (:meth:`_resolve` applies it).

        ``(ins, pos_kind, data_kind, buffer, offset, count, payload_elems)``: ``pos_kind`` is a bit set, 1 ``POS_SLOT``,
        2 ``POS_COL``, 4 ``POS_COL`` as the fp8 Vᵀ byte (WR_SBK ``k = 3``); ``data_kind`` 0 none, 1 fp32 (WR_ACC),
        2 bf16 bits, 3 raw 16-bit words.
        """
        ins = self.p.instrs[i]
        f = ins.flags
        fp8 = bool(f & FLAG_POS_COL) and ins.op is Op.WR_SBK and ins.k == 3
        pk = (1 if f & FLAG_POS_SLOT else 0) + (0 if not f & FLAG_POS_COL else (4 if fp8 else 2))
        if not OPINFO[ins.op].data_in:
            return (ins, pk, 0, None, 0, 0, 0)
        o = self.p.operands[ins.operand]
        if ins.op is Op.WR_ACC:
            return (ins, pk, 1, o.buffer, o.offset, o.count, o.count)
        n = self.d.lanes if ins.op is Op.WR_SBK else ins.n * self.d.lanes
        return (ins, pk, 3 if o.buffer in self.raw else 2, o.buffer, o.offset, o.count, n)

    def _resolve(self, i: int, pos: int, bits: dict | None = None) -> ResolvedInstr:
        """Bind instruction ``i`` for position ``pos`` (docs/isa.md "Position-relative instructions").

        ``bits``: per-block cache of ``buffer name -> bf16 bits of the whole buffer``; within a
        device block the host buffers do not change (readbacks land after the block), so each
        buffer is rounded once per block instead of once per instruction (same bits: RNE is
        elementwise). Instructions with neither position flags nor data are bound once per run;
        the rest follow their :meth:`_plan`, built once. A payload that covers its whole burst
        range is a read-only view of the block's bits (targets copy what they keep).
        """
        r = self._static.get(i)
        if r is not None:
            return r
        pl = self._plans.get(i)
        if pl is None:
            pl = self._plans[i] = self._plan(i)
        ins, pk, dk, buf, off, cnt, n = pl
        lane = None
        if pk:
            slots, banks, lanes, cols = self._geom
            op, flags, ch, bank, row, col, nb, operand, k, imm, tok = ins
            t = pos + tok  # a prefill template: token tok of the prompt binds at pos + tok
            if pk & 1:  # POS_SLOT
                slot = t % slots
                flags &= ~FLAG_POS_SLOT
                ch, bank, row = slot // banks, slot % banks, row + t // slots
            if pk & 2:  # POS_COL: one element of a position-major row
                lane = t % lanes
                flags &= ~FLAG_POS_COL
                row, col, imm = row + t // cols, (t % cols) // lanes, 1 << lane
            elif pk & 4:  # fp8 Vᵀ append: one byte (nhil.numerics.kv_fp8)
                drow, col, lane, k = bind_v_byte(t, cols, lanes)
                flags &= ~FLAG_POS_COL
                row, imm = row + drow, 1 << lane
            ins = _INSTR_NEW(Instr, (op, flags, ch, bank, row, col, nb, operand, k, imm, 0))
        elif dk == 0:
            r = self._static[i] = ResolvedInstr(i, ins, None)
            return r
        if dk == 0:
            return ResolvedInstr(i, ins, None)
        if dk == 1:
            return ResolvedInstr(i, ins, np.ascontiguousarray(self.bufs[buf][off : off + cnt], dtype=np.float32))
        b = self._bits(buf, {} if bits is None else bits)
        if lane is not None:
            payload = np.zeros(n, np.uint16)
            payload[lane] = b[off]
        elif cnt == n:
            payload = b[off : off + cnt]
        else:
            payload = np.zeros(n, np.uint16)
            payload[:cnt] = b[off : off + cnt]
        return ResolvedInstr(i, ins, payload)

    def step(self, token: int, pos: int) -> dict[str, np.ndarray]:
        """Run the program once for ``token`` at cache position ``pos``.

        Returns:
            ``io["outputs"]`` name -> fp32 array (views of the host buffers; copy to keep).
        Raises:
            RunError: position beyond the compiled KV cache, or a target error.
        """
        max_len = self.p.info.get("max_cache_len", 0)
        if max_len and not 0 <= pos < max_len:
            raise RunError(f"position {pos} is outside the compiled KV cache of {max_len} positions; compile with a larger max_cache_len")
        ctx = {"token": int(token), "pos": int(pos)}
        self._run(self.segments, ctx, pos)
        self.steps += 1
        return {k: self.bufs[v] for k, v in self.p.io["outputs"].items()}

    def prefill(self, tokens: list[int], pos: int) -> list[dict[str, np.ndarray]]:
        """Run a prefill program (``nhil.compiler.prefill``) for prompt ``tokens`` at positions ``pos ..``.

        Returns:
            per token, ``io["outputs"]`` name (without the ``@t`` suffix) -> fp32 array (views; copy to keep).
        Raises:
            RunError: not a prefill program, a token count other than its own, or positions beyond the KV cache.
        """
        T = self.prefill_tokens
        if not T or len(tokens) != T:
            raise RunError(f"prefill of {len(tokens)} tokens on a program that prefills {T or 'no'} tokens")
        max_len = self.p.info.get("max_cache_len", 0)
        if max_len and not (0 <= pos and pos + T <= max_len):
            raise RunError(f"positions {pos}..{pos + T - 1} are outside the compiled KV cache of {max_len} positions; compile with a larger max_cache_len")
        ctx = {"token": int(tokens[0]), "pos": int(pos), "tokens": [int(t) for t in tokens]}
        if self._prefill_segments is None:
            self._prefill_segments = group_host_calls(self.p, self.segments, self._host_token, self._sizes)
        self._run(self._prefill_segments, ctx, pos)
        self.steps += 1
        out: list[dict[str, np.ndarray]] = [{} for _ in range(T)]
        for k, v in self.p.io["outputs"].items():
            name, t = k.rsplit("@", 1)
            out[int(t)][name] = self.bufs[v]
        return out

    def _run(self, segments: list, ctx: dict, pos: int) -> None:
        ht = self._host_token
        for kind, seg in segments:
            if kind == "hosts":  # one call for the prompt tokens of a prefill unit (nhil.runtime.host_batch)
                self._run_host_group(seg, ctx, pos)
            elif kind == "host":
                h = self.p.host_ops[seg]
                if ht is not None:  # a prefill program: the host call of prompt token ht[seg]
                    ctx = {"token": ctx["tokens"][ht[seg]], "pos": pos + ht[seg], "tokens": ctx["tokens"]}
                if h.kernel == "moe_dispatch":  # run the routed experts' sub-programs, then combine
                    k = int(h.attrs["top_k"])
                    ids = [int(i) for i in self.bufs[h.inputs[0]][:k]]
                    if any(not 0 <= e < len(h.attrs["experts"]) for e in ids) or len(set(ids)) != k:
                        raise RunError(f"moe_dispatch of layer {h.attrs['layer']}: bad routed expert ids {ids}")
                    self.moe_trace.append((int(h.attrs["layer"]), ids))
                    for e in ids:
                        self._run(self.expert_segments[h.attrs["experts"][e]], ctx, pos)
                ins = [self._val(n, ctx) for n in h.inputs]
                outs = [self.bufs[n] for n in h.outputs]
                serial = self._serial.get(seg)
                if serial is None:
                    serial = self._serial[seg] = serial_ok(h.kernel, [int(np.size(a)) for a in ins + outs])
                try:
                    if serial:
                        with one_thread():
                            KERNELS[h.kernel](ins, outs, ctx, **h.attrs)
                    else:
                        KERNELS[h.kernel](ins, outs, ctx, **h.attrs)
                except (ValueError, TypeError, IndexError, KeyError, RuntimeError, ZeroDivisionError, OverflowError) as e:
                    # sizes the load-time checks cannot know (buffer lengths vs attributes): a run failure, not a crash
                    raise RunError(f"host op {seg} ({h.kernel}) failed on its buffers {list(h.inputs)} -> {list(h.outputs)}: {type(e).__name__}: {e}") from None
            else:
                plan = self._seg_plans.get(id(seg))
                if plan is None:
                    plan = self._seg_plans[id(seg)] = self._segment_plan(seg)
                items, reads = plan
                bits: dict = {}
                bits_of = lambda b: self._bits(b, bits)  # noqa: E731
                block = [self._resolve(it, pos, bits) if it.__class__ is int else it.bind(pos, bits_of, self.bufs) for it in items]
                rbs = self.t.execute(block)
                if len(rbs) != len(reads):
                    raise RunError(f"target {self.t.name} returned {len(rbs)} readbacks for a block with {len(reads)} read instructions")
                if rbs.__class__ is ReadbackRun:  # end to end in one array: a few block copies (nhil.runtime.readback_scatter)
                    sc = self._scatters.get(id(seg), False)
                    if sc is False or (sc is not None and sc.spans is not rbs.spans):
                        try:
                            sc = ReadbackScatter(reads, rbs.spans, self.bufs, self._rows)
                        except ValueError:
                            sc = None
                        self._scatters[id(seg)] = sc
                    if sc is not None:
                        sc.apply(rbs.flat)
                        continue
                for (buf, off, cnt, sbk), data in zip(reads, rbs):
                    if sbk:  # bank words are bf16 bits: decode them (docs/isa.md RD_SBK)
                        data = bf16_bits_to_f32(np.asarray(data, dtype=np.uint16))
                    self.bufs[buf][off : off + cnt] = data[:cnt]

    def _run_host_group(self, group: list[int], ctx: dict, pos: int) -> None:
        """One batched call (``nhil.runtime.host_batch``) of the host ops ``group``, one per prompt token."""
        ht = self._host_token
        hs = [self.p.host_ops[i] for i in group]
        h = hs[0]
        b = BATCHED[h.kernel]
        io = self._group_io.get(id(group))
        if io is None:  # per input: shared, the [T, n] token rows, or per-member names; per output: rows or buffers
            names = [[m.inputs[p] for m in hs] for p in range(len(h.inputs))]
            ins_rows = [None if p in b.shared else rows_of(ns, self._rows) for p, ns in enumerate(names)]
            outs = [rows_of([m.outputs[j] for m in hs], self._rows) for j in range(len(h.outputs))]
            outs = [o if o is not None else [self.bufs[m.outputs[j]] for m in hs] for j, o in enumerate(outs)]
            io = self._group_io[id(group)] = (names, ins_rows, outs)
        names, ins_rows, outs = io
        member_wise = any(r is None and p not in b.shared for p, r in enumerate(ins_rows))  # an input read member by member
        ctxs = [{"token": ctx["tokens"][ht[i]], "pos": pos + ht[i], "tokens": ctx["tokens"]} for i in (group if member_wise else group[:1])]
        ins = [self._val(n[0], ctxs[0]) if p in b.shared else ins_rows[p] if ins_rows[p] is not None
               else [self._val(m, c) for m, c in zip(n, ctxs)] for p, n in enumerate(names)]
        try:
            with one_thread():
                b.fn(ins, outs, **h.attrs)
        except (ValueError, TypeError, IndexError, KeyError, RuntimeError, ZeroDivisionError, OverflowError) as e:
            raise RunError(f"host ops {group[0]}..{group[-1]} ({h.kernel}, {len(group)} prompt tokens) failed on their buffers "
                           f"{list(h.inputs)} -> {list(h.outputs)}: {type(e).__name__}: {e}") from None
