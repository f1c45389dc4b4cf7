"""The ``host-overlap`` program pass: device work that does not need a host kernel's outputs goes next to it.

The timing model overlaps a host kernel with later device instructions that do not depend
on its outputs (:class:`nhil.timing.overlap.HostOverlapEngine`); this pass arranges the
stream so that such work exists right after the host kernels:

* in every device block that follows a run of ``HOST`` calls (up to the next barrier),
  the instructions that neither read a buffer those calls write nor conflict with an
  earlier such instruction of the block (*independent*: the V append while the host
  ropes q and k, accumulator zeroing of the next GEMV, ...) move to the front, in their
  order; the *dependent* ones follow, in their order;
* inside a run of mutually independent ``HOST`` calls, the call whose outputs the block
  needs first runs first (rope of k before rope of q: the K append then overlaps the
  rope of q).

Two device instructions *conflict* when one writes a resource the other reads or writes:
the global buffer (any range), an accumulator ``k``, a CFR register, a bank row (a
position-relative append stands for the KV region of its base row, from
``info["kv_layout"]``; any row when it is in none), or a host buffer (data in / data
out). Instructions are only moved past instructions they do not conflict with and never
past a barrier, and host calls are only swapped when neither touches a buffer of the
other, so every instruction sees the same state as before: outputs are bit-identical
(``tests/test_schedule.py``). Off by default (it reorders the zoo programs): enable with
``--passes ...,host-overlap``.
"""

from __future__ import annotations

from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, NO_OPERAND, Instr, Op
from nhil.isa.program import Program

BARRIERS = frozenset({Op.SYNC, Op.HOST, Op.EOC})
ANY = "*"
EW = frozenset(o for o in Op if o.name in ("EWMUL", "EWADD", "AF"))


def _regions(p: Program) -> list[tuple[int, int, int]]:
    """KV regions ``(first row, end row, id)`` from ``info["kv_layout"]`` (K rows and V rows of each layer)."""
    out = []
    for i, kv in enumerate((p.info.get("kv_layout") or {}).values()):
        out.append((kv["k_base"], kv["k_base"] + kv["k_rows"], 2 * i))
        out.append((kv["v_base"], kv["v_base"] + kv["v_rows_per_group"] * kv["v_groups"], 2 * i + 1))
    return out


def _row(ins: Instr, regions) -> object:
    for lo, hi, rid in regions:
        if lo <= ins.row < hi:
            return ("kv", rid)
    return ANY if ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL) else ("row", ins.row)


def effects(ins: Instr, p: Program, regions) -> tuple[frozenset, frozenset]:
    """``(reads, writes)``: the resources a device instruction reads / writes (module docstring)."""
    op = ins.op
    buf = ("buf", p.operands[ins.operand].buffer) if ins.operand != NO_OPERAND and ins.operand < len(p.operands) else None
    if op is Op.NOP:
        return frozenset(), frozenset()
    if op is Op.WR_GB:
        return frozenset({buf}), frozenset({"gb"})
    if op is Op.WR_ACC:
        return frozenset({buf}), frozenset({("acc", ins.k)})
    if op in (Op.MAC_AB, Op.MAC_SB):
        return frozenset({"gb", _row(ins, regions), ("cfr", 1), ("acc", ins.k)}), frozenset({("acc", ins.k)})
    if op is Op.RD_ACC:
        return frozenset({("acc", ins.k), ("cfr", 0)}), frozenset({buf})
    if op in (Op.WR_SBK, Op.WR_ABK):
        return frozenset({buf}), frozenset({_row(ins, regions)})
    if op is Op.RD_SBK:
        return frozenset({_row(ins, regions)}), frozenset({buf})
    if op is Op.COPY_BK_GB:
        return frozenset({_row(ins, regions)}), frozenset({"gb"})
    if op is Op.COPY_GB_BK:
        return frozenset({"gb"}), frozenset({_row(ins, regions)})
    if op is Op.SET_CFR:
        return frozenset(), frozenset({("cfr", ins.k)})
    if op in EW:
        return frozenset({("acc", ins.k), ("acc", ins.imm)}), frozenset({("acc", ins.k)})
    return frozenset({ANY}), frozenset({ANY})


def _hits(a: frozenset, b: frozenset) -> bool:
    if not a or not b:
        return False
    return ANY in a or ANY in b or not a.isdisjoint(b)


def conflict(e1: tuple[frozenset, frozenset], e2: tuple[frozenset, frozenset]) -> bool:
    """Do two instructions with effects ``e1``, ``e2`` (from :func:`effects`) conflict (may not swap)?"""
    (r1, w1), (r2, w2) = e1, e2
    return _hits(w1, r2) or _hits(w1, w2) or _hits(w2, r1)


def _split_block(block: list[Instr], p: Program, regions, host_out: set[str]) -> tuple[list[Instr], list[Instr]]:
    """``(independent, dependent)`` instructions of a device block following host calls that write ``host_out``."""
    indep: list[Instr] = []
    dep: list[tuple[Instr, tuple]] = []
    for ins in block:
        e = effects(ins, p, regions)
        needs = any(isinstance(r, tuple) and r[0] == "buf" and r[1] in host_out for r in e[0])
        if needs or any(conflict(e, de) for _, de in dep):
            dep.append((ins, e))
        else:
            indep.append(ins)
    return indep, [i for i, _ in dep]


def _order_hosts(hosts: list[Instr], block: list[Instr], p: Program) -> list[Instr]:
    """Host calls ordered by the first block instruction that reads one of their outputs, when they are mutually independent."""
    ops = [p.host_ops[h.imm] for h in hosts]
    for i, a in enumerate(ops):
        for b in ops[i + 1 :]:
            ta, tb = set(a.inputs) | set(a.outputs), set(b.inputs) | set(b.outputs)
            if set(a.outputs) & tb or set(b.outputs) & ta:
                return hosts
    if any(h.kernel.startswith("moe_") for h in ops):
        return hosts

    def first_use(h) -> int:
        outs = set(p.host_ops[h.imm].outputs)
        for j, ins in enumerate(block):
            if ins.operand != NO_OPERAND and ins.operand < len(p.operands) and p.operands[ins.operand].buffer in outs:
                return j
        return len(block)

    return sorted(hosts, key=first_use)


def host_overlap(p: Program) -> Program:
    """The ``host-overlap`` pass (module docstring)."""
    from nhil.compiler.schedule import _replace_instrs

    regions = _regions(p)
    instrs = p.instrs
    out: list[Instr] = []
    i, n = 0, len(instrs)
    while i < n:
        if instrs[i].op is not Op.HOST:
            out.append(instrs[i])
            i += 1
            continue
        j = i
        while j < n and instrs[j].op is Op.HOST:
            j += 1
        k = j
        while k < n and instrs[k].op not in BARRIERS:
            k += 1
        hosts, block = instrs[i:j], instrs[j:k]
        host_out = {o for h in hosts for o in p.host_ops[h.imm].outputs}
        indep, dep = _split_block(block, p, regions, host_out)
        out.extend(_order_hosts(hosts, block, p))
        out.extend(indep + dep)
        i = k
    return _replace_instrs(p, out, "host-overlap")
