"""ISA encoding, program container and text form: round trips and clear errors on bad input."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import LoadError, ProgramFormatError
from nhil.isa import DEVICE_PRESETS, Instr, Op, Program
from nhil.isa.asm import assemble, disassemble
from nhil.isa.instr import KNOWN_FLAGS, WORD_BYTES
from nhil.targets import get_target

DEV = DEVICE_PRESETS["rtl-tiny"]


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from(list(Op)),
    flags=st.integers(0, 255).map(lambda f: f & KNOWN_FLAGS),
    ch=st.integers(0, 255),
    bank=st.integers(0, 255),
    row=st.integers(0, 65535),
    col=st.integers(0, 65535),
    n=st.integers(0, 65535),
    operand=st.integers(0, 65535),
    k=st.integers(0, 255),
    imm=st.integers(0, 65535),
)
def test_word_round_trip(op, flags, ch, bank, row, col, n, operand, k, imm):
    ins = Instr(op, flags, ch, bank, row, col, n, operand, k, imm)
    w = ins.encode()
    assert len(w) == WORD_BYTES == 16
    assert Instr.decode(w) == ins
    assert Instr.decode(w).encode() == w


def test_word_layout_is_little_endian_as_documented():
    w = Instr(Op.MAC_AB, 1, 2, 3, 0x1234, 0x0506, 0x0708, 0x090A, 4, 0xBEEF).encode()
    assert w == bytes([0x03, 0x01, 0x02, 0x03, 0x34, 0x12, 0x06, 0x05, 0x08, 0x07, 0x0A, 0x09, 0x04, 0x00, 0xEF, 0xBE])


def test_unknown_opcode_is_a_clear_error():
    w = bytearray(Instr(Op.NOP).encode())
    w[0] = 0x7E
    with pytest.raises(ProgramFormatError, match="unknown opcode 0x7e"):
        Instr.decode(bytes(w), 12)


def _small_program():
    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(0)
    b.buffer("x", 40)
    b.buffer("y", 20)
    p = b.place_matrix("w", rng.normal(size=(20, 40)).astype(np.float32))
    b.host_image("gamma", np.arange(40, dtype=np.float32))
    b.host("rms_norm", ["x", "gamma"], ["x"], eps=1e-5)
    b.gemv(p, "x", "y")
    b.alloc_rows(2)
    return b.finish({"inputs": {}, "outputs": {"y": "y"}}, {"model": "unit"})


def test_program_bytes_round_trip():
    prog = _small_program()
    data = prog.encode()
    again = Program.decode(data)
    assert again.encode() == data
    assert again.instrs == prog.instrs
    np.testing.assert_array_equal(again.bank_images[0].data, prog.bank_images[0].data)


def test_disasm_asm_round_trip_is_byte_identical():
    prog = _small_program()
    text = disassemble(prog, full=True)
    assert "MAC_AB ch=*" in text and "HOST" in text
    assert assemble(text).encode() == prog.encode()


def test_asm_without_blob_explains_how_to_get_one():
    with pytest.raises(ProgramFormatError, match="--full"):
        assemble(disassemble(_small_program(), full=False))


@pytest.mark.parametrize("cut", [0, 10, 30, 200, -5, -1])
def test_truncated_program_is_refused(cut):
    data = _small_program().encode()
    with pytest.raises(ProgramFormatError, match="truncated|CRC|too short"):
        Program.decode(data[:cut] if cut > 0 else data[:cut], source="prog.pimb")


def test_corrupted_byte_is_refused():
    data = bytearray(_small_program().encode())
    data[len(data) // 2] ^= 0x10
    with pytest.raises(ProgramFormatError, match="CRC-32 mismatch"):
        Program.decode(bytes(data), source="prog.pimb")


def test_bad_magic_and_version():
    data = bytearray(_small_program().encode())
    with pytest.raises(ProgramFormatError, match="not a .pimb"):
        Program.decode(b"XXXXXXXX" + bytes(data[8:]))


def test_unknown_opcode_inside_program_file():
    prog = _small_program()
    data = bytearray(prog.encode())
    # patch the first instruction's opcode and fix the CRC so only the opcode is wrong
    import struct, zlib

    mlen = struct.unpack_from("<Q", data, 16)[0]
    first = 24 + mlen + 8
    data[first] = 0x5A
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    with pytest.raises(ProgramFormatError, match="instruction 0: unknown opcode 0x5a"):
        Program.decode(bytes(data))


def test_elementwise_opcode_fails_at_load_on_a_target_without_it():
    """EWMUL/EWADD/AF: the simulator implements them (tests/test_ew_ops.py); a target whose capabilities lack them refuses at load."""
    from nhil.targets.base import DEVICE_OPS, Capabilities, check_program_fits

    prog = _small_program()
    prog.instrs.insert(0, Instr(Op.EWMUL, 1))
    get_target("sim").load(prog)
    with pytest.raises(LoadError, match="does not implement EWMUL .*claimed by the simulator only"):
        check_program_fits(prog, Capabilities(0, DEVICE_OPS, frozenset({"bf16"}), prog.device), "rtl")


def test_validate_rejects_out_of_range_operand():
    prog = _small_program()
    prog.operands[0] = type(prog.operands[0])("x", 30, 20)
    with pytest.raises(ProgramFormatError, match="outside buffer"):
        prog.validate()
