"""Frame codec of the FPGA serial link: SLIP-style byte stuffing, 12-byte header, CRC-32.

Wire format (``docs/link-protocol.md`` section 2)::

    END | escape( header(12) | payload(length) | crc32(4) ) | END

* ``END = 0xC0``; inside a frame ``0xC0 -> 0xDB 0xDC`` and ``0xDB -> 0xDB 0xDD``
  (RFC 1055 SLIP). No other byte is escaped.
* header, little-endian: ``type u8, flags u8, seq u16, nonce u32, length u32``.
* CRC-32 of zlib / IEEE 802.3 (polynomial 0x04C11DB7, reflected in and out, init
  0xFFFFFFFF, xorout 0xFFFFFFFF; check value of ``b"123456789"`` = 0xCBF43926) over the
  unescaped header and payload, stored little-endian.

*Short frames* (``docs/link-protocol.md`` section 12) use the same stuffing and CRC but no
header: ``type(1) | fields | data | crc32(4)`` with ``type`` in ``SHORT_TYPES`` (0x40-0x4F);
their fields are parsed by ``nhil.targets.fpga.stream``.

The :class:`Deframer` is a streaming decoder that never raises on input: it returns
:class:`Frame` for a frame whose CRC, escapes and length are all valid, :class:`Short`
for a valid short frame, and :class:`Bad` for everything else (with the reason and, when
the CRC was valid, the header's seq so the receiver can answer with an ERROR).
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

END = 0xC0
ESC = 0xDB
ESC_END = 0xDC
ESC_ESC = 0xDD
_END_B = bytes([END])
_ESC_B = bytes([ESC])
_ESC_END_SEQ = bytes([ESC, ESC_END])
_ESC_ESC_SEQ = bytes([ESC, ESC_ESC])

HEADER = struct.Struct("<BBHII")  # type, flags, seq, nonce, length
HEADER_BYTES = HEADER.size  # 12
CRC_BYTES = 4
OVERHEAD = HEADER_BYTES + CRC_BYTES  # bytes per frame besides payload (plus 2 END and escapes)
SHORT_TYPES = range(0x40, 0x50)  # first byte of a short frame (no header; section 12)
SHORT_MIN = 1 + 2 + CRC_BYTES  # smallest short frame body: type, a 16-bit field, CRC
DEFAULT_MAX_PAYLOAD = 65536 + 256

# reasons a received byte run is not a frame (also the NAK reason codes, see protocol.E_*)
BAD_CRC = 1
BAD_FRAMING = 2  # invalid escape sequence, or shorter than header + CRC
BAD_OVERSIZE = 3  # more than max_payload + 16 bytes before the next END
BAD_LENGTH = 5  # CRC valid but the header length disagrees with the frame size


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib CRC-32 (see module docstring)."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


class Frame(NamedTuple):
    """A valid frame."""

    type: int
    flags: int
    seq: int
    nonce: int
    payload: bytes


class Short(NamedTuple):
    """A valid short frame: ``type`` and the bytes between it and the CRC (see ``stream.py``)."""

    type: int
    body: bytes


class Bad(NamedTuple):
    """A rejected byte run: ``reason`` (BAD_*), its wire size, and header fields when the CRC was valid."""

    reason: int
    nbytes: int
    type: int | None = None
    seq: int | None = None
    nonce: int | None = None


def escape(body: bytes) -> bytes:
    """Byte-stuff ``body`` (ESC first, then END)."""
    return body.replace(_ESC_B, _ESC_ESC_SEQ).replace(_END_B, _ESC_END_SEQ)


def unescape(wire: bytes) -> bytes | None:
    """Inverse of :func:`escape`; ``None`` when an escape is invalid (ESC followed by anything but DC/DD, or at the end)."""
    n_esc = wire.count(_ESC_B)
    if n_esc == 0:
        return wire
    if n_esc != wire.count(_ESC_END_SEQ) + wire.count(_ESC_ESC_SEQ):
        return None
    # every ESC starts a pair, and the escaped byte is never ESC, so pairs cannot overlap
    return wire.replace(_ESC_END_SEQ, _END_B).replace(_ESC_ESC_SEQ, _ESC_B)


def encode_body(type_: int, flags: int, seq: int, nonce: int, payload: bytes = b"") -> bytes:
    """Unescaped frame body: header + payload + CRC."""
    head = HEADER.pack(type_ & 0xFF, flags & 0xFF, seq & 0xFFFF, nonce & 0xFFFFFFFF, len(payload))
    c = crc32(payload, crc32(head))
    return b"".join((head, payload, c.to_bytes(4, "little")))


def encode_frame(type_: int, flags: int, seq: int, nonce: int, payload: bytes = b"") -> bytes:
    """Complete wire frame (leading and trailing END)."""
    return b"".join((_END_B, escape(encode_body(type_, flags, seq, nonce, payload)), _END_B))


def encode_short(type_: int, body: bytes) -> bytes:
    """Wire bytes of a short frame, without the leading END (frames sent back to back share one END):
    ``escape(type | body | crc32) END``."""
    head = bytes((type_,)) + body
    return escape(head + crc32(head).to_bytes(4, "little")) + _END_B


def decode_body(body: bytes, max_payload: int) -> Frame | Short | Bad:
    """Check and parse one unescaped body."""
    n = len(body)
    short = n > 0 and body[0] in SHORT_TYPES
    if n < (SHORT_MIN if short else OVERHEAD):
        return Bad(BAD_FRAMING, n)
    if n > max_payload + OVERHEAD:
        return Bad(BAD_OVERSIZE, n)
    if crc32(memoryview(body)[:-CRC_BYTES]) != int.from_bytes(body[-CRC_BYTES:], "little"):
        return Bad(BAD_CRC, n)
    if short:
        return Short(body[0], bytes(body[1:-CRC_BYTES]))
    t, fl, seq, nonce, length = HEADER.unpack_from(body, 0)
    if length != n - OVERHEAD:
        return Bad(BAD_LENGTH, n, t, seq, nonce)
    return Frame(t, fl, seq, nonce, bytes(body[HEADER_BYTES:-CRC_BYTES]))


class Deframer:
    """Streaming decoder: ``feed(bytes) -> list[Frame | Bad]``; bounded memory, never raises.

    Bytes before the first END, and empty runs between two ENDs, are ignored (an END
    pair is how a sender flushes a half-received frame on the other side). A run longer
    than ``max_payload + 16`` unescaped bytes is dropped up to the next END and reported
    once as ``BAD_OVERSIZE``.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self.max_wire = 2 * (max_payload + OVERHEAD)  # every byte escaped
        self.buf = bytearray()
        self.skipping = False  # inside an oversized run: drop until END
        self.synced = False  # seen an END since start (bytes before it are line noise)
        self.discarded = 0  # bytes dropped outside frames (noise before the first END)

    def feed(self, data: bytes) -> list[Frame | Short | Bad]:
        out: list[Frame | Short | Bad] = []
        if not data:
            return out
        buf = self.buf
        buf += data
        start = 0
        while True:
            i = buf.find(END, start)
            if i < 0:
                break
            run = bytes(buf[start:i])
            start = i + 1
            if not self.synced:
                self.synced = True
                self.discarded += len(run)
                continue
            if self.skipping:
                self.skipping = False
                continue
            if not run:
                continue
            if len(run) > self.max_wire:
                out.append(Bad(BAD_OVERSIZE, len(run)))
                continue
            body = unescape(run)
            out.append(Bad(BAD_FRAMING, len(run)) if body is None else decode_body(body, self.max_payload))
        del buf[:start]
        if len(buf) > self.max_wire:
            if not self.synced:
                self.discarded += len(buf)
            elif not self.skipping:
                out.append(Bad(BAD_OVERSIZE, len(buf)))
                self.skipping = True
            buf.clear()
        return out
