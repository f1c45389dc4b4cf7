"""ISA v0 instruction word: opcodes, fields, 16-byte little-endian encoding.

Word layout (``docs/isa.md`` section "Encoding"), little-endian, 16 bytes::

    byte  0     op       u8   opcode (table OPINFO)
    byte  1     flags    u8   bit0 ALL_CH: every channel; bit1 POS_SLOT, bit2 POS_COL
                              (position-relative, bound by the host runtime, never sent)
    byte  2     ch       u8   channel (ignored when ALL_CH)
    byte  3     bank     u8   bank
    bytes 4-5   row      u16  row
    bytes 6-7   col      u16  burst index within the row / global buffer, or first slot (RD_ACC)
    bytes 8-9   n        u16  burst count, or slot count (RD_ACC/WR_ACC)
    bytes 10-11 operand  u16  index into the program's operand table, 0xFFFF = none
    byte  12    k        u8   accumulator index
    byte  13    tok      u8   prompt-token offset of a position-relative template (prefill programs: bound at
                              ``$pos + tok``); 0 without POS_SLOT / POS_COL; never sent to a device
    bytes 14-15 imm      u16  lane mask (WR_SBK), register value (SET_CFR), host op (HOST)
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from nhil.errors import ProgramFormatError

WORD = struct.Struct("<BBBBHHHHBBH")
WORD_BYTES = WORD.size  # 16
NO_OPERAND = 0xFFFF

ALL_CH = 0x01
FLAG_POS_SLOT = 0x02
FLAG_POS_COL = 0x04
KNOWN_FLAGS = ALL_CH | FLAG_POS_SLOT | FLAG_POS_COL


class Op(enum.IntEnum):
    """Opcodes of ISA v0 (semantics in ``docs/isa.md``)."""

    NOP = 0x00
    WR_GB = 0x01
    WR_ACC = 0x02
    MAC_AB = 0x03
    MAC_SB = 0x04
    RD_ACC = 0x05
    WR_SBK = 0x06
    RD_SBK = 0x07
    WR_ABK = 0x08
    COPY_BK_GB = 0x09
    COPY_GB_BK = 0x0A
    SET_CFR = 0x0B
    SYNC = 0x0C
    EOC = 0x0D
    MAC_ABV = 0x0E  # prefill extension: one row activation, several GB vectors into several accumulator sets
    EWMUL = 0x10  # in-device elementwise ops (docs/isa.md "Elementwise ops"): claimed by the simulator only
    EWADD = 0x11
    AF = 0x12
    HOST = 0x20  # host-kernel call; split off by the runtime, never sent to a device


class OpInfo(NamedTuple):
    """Static facts of an opcode: does it take a data operand in, give one out, and which fields it uses."""

    data_in: bool
    data_out: bool
    fields: tuple[str, ...]
    device: bool = True


OPINFO: dict[Op, OpInfo] = {
    Op.NOP: OpInfo(False, False, ()),
    Op.WR_GB: OpInfo(True, False, ("ch", "col", "n")),
    Op.WR_ACC: OpInfo(True, False, ("ch", "k", "col", "n")),
    Op.MAC_AB: OpInfo(False, False, ("ch", "row", "col", "n", "k")),
    Op.MAC_SB: OpInfo(False, False, ("ch", "bank", "row", "col", "n", "k")),
    Op.RD_ACC: OpInfo(False, True, ("ch", "k", "col", "n")),
    Op.WR_SBK: OpInfo(True, False, ("ch", "bank", "row", "col", "imm")),
    Op.RD_SBK: OpInfo(False, True, ("ch", "bank", "row", "col", "n")),
    Op.WR_ABK: OpInfo(True, False, ("ch", "row", "col", "n")),
    Op.COPY_BK_GB: OpInfo(False, False, ("ch", "bank", "row", "col", "n")),
    Op.COPY_GB_BK: OpInfo(False, False, ("ch", "bank", "row", "col", "n")),
    Op.SET_CFR: OpInfo(False, False, ("ch", "k", "imm")),
    Op.SYNC: OpInfo(False, False, ()),
    Op.EOC: OpInfo(False, False, ()),
    Op.MAC_ABV: OpInfo(False, False, ("ch", "row", "col", "n", "k", "imm")),
    Op.EWMUL: OpInfo(False, False, ("ch", "k", "imm")),  # ACC k = ACC k * ACC imm
    Op.EWADD: OpInfo(False, False, ("ch", "k", "imm")),  # ACC k = ACC k + ACC imm
    Op.AF: OpInfo(False, False, ("ch", "k", "imm")),  # ACC k = LUT_imm[bf16(ACC k)]
    Op.HOST: OpInfo(False, False, ("imm",), device=False),
}

EW_OPS = frozenset({Op.EWMUL, Op.EWADD, Op.AF})  # in-device elementwise ops: only targets that list them implement them
RESERVED_OPS = EW_OPS  # not in every target's v0 set (RTL and FPGA refuse them at load); the name predates their semantics
EXTENSION_OPS = frozenset({Op.MAC_ABV})  # beyond ISA v0's base: claimed only by targets whose device has ``vectors`` > 1

# CFR registers (SET_CFR k=<reg>, imm=<value>)
CFR_ACC_RD_FMT = 0  # 0: RD_ACC returns fp32; 1: RD_ACC returns bf16 (RNE) widened to fp32
CFR_W_FMT = 1  # weight format MAC_AB/MAC_SB read bank rows in: 0 = bf16 (reset value); codes in nhil.numerics.formats (docs/isa.md)


class Instr(NamedTuple):
    """One decoded ISA v0 instruction (fields as in the word layout)."""

    op: Op
    flags: int = 0
    ch: int = 0
    bank: int = 0
    row: int = 0
    col: int = 0
    n: int = 0
    operand: int = NO_OPERAND
    k: int = 0
    imm: int = 0
    tok: int = 0

    def encode(self) -> bytes:
        """The 16-byte little-endian word (``struct`` raises if a field is out of range)."""
        try:
            return WORD.pack(int(self.op), self.flags, self.ch, self.bank, self.row, self.col, self.n, self.operand, self.k, self.tok, self.imm)
        except struct.error as e:
            raise ProgramFormatError(f"instruction field out of range in {self}: {e}") from None

    @classmethod
    def decode(cls, word: bytes, index: int = -1) -> "Instr":
        """Parse a 16-byte word.

        Raises:
            ProgramFormatError: unknown opcode, unknown flag bits, or a token offset on an instruction without
                position flags (names the instruction index and the byte values).
        """
        op, flags, ch, bank, row, col, n, operand, k, tok, imm = WORD.unpack(word)
        try:
            opc = Op(op)
        except ValueError:
            raise ProgramFormatError(f"instruction {index}: unknown opcode 0x{op:02x} (ISA v0 knows {', '.join(o.name for o in Op)})") from None
        if flags & ~KNOWN_FLAGS:
            raise ProgramFormatError(f"instruction {index} ({opc.name}): unknown flag bits 0x{flags:02x}")
        if tok and not flags & (FLAG_POS_SLOT | FLAG_POS_COL):
            raise ProgramFormatError(f"instruction {index} ({opc.name}): token offset byte is 0x{tok:02x} without a position flag, must be 0")
        return cls(opc, flags, ch, bank, row, col, n, operand, k, imm, tok)
