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
* On a device with the prefill extension (``DeviceConfig.vectors`` V > 1) a segment of a device
  run made of ``WR_GB`` / ``WR_ACC`` / ``RD_ACC`` / bf16 ``MAC_AB`` (GEMVs, and attention's
  ``q·Kᵀ`` and ``p·V`` over the KV rows) is **lifted**: per batch of up to V tokens, it runs
  once with token ``j`` in global buffer ``j`` and accumulator set ``j`` (each ``WR_GB`` /
  ``WR_ACC`` / ``RD_ACC`` once per token with ``bank = j``) and each ``MAC_AB`` as one
  ``MAC_ABV``: one row activation serves all V tokens. Each set sees exactly the decode
  step's instruction sequence on its own GB and accumulators, so results are bit-identical.
  Segments are cut only where no accumulator is live.
* Other segments (KV appends, quantized GEMVs, which ``MAC_ABV`` does not read) are repeated
  per token, with the global-buffer contents and ``CFR`` values they inherit re-established
  before each copy.

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
            if ins.op in (Op.MAC_AB, Op.MAC_SB, Op.RD_ACC) or ins.op in _EW:
                used.add((0, ins.k))
                if ins.op in (Op.EWMUL, Op.EWADD):  # the elementwise ops read a second accumulator (docs/isa.md)
                    used.add((0, ins.imm))
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
        self._ix: dict[tuple, int] = {}
        self._renamed_op: dict[tuple[int, int], int] = {}  # (decode operand, token) -> prefill operand
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
        key = (buffer, offset, count)
        i = self._ix.get(key)
        if i is None:
            i = self._ix[key] = len(self.operands)
            self.operands.append(Operand(buffer, int(offset), int(count)))
        return i

    def renamed(self, ins: Instr, t: int) -> Instr:
        """``ins`` for token ``t``: its operand's buffer renamed, a position template's token offset set."""
        op = ins.operand
        if op != NO_OPERAND:
            key = (op, t)
            op = self._renamed_op.get(key)
            if op is None:
                o = self.p.operands[ins.operand]
                op = self._renamed_op[key] = self.operand(self.name(o.buffer, t), o.offset, o.count)
        tok = t if ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL) else 0
        return Instr(ins.op, ins.flags, ins.ch, ins.bank, ins.row, ins.col, ins.n, op, ins.k, ins.imm, tok)

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


def prefill_program(decode: Program, tokens: int, extension: bool = True) -> Program:
    """The prefill program of ``tokens`` prompt tokens for a compiled decode step (module docstring).

    Args:
        decode: a decode-step Program (``nhil.compiler.pipeline.compile``), bf16 or quantized; shape-only
            programs (timing only) are accepted too.
        tokens: prompt tokens ``T`` per run, ``1 <= T <= 255``.
        extension: use the prefill extension (``MAC_ABV``) if the device has it; False: every segment is
            repeated per token (for a target that does not claim ``MAC_ABV``).
    Returns:
        A validated Program over the same device, bank images and host images;
        ``io["outputs"]`` has ``<name>@<t>`` for every decode output and token; ``info["prefill"]`` gives
        ``tokens``, ``vectors`` (the MAC_ABV width used, 1 = nothing lifted), ``host_token``
        (the token of each host call) and ``multi_token_runs`` / ``per_token_runs`` (segments lifted / repeated).
    Raises:
        PrefillUnsupported: MoE dispatch, recurrent states, or an accumulator kept across a hand-off.
        CompileError: ``tokens`` out of range.
    """
    if not 1 <= tokens <= MAX_TOKENS:
        raise CompileError(f"a prefill program runs 1..{MAX_TOKENS} tokens (the tok byte of a KV-append template), got {tokens}; split the prompt")
    _refuse(decode)
    d = decode.device
    T = tokens
    w = _Writer(decode, T)
    st = _StreamState()
    for kind, u in _units(decode.instrs):
        if kind == "host":
            for t in range(T):
                w.host(decode.host_ops[u], t)
            continue
        _check_closed_accumulators([(i, decode.instrs[i]) for i in u])
        sync = decode.instrs[u[-1]].op is Op.SYNC
        body = u[:-1] if sync else u
        for lift, seg in _segments(decode, body, extension and d.vectors > 1):
            if lift and not st.cfr.get(CFR_W_FMT) and _closed([decode.instrs[i] for i in seg]) and st.liftable_prefix(decode, seg):
                _lifted(w, st, seg, d.vectors)
                st.lifted += 1
            else:
                _per_token(w, st, seg)
                st.per_token += 1
            st.advance(decode, seg)
        if sync:
            w.instrs.append(Instr(Op.SYNC))
    if w.instrs[-1].op is not Op.SYNC:
        w.instrs.append(Instr(Op.SYNC))
    w.instrs.append(Instr(Op.EOC))
    outputs = {f"{k}@{t}": w.name(v, t) for t in range(T) for k, v in decode.io["outputs"].items()}
    io = {"inputs": {"tokens": f"int64 [{T}]: prompt token ids", "pos": "int64 scalar: cache position of the first token"}, "outputs": outputs}
    info = {k: v for k, v in decode.info.items() if k not in ("schedule",)}
    info["kind"] = "prefill"
    if "raw_buffers" in info:  # buffers sent as raw 16-bit words (fp8 KV rows): every token's copy
        info["raw_buffers"] = sorted(w.name(b, t) for b in info["raw_buffers"] for t in range(T))
    info["prefill"] = {"tokens": T, "vectors": d.vectors if st.lifted else 1, "host_token": w.host_token,
                       "multi_token_runs": st.lifted, "per_token_runs": st.per_token}
    prog = Program(d, w.instrs, w.operands, w.host_ops, w.buffers, decode.bank_images, decode.host_images, io, info)
    prog.validate()
    return prog


LIFTABLE = frozenset({Op.WR_GB, Op.WR_ACC, Op.RD_ACC, Op.MAC_AB})  # ops with a per-token (set j) form
_EW = frozenset({Op.EWMUL, Op.EWADD, Op.AF})  # accumulator set 0 only (docs/isa.md "Elementwise ops"): segments holding them repeat per token


class _StreamState:
    """The decode stream's global-buffer writers and CFR values, as of the segment being transformed."""

    def __init__(self) -> None:
        self.gb_writer: dict[int, int] = {}  # GB burst -> index of the decode instruction that last wrote it
        self.cfr: dict[int, int] = {}  # CFR register -> value in effect (absent = 0)
        self.lifted = self.per_token = 0

    def advance(self, p: Program, seg: list[int]) -> None:
        for i in seg:
            ins = p.instrs[i]
            if ins.op in (Op.WR_GB, Op.COPY_BK_GB):
                for c in range(ins.col, ins.col + ins.n):
                    self.gb_writer[c] = i
            elif ins.op is Op.SET_CFR:
                self.cfr[ins.k] = ins.imm

    def liftable_prefix(self, p: Program, seg: list[int]) -> bool:
        """The GB contents ``seg`` inherits were written by WR_GBs (which can be re-sent into each token's set)."""
        return all(p.instrs[i].op is Op.WR_GB for i in self.gb_prefix(p, seg))

    def gb_prefix(self, p: Program, seg: list[int]) -> list[int]:
        """The decode instructions that wrote the GB bursts ``seg`` reads before writing them itself."""
        need = _gb_reads_before_writes([p.instrs[i] for i in seg])
        return sorted({self.gb_writer[c] for c in need if c in self.gb_writer})


def _segments(p: Program, run: list[int], extension: bool) -> list[tuple[bool, list[int]]]:
    """A device run cut into segments of liftable instructions (``True``: WR_GB / WR_ACC / RD_ACC of set 0 and
    MAC_AB, with at least one MAC) and of the others (``False``), cut only where no accumulator is live (zeroed
    or accumulating and read later), so every accumulator lifetime stays in one segment."""
    ins = [p.instrs[i] for i in run]
    live_until: dict[int, int] = {}  # accumulator -> last position of its current lifetime
    inside = [False] * (len(ins) + 1)  # inside[x]: a lifetime spans the boundary before position x
    for x, it in enumerate(ins):
        if it.op in (Op.WR_ACC, Op.MAC_AB, Op.MAC_SB, Op.RD_ACC) or it.op in _EW:
            if it.op is Op.WR_ACC:
                live_until[it.k] = x
            for a in (it.k, it.imm) if it.op in (Op.EWMUL, Op.EWADD) else () if it.op is Op.WR_ACC else (it.k,):
                if a in live_until:  # an elementwise op's operands stay live up to it (set 0 only: never lifted)
                    for y in range(live_until[a] + 1, x + 1):
                        inside[y] = True
                    live_until[a] = x
    out: list[list] = []
    for x, (i, it) in enumerate(zip(run, ins)):
        lift = extension and it.op in LIFTABLE and (it.op is Op.MAC_AB or it.bank == 0)
        if out and (out[-1][0] == lift or inside[x]):
            out[-1][0] = out[-1][0] and lift
            out[-1][1].append(i)
        else:
            out.append([lift, [i]])
    return [(lift and any(p.instrs[i].op is Op.MAC_AB for i in seg), seg) for lift, seg in out]


def _closed(instrs: list[Instr]) -> bool:
    """Every accumulator the segment MACs or reads back is zeroed in it first (so each token's set starts from its own zero)."""
    zeroed: set[int] = set()
    for ins in instrs:
        if ins.op is Op.WR_ACC:
            zeroed.add(ins.k)
        elif ins.op in (Op.MAC_AB, Op.RD_ACC) and ins.k not in zeroed:
            return False
    return True


def _lifted(w: _Writer, st: _StreamState, seg: list[int], vectors: int) -> None:
    """The segment for every token, ``vectors`` tokens at a time, each token in its own global buffer and accumulator
    set: WR_GB / WR_ACC / RD_ACC once per token with ``bank`` = its set, each MAC_AB as one MAC_ABV (module docstring)."""
    p = w.p
    prefix = st.gb_prefix(p, seg)
    for t0 in range(0, w.T, vectors):
        nv = min(vectors, w.T - t0)
        for i in prefix + seg:
            ins = p.instrs[i]
            if ins.op is Op.MAC_AB:
                w.instrs.append(Instr(Op.MAC_ABV, ins.flags, ins.ch, row=ins.row, col=ins.col, n=ins.n, k=ins.k, imm=nv))
            else:
                for j in range(nv):
                    w.instrs.append(w.renamed(ins, t0 + j)._replace(bank=j))


def _per_token(w: _Writer, st: _StreamState, seg: list[int]) -> None:
    """The segment once per token, with the GB contents and CFR values it inherits re-established before each copy."""
    p = w.p
    prefix = st.gb_prefix(p, seg)
    entry = dict(st.cfr)
    cur = dict(entry)
    for t in range(w.T):
        for reg in sorted(set(cur) | set(entry)):
            if cur.get(reg, 0) != entry.get(reg, 0):
                w.instrs.append(Instr(Op.SET_CFR, ALL_CH, k=reg, imm=entry.get(reg, 0)))
        cur = dict(entry)
        for i in prefix:
            w.instrs.append(w.renamed(p.instrs[i], t))
        for i in seg:
            ins = p.instrs[i]
            w.instrs.append(w.renamed(ins, t))
            if ins.op is Op.SET_CFR:
                cur[ins.k] = ins.imm
