"""Text form of a program (``.pims``): disassembler and assembler that round-trip bytes.

Format (``docs/program-format.md``)::

    ; comment
    .pims 1 isa 0
    .meta <canonical JSON of the metadata, one line>
    .code
    <index>: <OPCODE> field=value ... [src=%<operand>|dst=%<operand>] [; comment]
    .blob <base64 of the image blob, wrapped at 76 columns>   (only with full=True)
    .end

``ch=*`` means the ALL_CH flag; ``@pos_slot`` / ``@pos_col`` are the position-relative
flags. Fields print when the opcode uses them or when they are nonzero, so any word
round-trips. ``assemble(disassemble(p, full=True))`` gives byte-identical ``.pimb``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

from nhil.errors import ProgramFormatError
from nhil.isa.instr import ALL_CH, FLAG_POS_COL, FLAG_POS_SLOT, NO_OPERAND, OPINFO, Instr, Op
from nhil.isa.program import Program, canonical_json

_FIELDS = ("ch", "bank", "row", "col", "n", "k", "imm", "tok")  # tok: prefill templates only (printed when nonzero)


def format_instr(ins: Instr, prog: Program | None = None) -> str:
    """One instruction as assembly text (without index), with a comment naming its operand/host op."""
    info = OPINFO[ins.op]
    parts = [ins.op.name]
    for f in _FIELDS:
        v = getattr(ins, f)
        if f == "ch":
            if ins.flags & ALL_CH:
                parts.append("ch=*")
            elif "ch" in info.fields or v:
                parts.append(f"ch={v}")
            continue
        if f in info.fields or v:
            parts.append(f"{f}={v:#06x}" if (f == "imm" and ins.op is Op.WR_SBK) else f"{f}={v}")
    if ins.flags & FLAG_POS_SLOT:
        parts.append("@pos_slot")
    if ins.flags & FLAG_POS_COL:
        parts.append("@pos_col")
    comment = ""
    if ins.operand != NO_OPERAND:
        parts.append(("dst" if info.data_out else "src") + f"=%{ins.operand}")
        if prog is not None and ins.operand < len(prog.operands):
            o = prog.operands[ins.operand]
            comment = f"{o.buffer}[{o.offset}:{o.offset + o.count}]"
    if ins.op is Op.HOST and prog is not None and ins.imm < len(prog.host_ops):
        h = prog.host_ops[ins.imm]
        comment = f"{','.join(h.outputs)} = {h.kernel}({', '.join(h.inputs)})"
    return " ".join(parts) + (f"  ; {comment}" if comment else "")


def disassemble(prog: Program, full: bool = False) -> str:
    """Program -> ``.pims`` text. ``full=True`` includes the image blob (base64) so it re-assembles."""
    meta, chunks = prog._meta_and_blob()
    lines = [
        f"; nhil PIM program: {prog.info.get('model', '?')} for device {prog.device.name}",
        f"; {len(prog.instrs)} instructions, {len(prog.operands)} operands, {len(prog.host_ops)} host ops, {len(prog.bank_images)} bank rows",
        ".pims 1 isa 0",
        ".meta " + canonical_json(meta),
        ".code",
    ]
    lines += [f"{i}: {format_instr(ins, prog)}" for i, ins in enumerate(prog.instrs)]
    if full:
        b64 = base64.b64encode(b"".join(chunks)).decode()
        lines.append(".blob")
        lines += [b64[i : i + 76] for i in range(0, len(b64), 76)]
    else:
        lines.append("; image blob omitted (disasm --full includes it, so the text re-assembles)")
    lines.append(".end")
    return "\n".join(lines) + "\n"


_TOKEN = re.compile(r"^(\w+)=(\S+)$")


def parse_instr(text: str, lineno: int = 0) -> Instr:
    """Parse one assembly instruction (``OPCODE field=value ...``; comment already stripped).

    Raises:
        ProgramFormatError: unknown opcode, unknown field, bad number (names the line).
    """
    toks = text.split()
    try:
        op = Op[toks[0]]
    except KeyError:
        raise ProgramFormatError(f"line {lineno}: unknown opcode {toks[0]!r}") from None
    f = dict(flags=0, ch=0, bank=0, row=0, col=0, n=0, operand=NO_OPERAND, k=0, imm=0, tok=0)
    for t in toks[1:]:
        if t == "@pos_slot":
            f["flags"] |= FLAG_POS_SLOT
            continue
        if t == "@pos_col":
            f["flags"] |= FLAG_POS_COL
            continue
        m = _TOKEN.match(t)
        if not m:
            raise ProgramFormatError(f"line {lineno}: cannot parse {t!r}")
        key, val = m.groups()
        if key == "ch" and val == "*":
            f["flags"] |= ALL_CH
            continue
        if key in ("src", "dst"):
            if not val.startswith("%"):
                raise ProgramFormatError(f"line {lineno}: operand must be %<index>, got {val!r}")
            key, val = "operand", val[1:]
        if key not in f or key == "flags":
            raise ProgramFormatError(f"line {lineno}: unknown field {key!r} for {op.name}")
        try:
            f[key] = int(val, 0)
        except ValueError:
            raise ProgramFormatError(f"line {lineno}: field {key} has non-integer value {val!r}") from None
    return Instr(op, **f)


def assemble(text: str, source: str = "<text>") -> Program:
    """``.pims`` text -> Program (validated). Needs a ``.blob`` section if the program has images.

    Raises:
        ProgramFormatError: syntax error, missing section, or inconsistent program.
    """
    tail = [ln.strip() for ln in text.splitlines()[-4:] if ln.strip()]
    if not tail or tail[-1] != ".end":
        raise ProgramFormatError(f"{source}: the last line is not '.end': the file is truncated (or not .pims text); "
                                 f"disassemble the program again with `nhil disasm --full`")
    meta = None
    instrs: list[Instr] = []
    blob_lines: list[str] = []
    section = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split(";", 1)[0].strip() if section != "blob" else raw.strip()
        if not line:
            continue
        if line.startswith(".pims"):
            if line.split()[1:] != ["1", "isa", "0"]:
                raise ProgramFormatError(f"{source}:{lineno}: unsupported header {line!r} (expected '.pims 1 isa 0')")
            continue
        if line.startswith(".meta "):
            try:
                meta = json.loads(raw.strip()[6:])
            except (json.JSONDecodeError, RecursionError) as e:
                raise ProgramFormatError(f"{source}:{lineno}: .meta is not valid JSON: {e}") from None
            continue
        if line in (".code", ".blob", ".end"):
            section = line[1:]
            continue
        if section == "code":
            idx, _, body = line.partition(":")
            if not body or not idx.strip().isdigit():
                raise ProgramFormatError(f"{source}:{lineno}: expected '<index>: <instruction>'")
            if int(idx) != len(instrs):
                raise ProgramFormatError(f"{source}:{lineno}: instruction index {idx} out of sequence (expected {len(instrs)})")
            instrs.append(parse_instr(body.strip(), lineno))
        elif section == "blob":
            blob_lines.append(line)
        else:
            raise ProgramFormatError(f"{source}:{lineno}: text outside a section: {line[:40]!r}")
    if meta is None:
        raise ProgramFormatError(f"{source}: missing .meta line")
    try:
        blob = base64.b64decode("".join(blob_lines), validate=True) if blob_lines else b""
    except (binascii.Error, ValueError) as e:
        raise ProgramFormatError(f"{source}: the .blob section is not valid base64 ({e}): the file is truncated or was edited; "
                                 f"disassemble again with `nhil disasm --full`") from None
    if section != "end":
        raise ProgramFormatError(f"{source}: no .end line: the file is truncated (last section: .{section})")
    if not isinstance(meta, dict):
        raise ProgramFormatError(f"{source}: .meta must be a JSON object")
    images = meta.get("bank_images")
    needs_blob = (isinstance(images, list) and any(not (isinstance(e, dict) and e.get("zero")) for e in images)) or bool(meta.get("host_images"))
    if needs_blob and not blob:
        raise ProgramFormatError(f"{source}: the program has images but no .blob section; disassemble with `nhil disasm --full`")
    from nhil.isa.meta import parse_meta

    meta = parse_meta(meta, source)
    try:
        prog = Program._from_meta(meta, instrs, memoryview(blob))
    except (KeyError, TypeError, ValueError) as e:
        raise ProgramFormatError(f"{source}: malformed metadata: {type(e).__name__}: {e}") from None
    prog.validate_named(source)
    return prog
