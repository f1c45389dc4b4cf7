"""Short frames of link protocol v2 (``docs/link-protocol.md`` section 12): bulk data without a reply per frame.

On a line that damages 1-3% of its bytes a frame survives with probability ``(1-p)^L``, so
what limits the goodput is the bytes a frame spends besides its data. A regular frame spends
23 (12-byte header, CRC, END bytes, a 4-byte offset) and every fragment gets a reply of 27
more. A short frame has no header: ``type | fields | data | crc32`` with 10 bytes of
overhead besides its data and one END, and no reply. The fields name the message (or
buffered reply) by a 16-bit *tag*, the low half of its CRC-32; the whole is still checked
against that CRC-32 before it is used, so a short frame that reaches the wrong message can
at worst make it fail that check and be sent again.

Types (``u24`` = 3-byte little-endian; ``cells`` = ``1 << log2cell`` bytes each):

==========  ====  =========  ==============================================================
name        type  direction  fields after the type byte
==========  ====  =========  ==============================================================
S_DATA      0x40  host>board ``u16 tag, u24 offset, data[k >= 1]``
S_ZERO      0x41  host>board ``u16 tag, u24 offset, u24 count >= 1`` (count zero bytes)
S_QUERY     0x42  host>board ``u16 tag, u16 qid, u24 offset, u8 log2cell, u8 ncells (1..64)``
S_BITMAP    0x43  board>host ``u16 qid, u8 status, bits[ceil(ncells / 8)]``
S_FETCH     0x44  host>board ``u16 tag, u16 qid, u24 offset, u8 log2cell, u8 ncells, want[ceil(ncells / 8)]``
S_REPLY     0x45  board>host ``u16 tag, u24 offset, data[k >= 1]``
S_DONE      0x46  board>host ``u16 qid, u8 status, u8 sent``
S_PING      0x47  host>board ``u16 qid``
S_PONG      0x48  board>host ``u16 qid``
==========  ====  =========  ==============================================================

A burst of short frames ends with a few copies of S_PING: the board answers in order, so the
first S_PONG means every answer to the burst has been sent (8-byte frames: the likeliest to
survive). S_PING/S_PONG need a session but no open message.

Bit ``i`` of a bitmap (LSB first, byte ``i // 8``) is cell ``i``: bytes
``[offset + i * cell, min(offset + (i + 1) * cell, total))``. ``status`` 0: the message / reply with
that tag is there; 1: it is not (no bits set, nothing sent).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from nhil.targets.fpga.frame import encode_short

S_DATA = 0x40
S_ZERO = 0x41
S_QUERY = 0x42
S_BITMAP = 0x43
S_FETCH = 0x44
S_REPLY = 0x45
S_DONE = 0x46
S_PING = 0x47
S_PONG = 0x48
HOST_SHORT = {S_DATA, S_ZERO, S_QUERY, S_FETCH, S_PING}  # the short frames a board takes
SHORT_NAMES = {S_DATA: "S_DATA", S_ZERO: "S_ZERO", S_QUERY: "S_QUERY", S_BITMAP: "S_BITMAP", S_FETCH: "S_FETCH", S_REPLY: "S_REPLY", S_DONE: "S_DONE",
               S_PING: "S_PING", S_PONG: "S_PONG"}

MAX_CELLS = 64  # cells per S_QUERY / S_FETCH (an 8-byte bitmap: short enough to survive a noisy line)
MAX_OFFSET = (1 << 24) - 1  # short frames address the first 16 MiB of a message or reply
ST_OK, ST_GONE = 0, 1
SHORT_OVERHEAD = 1 + 2 + 3 + 4 + 1  # type, tag, offset, CRC, one END: wire bytes of an S_DATA besides its data

_TQ = struct.Struct("<HH")  # tag, qid
_QD = struct.Struct("<HBB")  # qid, status, sent / (qid, status) + bits


class ShortError(Exception):
    """A short frame whose fields do not parse (the receiver drops it: short frames get no ERROR)."""


def tag_of(crc: int) -> int:
    """Tag of a message or buffered reply: the low 16 bits of its CRC-32."""
    return crc & 0xFFFF


def _u24(x: int) -> bytes:
    if not 0 <= x <= MAX_OFFSET:
        raise ValueError(f"short-frame field {x} does not fit 24 bits")
    return x.to_bytes(3, "little")


def _nbits(n: int) -> int:
    return (n + 7) // 8


# ------------------------------------------------------------------ encoders (wire bytes, END-terminated)
def s_data(tag: int, offset: int, data: bytes, type_: int = S_DATA) -> bytes:
    """S_DATA (or, with ``type_=S_REPLY``, S_REPLY) carrying ``data`` at byte ``offset``."""
    return encode_short(type_, tag.to_bytes(2, "little") + _u24(offset) + data)


def s_zero(tag: int, offset: int, count: int) -> bytes:
    return encode_short(S_ZERO, tag.to_bytes(2, "little") + _u24(offset) + _u24(count))


def s_query(tag: int, qid: int, offset: int, log2cell: int, ncells: int) -> bytes:
    return encode_short(S_QUERY, _TQ.pack(tag, qid) + _u24(offset) + bytes((log2cell, ncells)))


def s_fetch(tag: int, qid: int, offset: int, log2cell: int, ncells: int, want: bytes) -> bytes:
    return encode_short(S_FETCH, _TQ.pack(tag, qid) + _u24(offset) + bytes((log2cell, ncells)) + want)


def s_bitmap(qid: int, status: int, bits: bytes) -> bytes:
    return encode_short(S_BITMAP, qid.to_bytes(2, "little") + bytes((status,)) + bits)


def s_done(qid: int, status: int, sent: int) -> bytes:
    return encode_short(S_DONE, _QD.pack(qid, status, min(sent, 255)))


def s_ping(qid: int, type_: int = S_PING) -> bytes:
    """S_PING (or, with ``type_=S_PONG``, its answer)."""
    return encode_short(type_, qid.to_bytes(2, "little"))


class Ping(NamedTuple):
    qid: int


def bits_of(flags: list[bool]) -> bytes:
    """Pack booleans LSB first."""
    out = bytearray(_nbits(len(flags)))
    for i, f in enumerate(flags):
        if f:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def bit(bits: bytes, i: int) -> bool:
    return bool(bits[i >> 3] >> (i & 7) & 1)


def grid_cuts(a: int, e: int, g: int) -> list[int]:
    """Starts of the pieces of ``[a, e)`` cut at the multiples of ``g``."""
    return [a, *range((a // g + 1) * g, e, g)]


def spans(cells: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(first cell, count <= MAX_CELLS)`` query spans covering the inclusive cell ranges ``cells`` (ascending)."""
    out: list[tuple[int, int]] = []
    end = -1  # first cell not covered yet
    for c0, c1 in cells:
        while c1 >= end:
            start = max(c0, end)
            out.append((start, MAX_CELLS))
            end = start + MAX_CELLS
    if out:  # trim the last span to the cells it needs
        c0, _ = out[-1]
        out[-1] = (c0, max(c1 for _, c1 in cells if c1 >= c0) - c0 + 1)
    return out


# ------------------------------------------------------------------ decoders (body = bytes between type and CRC)
class Data(NamedTuple):
    tag: int
    offset: int
    data: bytes


class Zero(NamedTuple):
    tag: int
    offset: int
    count: int


class Cells(NamedTuple):
    """S_QUERY / S_FETCH: ``want`` is empty for S_QUERY."""

    tag: int
    qid: int
    offset: int
    log2cell: int
    ncells: int
    want: bytes


class Bitmap(NamedTuple):
    qid: int
    status: int
    bits: bytes


class Done(NamedTuple):
    qid: int
    status: int
    sent: int


def parse(type_: int, body: bytes):
    """Fields of a short frame (``Data``, ``Zero``, ``Cells``, ``Bitmap``, ``Done`` or ``Ping``).

    Raises:
        ShortError: unknown type, wrong length, empty data, a cell count outside 1..64 or a cell over 64 KiB.
    """
    n = len(body)
    if type_ in (S_DATA, S_REPLY):
        if n < 6:
            raise ShortError(f"{SHORT_NAMES[type_]} of {n} bytes: needs tag, offset and at least one data byte")
        return Data(int.from_bytes(body[:2], "little"), int.from_bytes(body[2:5], "little"), body[5:])
    if type_ == S_ZERO:
        if n != 8:
            raise ShortError(f"S_ZERO of {n} bytes, expected 8")
        z = Zero(int.from_bytes(body[:2], "little"), int.from_bytes(body[2:5], "little"), int.from_bytes(body[5:8], "little"))
        if z.count < 1:
            raise ShortError("S_ZERO of 0 bytes")
        return z
    if type_ in (S_QUERY, S_FETCH):
        if n < 9:
            raise ShortError(f"{SHORT_NAMES[type_]} of {n} bytes, needs at least 9")
        tag, qid = _TQ.unpack_from(body, 0)
        log2, nc = body[7], body[8]
        if not 1 <= nc <= MAX_CELLS or log2 > 16:
            raise ShortError(f"{SHORT_NAMES[type_]} asks for {nc} cells of 2^{log2} bytes (1..{MAX_CELLS} cells of at most 64 KiB)")
        want = body[9:]
        if len(want) != (_nbits(nc) if type_ == S_FETCH else 0):
            raise ShortError(f"{SHORT_NAMES[type_]} of {n} bytes for {nc} cells")
        return Cells(tag, qid, int.from_bytes(body[4:7], "little"), log2, nc, want)
    if type_ == S_BITMAP:
        if n < 3:
            raise ShortError(f"S_BITMAP of {n} bytes")
        return Bitmap(int.from_bytes(body[:2], "little"), body[2], body[3:])
    if type_ == S_DONE:
        if n != 4:
            raise ShortError(f"S_DONE of {n} bytes, expected 4")
        return Done(*_QD.unpack(body))
    if type_ in (S_PING, S_PONG):
        if n != 2:
            raise ShortError(f"{SHORT_NAMES[type_]} of {n} bytes, expected 2")
        return Ping(int.from_bytes(body, "little"))
    raise ShortError(f"unknown short frame type 0x{type_:02x}")

