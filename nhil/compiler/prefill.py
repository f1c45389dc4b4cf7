"""The prefill program: a decode-step program rewritten to run ``T`` prompt tokens at once.

``prefill_program(decode, T)`` transforms the compiled decode step (one token at ``$pos``)
into a program for the tokens at positions ``$pos .. $pos+T-1``, which runs on the device
state the decode program was loaded into (same placement, same KV rows) and leaves the
KV cache exactly as ``T`` decode steps would; the decode program then continues from it.

How (``docs/isa.md`` "Prefill extension"):

* The decode stream is cut into *units*: each ``HOST`` call, and each device run up to its
  ``SYNC``. The prefill program runs every unit for all ``T`` tokens before the next unit
  (stage-major order), so each host hand-off is paid once per unit instead of once per
  token per unit. Every host buffer ``b`` becomes ``b@t`` per token (images and the
  ``zeros`` buffer are shared); position-relative templates (KV appends) carry the token
  offset ``t`` in their ``tok`` byte and bind at ``$pos + t``; each host call records its
  token in ``info["prefill"]["host_token"]`` (the runtime passes it ``$pos + t`` and
  token ``t``).
* A device run made only of bf16 GEMVs becomes a **multi-token GEMV** on a device with the
  prefill extension (``DeviceConfig.vectors`` V > 1): per batch of up to V tokens, token
  ``j``'s input chunk goes to global buffer ``j`` (``WR_GB`` with ``bank = j``) and one
  ``MAC_ABV`` per weight row serves all V tokens from one row activation, into accumulator
  set ``j`` (``WR_ACC``/``RD_ACC`` with ``bank = j``). Every output receives the same bursts
  in the same order as in its decode GEMV, so results are bit-identical.
* Any other device run (attention over the KV cache, KV appends, quantized GEMVs, which
  ``MAC_ABV`` does not read) is repeated per token, with the global-buffer contents and
  ``CFR`` values it inherits from earlier units re-established before each copy.

Causality: all tokens' K/V appends of a layer precede every token's ``q·Kᵀ`` of that layer,
so token ``t`` sees later tokens' keys in the cache; its softmax masks every position
``> $pos + t`` to an exact 0 (``masked_softmax`` / the model's own mask), and ``0 · v``
adds nothing to a ``p·V`` accumulator that the zeros of an unwritten row would not, for
finite ``v`` (``tests/test_prefill.py`` checks logits and the cache bit for bit).

Not transformed (``PrefillUnsupported``; the runtime then prefills token by token):
MoE expert dispatch (data-dependent sub-programs per token) and recurrent states (a
loop-carried read-modify-write per token).
"""

from __future__ import annotations

from nhil.compiler.builder import ZEROS
from nhil.errors import CompileError
from nhil.isa.instr import ALL_CH, CFR_W_FMT, FLAG_POS_COL, FLAG_POS_SLOT, NO_OPERAND, Instr, Op
from nhil.isa.program import HostOp, Operand, Program

MAX_TOKENS = 255  # the ``tok`` byte of a position-relative template


class PrefillUnsupported(CompileError):
    """The decode program has a part the prefill transform does not cover (names it); prefill runs per token."""


def _units(instrs: list[Instr]) -> list[tuple[str, object]]:
    """``("host", host-op index)`` and ``("dev", [instruction indices])`` units of a decode stream, in order.

    A ``WR_ACC`` that zeroes an accumulator only the next device run uses (the builder zeroes a GEMV's
    accumulators before the SYNC its input needs) moves to the start of that run, so every run
    zeroes what it accumulates.
    """
    out: list[tuple[str, object]] = []
    cur: list[int] = []
    carry: list[int] = []

    def close():
        nonlocal cur, carry
        used: set[int] = set()
        keep, moved = [], []
        for i in reversed(cur):
            ins = instrs[i]
            if ins.op is Op.WR_ACC and (ins.bank, ins.k) not in used:
                moved.append(i)
                continue
            if ins.op in (Op.MAC_AB, Op.MAC_SB, Op.RD_ACC):
                used.add((0, ins.k))
            keep.append(i)
        run = carry + keep[::-1]
        carry = moved[::-1]
        if run:
            out.append(("dev", run))
        cur = []

    for i, ins in enumerate(instrs):
        if ins.op is Op.HOST:
            if cur:
                close()
            out.append(("host", ins.imm))
        elif ins.op is Op.EOC:
            break
        else:
            cur.append(i)
            if ins.op is Op.SYNC:
                close()
    if cur or carry:
        close()
    if carry:
        out.append(("dev", carry))
    return out


def _refuse(p: Program) -> None:
    kernels = {h.kernel for h in p.host_ops}
    if kernels & {"moe_expert", "moe_dispatch"}:
        raise PrefillUnsupported("MoE expert dispatch is chosen per token at run time (moe_dispatch); the prompt is prefilled token by token")
    if p.info.get("recurrent_state"):
        raise PrefillUnsupported("recurrent states are read, updated and written back per token; the prompt is prefilled token by token")
    if p.info.get("kind", "decode-step") != "decode-step":
        raise PrefillUnsupported(f"the program is a {p.info.get('kind')!r}, not a decode step")


class _Writer:
    """Builds the prefill program's tables: renamed operands, host ops and buffers."""

    def __init__(self, p: Program, T: int) -> None:
        self.p, self.T = p, T
        self.instrs: list[Instr] = []
        self.operands: list[Operand] = []
        self._ix: dict[Operand, int] = {}
        self.host_ops: list[HostOp] = []
        self.host_token: list[int] = []
        self.buffers = {ZEROS: p.buffers[ZEROS]} if ZEROS in p.buffers else {}
        for name, size in p.buffers.items():
            if name != ZEROS:
                for t in range(T):
                    self.buffers[f"{name}@{t}"] = size

    def name(self, b: str, t: int) -> str:
        """Token ``t``'s copy of host buffer ``b`` (images, step inputs and ``zeros`` are shared)."""
        return f"{b}@{t}" if b in self.p.buffers and b != ZEROS else b

    def operand(self, buffer: str, offset: int, count: int) -> int:
        o = Operand(buffer, int(offset), int(count))
        i = self._ix.get(o)
        if i is None:
            i = self._ix[o] = len(self.operands)
            self.operands.append(o)
        return i

    def renamed(self, ins: Instr, t: int) -> Instr:
        """``ins`` for token ``t``: its operand's buffer renamed, a position template's token offset set."""
        if ins.operand != NO_OPERAND:
            o = self.p.operands[ins.operand]
            ins = ins._replace(operand=self.operand(self.name(o.buffer, t), o.offset, o.count))
        if ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL):
            ins = ins._replace(tok=t)
        return ins

    def host(self, h: HostOp, t: int) -> None:
        self.host_ops.append(HostOp(h.kernel, tuple(self.name(n, t) for n in h.inputs), tuple(self.name(n, t) for n in h.outputs), dict(h.attrs)))
        self.host_token.append(t)
        self.instrs.append(Instr(Op.HOST, imm=len(self.host_ops) - 1))


def _gb_reads_before_writes(instrs: list[Instr]) -> set[int]:
    """Global-buffer bursts a device run reads (MACs, COPY_GB_BK) before writing them itself."""
    written: set[int] = set()
    need: set[int] = set()
    for ins in instrs:
        span = set(range(ins.col, ins.col + ins.n))
        if ins.op in (Op.MAC_AB, Op.MAC_SB, Op.MAC_ABV, Op.COPY_GB_BK):
            need |= span - written
        elif ins.op in (Op.WR_GB, Op.COPY_BK_GB):
            written |= span
    return need


def _check_closed_accumulators(instrs: list[tuple[int, Instr]]) -> None:
    """Every accumulator a device run MACs or reads back must be zeroed (WR_ACC) in the same run."""
    zeroed: set[tuple[int, int]] = set()
    for i, ins in instrs:
        if ins.op is Op.WR_ACC:
            zeroed.add((ins.bank, ins.k))
        elif ins.op in (Op.MAC_AB, Op.MAC_SB, Op.RD_ACC) and (0, ins.k) not in zeroed:
            raise PrefillUnsupported(f"instruction {i} ({ins.op.name}) uses accumulator {ins.k} across a host hand-off; the prompt is prefilled token by token")


def prefill_program(decode: Program, tokens: int) -> Program:
    """The prefill program of ``tokens`` prompt tokens for a compiled decode step (module docstring).

    Args:
        decode: a decode-step Program (``nhil.compiler.pipeline.compile``), bf16 or quantized; shape-only
            programs (timing only) are accepted too.
        tokens: prompt tokens ``T`` per run, ``1 <= T <= 255``.
    Returns:
        A validated Program over the same device, bank images and host images;
        ``io["outputs"]`` has ``<name>@<t>`` for every decode output and token; ``info["prefill"]`` gives
        ``tokens``, ``vectors`` (the MAC_ABV width used, 1 = no multi-token GEMV), ``host_token``
        (the token of each host call) and ``multi_token_runs`` / ``per_token_runs`` (device runs of each kind).
    Raises:
        PrefillUnsupported: MoE dispatch, recurrent states, or an accumulator kept across a hand-off.
        CompileError: ``tokens`` out of range.
    """
    if not 1 <= tokens <= MAX_TOKENS:
        raise CompileError(f"a prefill program runs 1..{MAX_TOKENS} tokens (the tok byte of a KV-append template), got {tokens}; split the prompt")
    _refuse(decode)
    from nhil.compiler.schedule import _parse_gemv_run
    from nhil.timing.engine import kv_row_set

    d = decode.device
    T = tokens
    w = _Writer(decode, T)
    kv_rows = kv_row_set(decode)
    gb_writer: dict[int, int] = {}  # GB burst -> index of the decode instruction that last wrote it
    cfr: dict[int, int] = {}  # CFR register -> value in effect in the decode stream (absent = 0)
    multi = per_token = 0
    for kind, u in _units(decode.instrs):
        if kind == "host":
            for t in range(T):
                w.host(decode.host_ops[u], t)
            continue
        run = [decode.instrs[i] for i in u]
        sync = run[-1].op is Op.SYNC
        body = run[:-1] if sync else run
        _check_closed_accumulators([(i, decode.instrs[i]) for i in u])
        entry_cfr = dict(cfr)
        units = _parse_gemv_run(body, kv_rows) if body and d.vectors > 1 and not entry_cfr.get(CFR_W_FMT) else None
        if units:
            _multi_token_gemv(w, units, _parse_gemv_run.gb_instr, d.vectors, d.accumulators)  # type: ignore[attr-defined]
            multi += 1
        elif body:
            need = _gb_reads_before_writes(body)
            prefix = sorted({gb_writer[c] for c in need if c in gb_writer})
            cur = dict(entry_cfr)
            for t in range(T):
                for reg in sorted(set(cur) | set(entry_cfr)):
                    if cur.get(reg, 0) != entry_cfr.get(reg, 0):
                        w.instrs.append(Instr(Op.SET_CFR, ALL_CH, k=reg, imm=entry_cfr.get(reg, 0)))
                cur = dict(entry_cfr)
                for i in prefix:
                    w.instrs.append(w.renamed(decode.instrs[i], t))
                for ins in body:
                    w.instrs.append(w.renamed(ins, t))
                    if ins.op is Op.SET_CFR:
                        cur[ins.k] = ins.imm
            per_token += 1
        if sync:
            w.instrs.append(Instr(Op.SYNC))
        for i, ins in zip(u, run):  # the decode stream's GB and CFR state after the run
            if ins.op in (Op.WR_GB, Op.COPY_BK_GB):
                for c in range(ins.col, ins.col + ins.n):
                    gb_writer[c] = i
            elif ins.op is Op.SET_CFR:
                cfr[ins.k] = ins.imm
    if w.instrs[-1].op is not Op.SYNC:
        w.instrs.append(Instr(Op.SYNC))
    w.instrs.append(Instr(Op.EOC))
    outputs = {f"{k}@{t}": w.name(v, t) for t in range(T) for k, v in decode.io["outputs"].items()}
    io = {"inputs": {"tokens": f"int64 [{T}]: prompt token ids", "pos": "int64 scalar: cache position of the first token"}, "outputs": outputs}
    info = {k: v for k, v in decode.info.items() if k not in ("schedule",)}
    info["kind"] = "prefill"
    info["prefill"] = {"tokens": T, "vectors": d.vectors if multi else 1, "host_token": w.host_token,
                       "multi_token_runs": multi, "per_token_runs": per_token}
    prog = Program(d, w.instrs, w.operands, w.host_ops, w.buffers, decode.bank_images, decode.host_images, io, info)
    prog.validate()
    return prog


def _multi_token_gemv(w: _Writer, units, gb_instr: dict, vectors: int, accumulators: int) -> None:
    """Emit a run of GEMV accumulator units for every token, ``vectors`` tokens per row activation (module docstring).

    Per batch of up to ``vectors`` tokens and of up to ``accumulators`` units that read the same input
    chunks (``nhil.compiler.schedule`` ``gemv-batch``): zero accumulator ``k`` of every set, then per chunk
    one ``WR_GB`` per token into global buffer ``j`` and one ``MAC_ABV`` per unit, then one ``RD_ACC``
    per unit and set.
    """
    groups: dict[tuple, list] = {}
    for u in units:
        groups.setdefault(u.sig, []).append(u)
    for t0 in range(0, w.T, vectors):
        nv = min(vectors, w.T - t0)
        for sig, us in groups.items():
            for b0 in range(0, len(us), accumulators):
                batch = us[b0 : b0 + accumulators]
                for k, u in enumerate(batch):
                    for j in range(nv):
                        w.instrs.append(w.renamed(u.wr, t0 + j)._replace(k=k, bank=j))
                for c, g in enumerate(sig):
                    wr = gb_instr[g]
                    for j in range(nv):
                        w.instrs.append(w.renamed(wr, t0 + j)._replace(bank=j))
                    for k, u in enumerate(batch):
                        mac = u.macs[c][0]
                        w.instrs.append(Instr(Op.MAC_ABV, mac.flags, mac.ch, row=mac.row, col=mac.col, n=mac.n, k=k, imm=nv))
                for k, u in enumerate(batch):
                    for j in range(nv):
                        w.instrs.append(w.renamed(u.rd, t0 + j)._replace(k=k, bank=j))
