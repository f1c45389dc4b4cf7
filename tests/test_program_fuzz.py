"""Fuzzing the program loader (hypothesis, bounded): every mutated ``.pimb`` (raw bytes; metadata,
instruction words and header with a valid CRC), ``.pims`` text and metadata object either loads
and runs on the simulator to a result, or is refused with a LOAD_FAIL error (ProgramFormatError /
LoadError); a run may end in RunError (an NhilError). Zero other exceptions."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nhil.errors import LoadError, NhilError, ProgramFormatError
from nhil.isa import Program
from nhil.isa.asm import assemble, disassemble
from nhil.isa.device import DEVICE_PRESETS
from nhil.isa.instr import WORD, WORD_BYTES, Op
from nhil.isa.program import _HEAD, _U64, canonical_json

DEV = DEVICE_PRESETS["rtl-tiny"]  # 1 channel x 16 banks x 256 rows x 128 cols: fast to run
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OUTCOMES: dict[str, int] = {}


def _program() -> Program:
    from nhil.compiler.builder import ProgramBuilder

    b = ProgramBuilder(DEV)
    rng = np.random.default_rng(1)
    n_out, n_in = DEV.slots + 3, DEV.cols + 16
    b.buffer("x", n_in)
    b.buffer("h", n_out)
    b.host_image("x0", rng.normal(size=n_in).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", rng.normal(size=(n_out, n_in)).astype(np.float32)), "x", "h")
    b.host("narrow", ["h"], ["h"], start=0, length=n_out)
    return b.finish({"inputs": {}, "outputs": {"h": "h"}}, {"model": "fuzz"})


PROG = _program()
BLOB = PROG.encode()
META, CHUNKS = PROG._meta_and_blob()


def _pack(meta, words: bytes, blob: bytes, head_fields=None) -> bytes:
    """A .pimb with a valid CRC around the given parts (so the fuzzer reaches past the CRC check)."""
    mj = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode() if not isinstance(meta, bytes) else meta
    magic, cver, isa, rsv = head_fields or (b"NHILPIMB", 1, 0, 0)
    body = _HEAD.pack(magic, cver, isa, rsv, len(mj)) + mj + _U64.pack(len(words) // WORD_BYTES) + words + _U64.pack(len(blob)) + blob
    return body + struct.pack("<I", zlib.crc32(body))


WORDS = b"".join(i.encode() for i in PROG.instrs)
RAW_BLOB = b"".join(CHUNKS)


def _load_and_run(load) -> str:
    """'refused' (LOAD_FAIL), 'run_error' (an NhilError while running) or 'ran'; any other exception fails the test."""
    from nhil.runtime.executor import Runner
    from nhil.targets.sim import SimTarget

    try:
        prog = load()
    except (ProgramFormatError, LoadError) as e:
        assert e.outcome == "LOAD_FAIL" and str(e)
        return "refused"
    try:
        r = Runner(prog, SimTarget(device=prog.device))
        r.reset()
        for t in range(2):
            out = r.step(1, t)
            assert all(isinstance(v, np.ndarray) for v in out.values())
    except NhilError as e:
        assert str(e)
        return "run_error"
    return "ran"


def _tally(kind: str, outcome: str) -> None:
    OUTCOMES[f"{kind}:{outcome}"] = OUTCOMES.get(f"{kind}:{outcome}", 0) + 1


def test_the_unmutated_program_runs():
    assert _load_and_run(lambda: Program.decode(BLOB)) == "ran"
    assert _load_and_run(lambda: Program.decode(_pack(META, WORDS, RAW_BLOB))) == "ran"
    assert _load_and_run(lambda: assemble(disassemble(PROG, full=True))) == "ran"


@FUZZ
@given(st.data())
def test_fuzz_pimb_bytes(data):
    b = bytearray(BLOB)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        i = data.draw(st.integers(0, len(b) - 1))
        if kind == "flip":
            b[i] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del b[i:]
            if not b:
                break
        elif kind == "insert":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            del b[i : i + data.draw(st.integers(1, 16))]
            if not b:
                break
    _tally("bytes", _load_and_run(lambda: Program.decode(bytes(b))))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


PATHS = list(_paths(META))
LEAVES = [p for p in PATHS if not isinstance(_get(META, p), (dict, list))]


def _mutated_meta(data):
    meta = META
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(LEAVES if data.draw(st.integers(0, 4)) else PATHS))  # mostly one leaf
        # mostly type/size changes of an existing leaf; sometimes small integer nudges (bounds)
        try:
            old = _get(meta, path)
        except (KeyError, IndexError, TypeError):
            old = None
        if isinstance(old, int) and not isinstance(old, bool) and data.draw(st.integers(0, 3)):
            new = old + data.draw(st.sampled_from([-1, 1, 2, -old, -old - 1, 1 << 16, 1 << 31, 1 << 62]))
        else:
            new = data.draw(JSON)
        try:
            meta = _set(meta, path, new)
        except (KeyError, IndexError, TypeError):
            pass
    return meta


@FUZZ
@given(st.data())
def test_fuzz_metadata_with_a_valid_crc(data):
    meta = _mutated_meta(data)
    _tally("meta", _load_and_run(lambda: Program.decode(_pack(meta, WORDS, RAW_BLOB))))


FIELDS = ["op", "flags", "ch", "bank", "row", "col", "n", "operand", "k", "tok", "imm"]
WIDTH = {"op": 8, "flags": 8, "ch": 8, "bank": 8, "row": 16, "col": 16, "n": 16, "operand": 16, "k": 8, "tok": 8, "imm": 16}


@FUZZ
@given(st.data())
def test_fuzz_instruction_words_with_a_valid_crc(data):
    words = bytearray(WORDS)
    n = len(words) // WORD_BYTES
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, n - 1))
        vals = list(WORD.unpack_from(words, i * WORD_BYTES))
        f = data.draw(st.sampled_from(FIELDS))
        j = FIELDS.index(f)
        if f == "op":
            vals[j] = data.draw(st.sampled_from([int(o) for o in Op] + [0x0F, 0x7F, 0xFF]))
        else:
            vals[j] = data.draw(st.one_of(st.integers(0, 3), st.integers(0, (1 << WIDTH[f]) - 1), st.just(vals[j] + 1 if vals[j] + 1 < 1 << WIDTH[f] else 0)))
        WORD.pack_into(words, i * WORD_BYTES, *vals)
    _tally("words", _load_and_run(lambda: Program.decode(_pack(META, bytes(words), RAW_BLOB))))


@FUZZ
@given(st.data())
def test_fuzz_header_with_a_valid_crc(data):
    fields = (data.draw(st.sampled_from([b"NHILPIMB", b"NHILPIMC"])), data.draw(st.sampled_from([1, 1, 2])), data.draw(st.sampled_from([0, 0, 1])),
              data.draw(st.sampled_from([0, 0, 1, 0xFFFFFFFF])))
    meta = canonical_json(META).encode()
    if data.draw(st.booleans()):
        meta = meta[: data.draw(st.integers(0, len(meta)))]
    _tally("header", _load_and_run(lambda: Program.decode(_pack(meta, WORDS, RAW_BLOB, fields))))


TEXT = disassemble(PROG, full=True)


@FUZZ
@given(st.data())
def test_fuzz_pims_text(data):
    lines = TEXT.splitlines(keepends=True)
    kind = data.draw(st.sampled_from(["cut", "drop_line", "edit_number", "edit_meta", "swap_token"]))
    if kind == "cut":
        text = TEXT[: data.draw(st.integers(0, len(TEXT)))]
    elif kind == "drop_line":
        i = data.draw(st.integers(0, len(lines) - 1))
        text = "".join(lines[:i] + lines[i + 1 :])
    elif kind == "edit_number":
        import re

        nums = list(re.finditer(r"\d+", TEXT))
        m = data.draw(st.sampled_from(nums))
        text = TEXT[: m.start()] + str(data.draw(st.integers(0, 1 << 20))) + TEXT[m.end() :]
    elif kind == "edit_meta":
        meta = _mutated_meta(data)
        text = "".join(f".meta {json.dumps(meta, sort_keys=True, separators=(',', ':'))}\n" if ln.startswith(".meta ") else ln for ln in lines)
    else:
        i = data.draw(st.integers(0, len(lines) - 1))
        toks = lines[i].split(" ")
        toks[data.draw(st.integers(0, len(toks) - 1))] = data.draw(st.sampled_from(["MAC_AB", "row=9999", "n=0", "%7", "k=9", "ch=*", "x", ""]))
        text = "".join(lines[:i] + [" ".join(toks)] + lines[i + 1 :])
    _tally("pims", _load_and_run(lambda: assemble(text, "<fuzz.pims>")))


def test_fuzz_outcomes_summary():
    """Not a check: prints how the fuzz inputs ended (runs last in this file)."""
    print("fuzz outcomes:", dict(sorted(OUTCOMES.items())))


# ---------------------------------------------------------------- the named cases
def _with(meta=None, words=None):
    return _pack(META if meta is None else meta, WORDS if words is None else words, RAW_BLOB)


def _word_with(index: int, **fields) -> bytes:
    words = bytearray(WORDS)
    vals = list(WORD.unpack_from(words, index * WORD_BYTES))
    for k, v in fields.items():
        vals[FIELDS.index(k)] = v
    WORD.pack_into(words, index * WORD_BYTES, *vals)
    return bytes(words)


def test_out_of_range_fields_are_refused_at_load_naming_instruction_and_field():
    mac = next(i for i, ins in enumerate(PROG.instrs) if ins.op is Op.MAC_AB)
    with pytest.raises(ProgramFormatError, match=rf"<bytes>: instruction {mac} \(MAC_AB\): row 300 >= 256"):
        Program.decode(_with(words=_word_with(mac, row=300)))
    with pytest.raises(ProgramFormatError, match=rf"instruction {mac} \(MAC_AB\): accumulator 4 >= 4"):
        Program.decode(_with(words=_word_with(mac, k=4)))
    with pytest.raises(ProgramFormatError, match=rf"instruction {mac} \(MAC_AB\): bursts \[0, 9\) outside the row of 8 bursts"):
        Program.decode(_with(words=_word_with(mac, col=0, n=9)))
    rd = next(i for i, ins in enumerate(PROG.instrs) if ins.op is Op.RD_ACC)
    with pytest.raises(ProgramFormatError, match=rf"instruction {rd} \(RD_ACC\): operand of \d+ elements, the instruction moves at most"):
        Program.decode(_with(words=_word_with(rd, n=1)))


def test_host_op_names_arities_and_attributes_are_checked_at_load():
    def meta_with(**change):
        m = json.loads(json.dumps(META))
        m["host_ops"][1].update(change)
        return m

    cases = [
        (dict(kernel="no_such_kernel"), r"host op 1: unknown host kernel 'no_such_kernel'"),
        (dict(inputs=["h", "h"]), r"host op 1: narrow takes 1 inputs, got 2"),
        (dict(attrs={"start": 0}), r"host op 1: narrow needs attribute 'length'"),
        (dict(attrs={"start": 0, "length": 3, "bogus": 1}), r"narrow has no attribute\(s\) \['bogus'\]"),
        (dict(attrs={"start": "0", "length": 3}), r"narrow attribute start='0' is a str, expected int"),
        (dict(attrs={"start": True, "length": 3}), r"narrow attribute start=True is a bool, expected int"),
        (dict(outputs=["x0"]), r"writes 'x0', which is not a host buffer"),
    ]
    for change, msg in cases:
        with pytest.raises(ProgramFormatError, match=msg):
            Program.decode(_with(meta=meta_with(**change)))
    m = json.loads(json.dumps(META))
    m["io"]["outputs"]["h"] = "nope"
    with pytest.raises(ProgramFormatError, match="io output 'h' names 'nope', which is not a host buffer"):
        Program.decode(_with(meta=m))


def test_metadata_of_the_wrong_type_is_a_message_naming_the_field():
    m = json.loads(json.dumps(META))
    m["bank_images"][0]["row"] = "7"
    with pytest.raises(ProgramFormatError, match=r"malformed metadata: bank_images\.0\.row: Input should be a valid integer"):
        Program.decode(_with(meta=m))
    m = json.loads(json.dumps(META))
    m["host_images"][0]["shape"] = [1 << 20, 1 << 20]
    with pytest.raises(ProgramFormatError, match="exceeds"):
        Program.decode(_with(meta=m))


def test_reserved_header_field_is_checked():
    b = bytearray(BLOB)
    b[12] = 1
    b[-4:] = struct.pack("<I", zlib.crc32(bytes(b[:-4])))
    with pytest.raises(ProgramFormatError, match="reserved header field is 0x00000001, must be 0"):
        Program.decode(bytes(b))


def test_the_header_is_checked_before_the_body_is_read(tmp_path):
    """A 2 GB sparse file: a foreign magic, or a valid header whose counts cannot fit, is refused
    from the header and two counts alone (the whole file was read before: 2.1 GB RSS)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for head in (b"ELF\x7f" + b"\0" * 20, _HEAD.pack(b"NHILPIMB", 1, 0, 0, 2)):
        p = tmp_path / "big.pimb"
        with open(p, "wb") as f:
            f.write(head)
            f.truncate(2 << 30)
        with pytest.raises(ProgramFormatError, match="not a .pimb program|run past the end|does not match"):
            Program.load(p)
        p.unlink()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10  # under 256 MiB more


def test_pims_cut_anywhere_says_truncated():
    for cut in (len(TEXT) // 3, len(TEXT) - 10, len(TEXT) - 3):
        with pytest.raises(ProgramFormatError, match="truncated"):
            assemble(TEXT[:cut], "<cut.pims>")
