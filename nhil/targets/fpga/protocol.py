"""Messages of the FPGA link protocol v2 (``docs/link-protocol.md`` sections 3-6).

Payload layouts are little-endian. Parsers raise :class:`ProtocolError` on any
inconsistency (short payload, trailing bytes, counts that do not add up); the device
answers those with ``ERROR E_BAD_LENGTH``, the host turns them into ``LinkError``.
"""

from __future__ import annotations

import struct

import numpy as np

from nhil.isa.instr import OPINFO, WORD_BYTES, Op

PROTOCOL_VERSION = 2
ISA_VERSION = 0

# ----------------------------------------------------------------- message types
HELLO = 0x01
INFO = 0x02
RESET = 0x03
WRITE_MEM = 0x04
READ_MEM = 0x05
LOAD_PROGRAM = 0x06
LOAD_END = 0x07
EXEC = 0x08
STATUS = 0x09
MSG_BEGIN = 0x0A
MSG_DATA = 0x0B
MSG_ZERO = 0x0C
FETCH = 0x0D
MSG_QUERY = 0x0E
MEM_CRC = 0x0F

ACK = 0x80
HELLO_REPLY = 0x81
INFO_REPLY = 0x82
MEM_DATA = 0x85
READBACK = 0x88
STATUS_REPLY = 0x89
ACCEPTED = 0x8A
FRAG_ACK = 0x8B
REPLY_HEAD = 0x8C
REPLY_DATA = 0x8D
MEM_CRC_REPLY = 0x8F
NAK = 0xFE
ERROR = 0xFF

REQUESTS = {HELLO, INFO, RESET, WRITE_MEM, READ_MEM, LOAD_PROGRAM, LOAD_END, EXEC, STATUS, MSG_BEGIN, MSG_DATA, MSG_ZERO, FETCH, MSG_QUERY, MEM_CRC}
INNER_REQUESTS = {INFO, RESET, WRITE_MEM, READ_MEM, LOAD_PROGRAM, LOAD_END, EXEC, STATUS, MEM_CRC}  # may travel as a fragmented message
NAMES = {
    HELLO: "HELLO", INFO: "INFO", RESET: "RESET", WRITE_MEM: "WRITE_MEM", READ_MEM: "READ_MEM", LOAD_PROGRAM: "LOAD_PROGRAM",
    LOAD_END: "LOAD_END", EXEC: "EXEC", STATUS: "STATUS", ACK: "ACK", HELLO_REPLY: "HELLO_REPLY", INFO_REPLY: "INFO_REPLY",
    MEM_DATA: "MEM_DATA", READBACK: "READBACK", STATUS_REPLY: "STATUS_REPLY", ACCEPTED: "ACCEPTED", NAK: "NAK", ERROR: "ERROR",
    MSG_BEGIN: "MSG_BEGIN", MSG_DATA: "MSG_DATA", MSG_ZERO: "MSG_ZERO", FETCH: "FETCH", MSG_QUERY: "MSG_QUERY", FRAG_ACK: "FRAG_ACK", REPLY_HEAD: "REPLY_HEAD",
    REPLY_DATA: "REPLY_DATA", MEM_CRC: "MEM_CRC", MEM_CRC_REPLY: "MEM_CRC_REPLY",
}

# header flags
F_RETX = 0x01  # host: this is a retransmission; device: this reply comes from the reply cache
F_SPLIT_REPLY = 0x02  # host: send a reply longer than INLINE_REPLY_MAX as REPLY_HEAD + FETCH
INLINE_REPLY_MAX = 32  # largest reply payload sent inline to a request flagged F_SPLIT_REPLY

# ----------------------------------------------------------------- error codes (ERROR and NAK)
E_CRC = 1
E_FRAMING = 2
E_OVERSIZE = 3
E_UNKNOWN_TYPE = 4
E_BAD_LENGTH = 5
E_SESSION = 6
E_VERSION = 7
E_ADDRESS = 8
E_RUN = 9
E_STATE = 10
E_LOAD_CHECK = 11
E_BAD_INSTR = 12
E_INTERNAL = 13
E_FRAGMENT = 14
E_MSG_CRC = 15
E_REPLAY = 16
ERROR_NAMES = {
    E_CRC: "E_CRC", E_FRAMING: "E_FRAMING", E_OVERSIZE: "E_OVERSIZE", E_UNKNOWN_TYPE: "E_UNKNOWN_TYPE", E_BAD_LENGTH: "E_BAD_LENGTH",
    E_SESSION: "E_SESSION", E_VERSION: "E_VERSION", E_ADDRESS: "E_ADDRESS", E_RUN: "E_RUN", E_STATE: "E_STATE",
    E_LOAD_CHECK: "E_LOAD_CHECK", E_BAD_INSTR: "E_BAD_INSTR", E_INTERNAL: "E_INTERNAL", E_FRAGMENT: "E_FRAGMENT", E_MSG_CRC: "E_MSG_CRC",
    E_REPLAY: "E_REPLAY",
}

# readback element types
DT_U16 = 1
DT_F32 = 2
_DT = {DT_U16: np.dtype("<u2"), DT_F32: np.dtype("<f4")}


class ProtocolError(Exception):
    """A payload that does not parse."""


def _need(buf: bytes, n: int, what: str) -> None:
    if len(buf) != n:
        raise ProtocolError(f"{what} payload is {len(buf)} bytes, expected {n}")


# ----------------------------------------------------------------- HELLO
_HELLO = struct.Struct("<HHI")  # proto, isa, host nonce
_HELLO_R = struct.Struct("<HHIII")  # proto, isa, board nonce, max_payload, max_message


def pack_hello(host_nonce: int) -> bytes:
    return _HELLO.pack(PROTOCOL_VERSION, ISA_VERSION, host_nonce)


def unpack_hello(p: bytes) -> tuple[int, int, int]:
    _need(p, _HELLO.size, "HELLO")
    return _HELLO.unpack(p)


def pack_hello_reply(board_nonce: int, max_payload: int, max_message: int) -> bytes:
    return _HELLO_R.pack(PROTOCOL_VERSION, ISA_VERSION, board_nonce, max_payload, max_message)


def unpack_hello_reply(p: bytes) -> tuple[int, int, int, int, int]:
    """(protocol, isa, board nonce, max payload, max message)."""
    _need(p, _HELLO_R.size, "HELLO_REPLY")
    return _HELLO_R.unpack(p)


# ----------------------------------------------------------------- fragmentation (section 6)
_BEGIN = struct.Struct("<BxxxII")  # inner type, reserved, total bytes, crc32 of the whole
_OFF = struct.Struct("<I")  # MSG_DATA / REPLY_DATA offset
_ZERO = struct.Struct("<II")  # MSG_ZERO offset, count
_FETCH = struct.Struct("<II")  # offset, max bytes
_FACK = struct.Struct("<II")  # received, total
_RHEAD = struct.Struct("<BxxxII")  # reply type, reserved, total bytes, crc32
BEGIN_HEADER = _BEGIN.size  # 12
DATA_HEADER = _OFF.size  # 4


def pack_msg_begin(inner: int, total: int, crc: int, data: bytes = b"") -> bytes:
    return _BEGIN.pack(inner, total, crc) + data


def unpack_msg_begin(p: bytes) -> tuple[int, int, int, bytes]:
    """(inner type, total, crc, first data bytes)."""
    if len(p) < _BEGIN.size:
        raise ProtocolError(f"MSG_BEGIN payload is {len(p)} bytes, needs at least {_BEGIN.size}")
    return (*_BEGIN.unpack_from(p, 0), p[_BEGIN.size :])


def pack_msg_data(offset: int, data: bytes) -> bytes:
    return _OFF.pack(offset) + data


def unpack_msg_data(p: bytes) -> tuple[int, bytes]:
    if len(p) < _OFF.size + 1:
        raise ProtocolError(f"MSG_DATA payload is {len(p)} bytes, needs an offset and at least one data byte")
    return _OFF.unpack_from(p, 0)[0], p[_OFF.size :]


def pack_msg_zero(offset: int, count: int) -> bytes:
    return _ZERO.pack(offset, count)


def unpack_msg_zero(p: bytes) -> tuple[int, int]:
    _need(p, _ZERO.size, "MSG_ZERO")
    return _ZERO.unpack(p)


def pack_fetch(offset: int, max_bytes: int) -> bytes:
    return _FETCH.pack(offset, max_bytes)


def unpack_fetch(p: bytes) -> tuple[int, int]:
    _need(p, _FETCH.size, "FETCH")
    return _FETCH.unpack(p)


def pack_frag_ack(received: int, total: int, missing=()) -> bytes:
    """FRAG_ACK: ``u32 received, u32 total`` then ``u32 lo, u32 hi`` per listed missing range (MSG_QUERY replies)."""
    return _FACK.pack(received, total) + b"".join(_FACK.pack(lo, hi) for lo, hi in missing)


def unpack_frag_ack(p: bytes) -> tuple[int, int]:
    """(received, total) of a FRAG_ACK (any listed missing ranges are ignored)."""
    if len(p) < _FACK.size or (len(p) - _FACK.size) % _FACK.size:
        raise ProtocolError(f"FRAG_ACK payload is {len(p)} bytes, needs 8 + 8 per missing range")
    return _FACK.unpack_from(p, 0)


def unpack_frag_ack_missing(p: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(received, total, missing ranges [lo, hi)) of a FRAG_ACK; checks each range is non-empty, inside
    ``total`` and after the previous one (else ``ProtocolError``)."""
    rec, tot = unpack_frag_ack(p)
    out: list[tuple[int, int]] = []
    prev = 0
    for k in range(_FACK.size, len(p), _FACK.size):
        lo, hi = _FACK.unpack_from(p, k)
        if not prev <= lo < hi <= tot:
            raise ProtocolError(f"FRAG_ACK missing range [{lo}, {hi}) is empty, unordered or past the {tot}-byte message")
        out.append((lo, hi))
        prev = hi
    return rec, tot, out


_QUERY = struct.Struct("<IHxx")  # from byte, max ranges, reserved


def pack_msg_query(start: int = 0, max_ranges: int = 0) -> bytes:
    """MSG_QUERY payload: empty (no range list), or ``u32 from, u16 max_ranges, u16 reserved``."""
    return _QUERY.pack(start, max_ranges) if max_ranges else b""


def unpack_msg_query(p: bytes) -> tuple[int, int]:
    """(from, max_ranges); an empty payload is (0, 0)."""
    if not p:
        return 0, 0
    _need(p, _QUERY.size, "MSG_QUERY")
    return _QUERY.unpack(p)


def pack_reply_head(type_: int, total: int, crc: int) -> bytes:
    return _RHEAD.pack(type_, total, crc)


def unpack_reply_head(p: bytes) -> tuple[int, int, int]:
    _need(p, _RHEAD.size, "REPLY_HEAD")
    return _RHEAD.unpack(p)


def pack_reply_data(offset: int, data: bytes) -> bytes:
    return _OFF.pack(offset) + data


def unpack_reply_data(p: bytes) -> tuple[int, bytes]:
    if len(p) < _OFF.size + 1:
        raise ProtocolError(f"REPLY_DATA payload is {len(p)} bytes, needs an offset and at least one data byte")
    return _OFF.unpack_from(p, 0)[0], p[_OFF.size :]


# ----------------------------------------------------------------- memory
_U32 = struct.Struct("<I")
_MEM = struct.Struct("<II")  # row, offset (elements into the row image [ch][bank][col])
_RD = struct.Struct("<III")  # row, offset, count


def pack_write_mem(row: int, offset: int, data: bytes) -> bytes:
    return _MEM.pack(row, offset) + data


def unpack_write_mem(p: bytes) -> tuple[int, int, bytes]:
    if len(p) < _MEM.size + 2 or (len(p) - _MEM.size) % 2:
        raise ProtocolError(f"WRITE_MEM payload of {len(p)} bytes: needs 8 address bytes and a positive even number of data bytes")
    row, off = _MEM.unpack_from(p, 0)
    return row, off, p[_MEM.size :]


def pack_read_mem(row: int, offset: int, count: int) -> bytes:
    return _RD.pack(row, offset, count)


def unpack_read_mem(p: bytes) -> tuple[int, int, int]:
    _need(p, _RD.size, "READ_MEM")
    return _RD.unpack(p)


# RESET (section 4): empty payload = full reset; else flags, range count, ranges of rows to keep
RESET_KEEP_ROWS = 0x1  # RESET flag: keep the listed bank rows, zero every other row (GB, ACC, CFRs are cleared either way)
_RESET = struct.Struct("<II")  # flags, number of ranges
_RANGE = struct.Struct("<II")  # first row, row count
MAX_KEEP_RANGES = 4096  # most row ranges one RESET may list


def pack_reset(keep: list[tuple[int, int]] | None = None) -> bytes:
    """RESET payload: ``None`` -> empty (full reset); else RESET_KEEP_ROWS with the ``(row, count)`` ranges to keep."""
    if keep is None:
        return b""
    return _RESET.pack(RESET_KEEP_ROWS, len(keep)) + b"".join(_RANGE.pack(r, c) for r, c in keep)


def unpack_reset(p: bytes) -> list[tuple[int, int]] | None:
    """``None`` for a full reset, else the ``(row, count)`` ranges to keep (row bounds are the device's to check)."""
    if not p:
        return None
    if len(p) < _RESET.size:
        raise ProtocolError(f"RESET payload of {len(p)} bytes: empty, or 8 bytes of flags and range count plus 8 per range")
    flags, n = _RESET.unpack_from(p, 0)
    if flags != RESET_KEEP_ROWS:
        raise ProtocolError(f"RESET flags 0x{flags:x}: only RESET_KEEP_ROWS (0x1) is defined")
    if n > MAX_KEEP_RANGES:
        raise ProtocolError(f"RESET lists {n} row ranges, at most {MAX_KEEP_RANGES}")
    _need(p, _RESET.size + n * _RANGE.size, f"RESET with {n} ranges")
    return [_RANGE.unpack_from(p, _RESET.size + i * _RANGE.size) for i in range(n)]


_MCRC = struct.Struct("<II")  # first row, row count


def pack_mem_crc(row: int, count: int) -> bytes:
    return _MCRC.pack(row, count)


def unpack_mem_crc(p: bytes) -> tuple[int, int]:
    _need(p, _MCRC.size, "MEM_CRC")
    return _MCRC.unpack(p)


def pack_mem_crc_reply(crc: int) -> bytes:
    return _U32.pack(crc & 0xFFFFFFFF)


def unpack_mem_crc_reply(p: bytes) -> int:
    _need(p, 4, "MEM_CRC_REPLY")
    return _U32.unpack(p)[0]


_LOADP = struct.Struct("<II")  # rows that will be written (hint), reserved
_LOADE = struct.Struct("<QII")  # WRITE_MEM payload bytes since LOAD_PROGRAM, WRITE_MEM count, crc32 of those payloads


def pack_load_program(rows: int) -> bytes:
    return _LOADP.pack(rows, 0)


def unpack_load_program(p: bytes) -> int:
    _need(p, _LOADP.size, "LOAD_PROGRAM")
    return _LOADP.unpack(p)[0]


def pack_load_end(nbytes: int, nwrites: int, crc: int) -> bytes:
    return _LOADE.pack(nbytes, nwrites, crc)


def unpack_load_end(p: bytes) -> tuple[int, int, int]:
    _need(p, _LOADE.size, "LOAD_END")
    return _LOADE.unpack(p)


# ----------------------------------------------------------------- EXEC / READBACK
_RB = struct.Struct("<BxxxI")  # dtype, pad, element count


def payload_dtype(op: Op) -> np.dtype:
    """Element type of a data-in payload of ``op``."""
    return _DT[DT_F32] if op is Op.WR_ACC else _DT[DT_U16]


def exec_item_bytes(word_payload_nbytes: int) -> int:
    """Bytes one instruction takes in an EXEC payload."""
    return 4 + WORD_BYTES + 4 + word_payload_nbytes


def pack_exec(items: list[tuple[int, bytes, bytes]]) -> bytes:
    """``items`` = (instruction index, 16-byte word, payload bytes)."""
    parts = [_U32.pack(len(items))]
    for idx, word, pl in items:
        parts += [_U32.pack(idx), word, _U32.pack(len(pl)), pl]
    return b"".join(parts)


def unpack_exec(p: bytes) -> list[tuple[int, bytes, bytes]]:
    if len(p) < 4:
        raise ProtocolError("EXEC payload shorter than its count")
    (n,) = _U32.unpack_from(p, 0)
    if n > len(p) // (4 + WORD_BYTES + 4):
        raise ProtocolError(f"EXEC count {n} does not fit a {len(p)}-byte payload")
    pos = 4
    out = []
    for _ in range(n):
        if pos + 4 + WORD_BYTES + 4 > len(p):
            raise ProtocolError("EXEC payload truncated inside an instruction")
        (idx,) = _U32.unpack_from(p, pos)
        word = p[pos + 4 : pos + 4 + WORD_BYTES]
        (nb,) = _U32.unpack_from(p, pos + 4 + WORD_BYTES)
        pos += 4 + WORD_BYTES + 4
        if nb > len(p) - pos:
            raise ProtocolError(f"EXEC instruction {idx}: payload length {nb} runs past the end of the frame")
        out.append((idx, word, p[pos : pos + nb]))
        pos += nb
    if pos != len(p):
        raise ProtocolError(f"EXEC payload has {len(p) - pos} trailing bytes")
    return out


def readback_bytes(op: Op, n: int, lanes: int) -> int:
    """Bytes a data-out instruction adds to a READBACK payload."""
    return _RB.size + (4 * n if op is Op.RD_ACC else 2 * n * lanes)


def pack_readback(arrays: list[np.ndarray]) -> bytes:
    parts = [_U32.pack(len(arrays))]
    for a in arrays:
        dt = DT_F32 if a.dtype == np.float32 else DT_U16
        parts += [_RB.pack(dt, a.size), np.ascontiguousarray(a, dtype=_DT[dt]).tobytes()]
    return b"".join(parts)


def unpack_readback(p: bytes) -> list[np.ndarray]:
    if len(p) < 4:
        raise ProtocolError("READBACK payload shorter than its count")
    (n,) = _U32.unpack_from(p, 0)
    if n > len(p) // _RB.size:
        raise ProtocolError(f"READBACK count {n} does not fit a {len(p)}-byte payload")
    pos = 4
    out = []
    for _ in range(n):
        if pos + _RB.size > len(p):
            raise ProtocolError("READBACK truncated")
        dt, cnt = _RB.unpack_from(p, pos)
        pos += _RB.size
        if dt not in _DT:
            raise ProtocolError(f"READBACK element type {dt} unknown")
        nb = cnt * _DT[dt].itemsize
        if nb > len(p) - pos:
            raise ProtocolError("READBACK data runs past the end of the frame")
        a = np.frombuffer(p, dtype=_DT[dt], count=cnt, offset=pos).astype(np.float32 if dt == DT_F32 else np.uint16)
        out.append(a)
        pos += nb
    if pos != len(p):
        raise ProtocolError(f"READBACK has {len(p) - pos} trailing bytes")
    return out


# ----------------------------------------------------------------- STATUS / ERROR
STATUS_FIELDS = ("board_nonce", "state", "frames_ok", "frames_bad", "duplicates", "instructions", "last_error", "uptime_ms")
_STATUS = struct.Struct("<8I")
STATE_NAMES = {0: "idle", 1: "loading", 2: "loaded"}


def pack_status(values: dict) -> bytes:
    return _STATUS.pack(*(int(values[k]) & 0xFFFFFFFF for k in STATUS_FIELDS))


def unpack_status(p: bytes) -> dict:
    _need(p, _STATUS.size, "STATUS_REPLY")
    return dict(zip(STATUS_FIELDS, _STATUS.unpack(p)))


_ERR = struct.Struct("<HH")  # code, reserved


def pack_error(code: int, message: str) -> bytes:
    return _ERR.pack(code, 0) + message.encode("utf-8", "replace")[:1024]


def unpack_error(p: bytes) -> tuple[int, str]:
    if len(p) < _ERR.size:
        return E_INTERNAL, "(malformed ERROR payload)"
    code, _ = _ERR.unpack_from(p, 0)
    return code, p[_ERR.size :].decode("utf-8", "replace")


def data_out_ops() -> frozenset[Op]:
    return frozenset(o for o, i in OPINFO.items() if i.data_out)
