"""Opt-in program passes that move host elementwise kernels into the device (``EWMUL`` / ``EWADD`` / ``AF``, ``docs/isa.md``).

* ``ew-swiglu``: ``gate/up GEMVs; SYNC; HOST silu_mul(g, u) -> a`` becomes gate/up GEMVs whose
  accumulator batches pair row-group ``r`` of gate (accumulator ``2i``) with row-group ``r`` of up
  (``2i + 1``), then ``AF silu`` on the gate accumulator, ``EWMUL`` by the up accumulator and one
  ``RD_ACC`` of the product into ``a``; the up readback and the host kernel are gone (the SYNC
  stays: ``a`` is read back and broadcast again by the down GEMV). Values change:
  ``a = fp32(LUT_silu[bf16(g)] * u)`` instead of the host's fp32 ``silu(g) * u``; the device-numerics
  reference computes the same (``nhil.golden.quant_ew``), listed in ``info["ew_silu"]``.
* ``ew-residual``: ``GEMV -> o; SYNC; HOST add(x, o) -> y`` (the residual add after o_proj /
  down) becomes the GEMV with, before each readback, ``x``'s slice written into a spare accumulator
  (``WR_ACC``), ``EWADD`` of it, and the ``RD_ACC`` of the sum into ``y``; the host kernel is
  gone. Bit-identical: fp32 addition commutes, so ``fp32(o + x)`` is the host's ``fp32(x + o)``
  (a NaN sum is the canonical NaN on the device; the host may keep a payload).

Each rewrite applies only where the device block before the ``SYNC`` is a plain GEMV run
(``nhil.compiler.schedule._parse_gemv_run``: bf16 weights, no CFR change), every unit of it reads
back into the kernel's inputs, those buffers feed nothing else, and the host call directly
follows the SYNC; anything else (quantized weights, MoE programs, a consumer of ``g``/``u``/``o``
elsewhere) is left unchanged. Off by default: the zoo programs stay byte-identical.
"""

from __future__ import annotations

from nhil.isa.instr import ALL_CH, NO_OPERAND, Instr, Op
from nhil.isa.program import Operand, Program
from nhil.numerics.ew import AF_IDS

BARRIERS = frozenset({Op.SYNC, Op.HOST, Op.EOC})


def _users(p: Program) -> dict[str, int]:
    """Buffer -> how many host-op inputs, io outputs and data-in instructions read it."""
    n: dict[str, int] = {}
    for h in p.host_ops:
        for b in h.inputs:
            n[b] = n.get(b, 0) + 1
    for b in (p.io.get("outputs") or {}).values():
        n[b] = n.get(b, 0) + 1
    from nhil.isa.instr import OPINFO

    for ins in p.instrs:
        if OPINFO[ins.op].data_in and ins.operand != NO_OPERAND:
            b = p.operands[ins.operand].buffer
            n[b] = n.get(b, 0) + 1
    return n


def _sites(p: Program, kernel: str):
    """(run start, SYNC index, HOST index) of every ``HOST kernel`` directly after a SYNC that ends a device run."""
    instrs = p.instrs
    for h, ins in enumerate(instrs):
        if ins.op is not Op.HOST or p.host_ops[ins.imm].kernel != kernel or h == 0 or instrs[h - 1].op is not Op.SYNC:
            continue
        a = h - 1
        while a > 0 and instrs[a - 1].op not in BARRIERS:
            a -= 1
        if a < h - 1:
            yield a, h - 1, h


def _units(p: Program, run: list[Instr]):
    from nhil.compiler.schedule import _parse_gemv_run
    from nhil.timing.engine import kv_row_set

    units = _parse_gemv_run(run, kv_row_set(p))
    return (units, _parse_gemv_run.gb_instr) if units else (None, None)  # type: ignore[attr-defined]


def _rewrite(p: Program, kernel: str, build) -> tuple[list[Instr], list[Operand], list[str]]:
    """Apply ``build(program, run, hop, operands, users) -> new run | None`` at every site; returns (instrs, operands, rewritten outputs)."""
    if p.info.get("moe") or any(h.kernel.startswith("moe_") for h in p.host_ops):
        return p.instrs, p.operands, []
    users = _users(p)
    operands = list(p.operands)
    out: list[Instr] = []
    done: list[str] = []
    last = 0
    for a, s, h in list(_sites(p, kernel)):
        hop = p.host_ops[p.instrs[h].imm]
        new = build(p, p.instrs[a:s], hop, operands, users)
        if new is None:
            continue
        out.extend(p.instrs[last:a])
        out.extend(new)
        out.append(p.instrs[s])  # the SYNC
        last = h + 1  # the host call is gone
        done.append(hop.outputs[0])
    out.extend(p.instrs[last:])
    return out, operands, done


def _operand(operands: list[Operand], buf: str, offset: int, count: int) -> int:
    operands.append(Operand(buf, offset, count))
    return len(operands) - 1


def _swiglu(p, run, hop, operands, users):
    units, gb = _units(p, run)
    if not units:
        return None
    acc = p.device.accumulators
    g, u = hop.inputs
    (a,) = hop.outputs
    if users.get(g) != 1 or users.get(u) != 1:
        return None
    by = {g: {}, u: {}}
    for un in units:
        op = operands[un.rd.operand]
        if op.buffer not in by:
            return None
        by[op.buffer][(op.offset, op.count, un.rd.col, un.rd.n)] = un
    if by[g].keys() != by[u].keys() or any(by[g][key].sig != by[u][key].sig for key in by[g]):
        return None
    pairs = [(by[g][key], by[u][key], key) for key in sorted(by[g])]
    return _emit(pairs, gb, lambda gu, uu, key, kg, ku: [
        Instr(Op.AF, ALL_CH, k=kg, imm=AF_IDS["silu"]), Instr(Op.EWMUL, ALL_CH, k=kg, imm=ku),
        gu.rd._replace(k=kg, operand=_operand(operands, a, key[0], key[1]))], acc)


def _residual(p, run, hop, operands, users):
    """The run unchanged, plus, right before each ``RD_ACC`` (which now reads into ``y``): ``x``'s slice written into an
    accumulator the run never uses (``WR_ACC``) and ``EWADD`` of it. Kept next to the readback, inside the GEMV
    accumulator's lifetime, so a prefill program (``nhil.compiler.prefill``) repeats the segment per token."""
    from nhil.isa.instr import CFR_ACC_RD_FMT, OPINFO

    x, o = hop.inputs
    (y,) = hop.outputs
    if users.get(o) != 1 or x == o or any(i.op is Op.SET_CFR and i.k == CFR_ACC_RD_FMT and i.imm for i in p.instrs):
        return None
    used = {i.k for i in run if i.op in (Op.WR_ACC, Op.MAC_AB, Op.MAC_SB, Op.RD_ACC, Op.EWMUL, Op.EWADD, Op.AF)}
    used |= {i.imm for i in run if i.op in (Op.EWMUL, Op.EWADD)}
    rds = [j for j, i in enumerate(run) if OPINFO[i.op].data_out]
    if not rds or any(run[j].op is not Op.RD_ACC or not run[j].flags & ALL_CH or operands[run[j].operand].buffer != o
                      or operands[run[j].operand].count != run[j].n for j in rds):
        return None
    spare = [k for k in range(p.device.accumulators) if k not in used]
    if len(spare) < len(rds):
        return None
    body = list(run)
    for j, kx in zip(reversed(rds), reversed(spare[: len(rds)])):
        r = run[j]
        op = operands[r.operand]
        wr = Instr(Op.WR_ACC, ALL_CH, k=kx, col=r.col, n=r.n, operand=_operand(operands, x, op.offset, op.count))
        body[j : j + 1] = [wr, Instr(Op.EWADD, ALL_CH, k=r.k, imm=kx), r._replace(operand=_operand(operands, y, op.offset, op.count))]
    return body


def _emit(pairs, gb, tail, acc: int) -> list[Instr] | None:
    """Batches of ``acc // 2`` (gate, up) unit pairs: accumulators ``2i`` (gate) and ``2i + 1`` (up), then ``tail``.

    None (nothing emitted) unless every unit reads the same input chunks (one GB sequence per batch)."""
    if any(un.sig != pairs[0][0].sig for un, _, _ in pairs):
        return None
    out: list[Instr] = []
    cur = None
    half = acc // 2
    for b0 in range(0, len(pairs), half):
        batch = pairs[b0 : b0 + half]
        for i, (un, vn, key) in enumerate(batch):
            out.append(un.wr._replace(k=2 * i))
            out.append(vn.wr._replace(k=2 * i + 1))
        for j, g in enumerate(batch[0][0].sig):
            if g != cur:
                out.append(gb[g])
                cur = g
            for i, (un, vn, _) in enumerate(batch):
                out.append(un.macs[j][0]._replace(k=2 * i))
                out.append(vn.macs[j][0]._replace(k=2 * i + 1))
        for i, (un, vn, key) in enumerate(batch):
            out.extend(tail(un, vn, key, 2 * i, 2 * i + 1))
    return out


def _finish(p: Program, instrs, operands, done: list[str], name: str, key: str) -> Program:
    import dataclasses

    from nhil.compiler.schedule import _replace_instrs

    q = dataclasses.replace(p, operands=operands, info=dict(p.info, **{key: list(p.info.get(key, [])) + done}))
    return _replace_instrs(q, instrs, name)


def ew_swiglu(p: Program) -> Program:
    """The ``ew-swiglu`` pass (module docstring); ``info["ew_silu"]`` lists the rewritten ``silu_mul`` outputs."""
    if p.device.accumulators < 2:
        return p
    instrs, ops, done = _rewrite(p, "silu_mul", _swiglu)
    return _finish(p, instrs, ops, done, "ew-swiglu", "ew_silu")


def ew_residual(p: Program) -> Program:
    """The ``ew-residual`` pass (module docstring); ``info["ew_add"]`` lists the rewritten ``add`` outputs."""
    if p.device.accumulators < 2:
        return p
    instrs, ops, done = _rewrite(p, "add", _residual)
    return _finish(p, instrs, ops, done, "ew-residual", "ew_add")
