"""Message fragmentation of link protocol v2 (``docs/link-protocol.md`` section 6).

A request too large for one frame on a noisy line travels as a *message*: MSG_BEGIN
(inner type, total length, CRC-32 of the whole, first bytes), then MSG_DATA (bytes at an
offset) and MSG_ZERO (a run of zero bytes at an offset) fragments, **in any order**
(selective repeat). The device keeps one reassembly buffer (:class:`Reassembler`) and the
sorted set of byte ranges it holds: a fragment must lie inside the announced total and must
not overlap held bytes, except that a fragment whose bytes are all held already with the
same values (an exact duplicate) is an idempotent no-op; anything else is refused
(``ReassemblyError``, sent as ``ERROR E_FRAGMENT``) and changes nothing. When the last byte
arrives the whole is checked against the CRC and executed as if it had come in one frame.
MSG_QUERY asks for the missing ranges (:meth:`Reassembler.missing`, a bounded list), so a
host streams many fragments without waiting and resends only what is missing.

Large replies travel the other way through a :class:`ReplyBuffer` the host reads with
FETCH (offset, max bytes); FETCH is read-only, so it may be repeated freely.

The host's side of the bulk path (short frames, section 12) is ``bulk.py`` and ``stream.py``.
"""

from __future__ import annotations

import bisect


from nhil.targets.fpga.frame import crc32

MAX_RANGES = 1024  # most disjoint received ranges the board keeps per message (a fragment adding one more is refused)
QUERY_MAX_RANGES = 64  # most missing ranges one FRAG_ACK lists


class ReassemblyError(Exception):
    """A fragment the device refuses; ``code`` is the protocol error code (E_FRAGMENT or E_MSG_CRC)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


E_FRAGMENT = 14
E_MSG_CRC = 15


class Reassembler:
    """Device-side reassembly of one message at a time (bounded by ``max_message`` bytes), fragments in any order.

    The state is the buffer, the sorted list of disjoint received byte ranges (merged when they
    touch, at most ``max_ranges``) and their byte count ``received``. ``begin``/``data``/``zero``
    return ``None`` while bytes are missing and ``(inner_type, payload)`` when the message is
    complete and its CRC-32 matches. A fragment whose bytes are all held already and equal to
    them (an exact duplicate) is a no-op. They raise :class:`ReassemblyError` ``E_FRAGMENT``
    (state unchanged) for a fragment that is empty, out of range, overlaps held bytes only
    partly or with other values, would need more than ``max_ranges`` ranges, or when no message
    is open. A complete message whose CRC differs raises ``E_MSG_CRC`` and is discarded.
    """

    def __init__(self, max_message: int, max_ranges: int = MAX_RANGES) -> None:
        self.max_message = max_message
        self.max_ranges = max_ranges
        self.version = 0  # changes with every change of state (caches key on it)
        self.clear()

    def clear(self) -> None:
        self.version += 1
        self.open = False
        self.inner = 0
        self.total = 0
        self.crc = 0
        self.received = 0
        self.starts: list[int] = []  # received ranges [starts[i], ends[i]), sorted, disjoint, not touching
        self.ends: list[int] = []
        self.buf = bytearray()

    def begin(self, inner: int, total: int, crc: int, data: bytes) -> tuple[int, bytes] | None:
        """Open a new message (discarding any partial one) and take its first ``data`` bytes."""
        if total > self.max_message:
            raise ReassemblyError(E_FRAGMENT, f"message of {total} bytes exceeds the board's max message {self.max_message}")
        if len(data) > total:
            raise ReassemblyError(E_FRAGMENT, f"MSG_BEGIN carries {len(data)} bytes of a {total}-byte message")
        self.clear()
        self.open, self.inner, self.total, self.crc = True, inner, total, crc
        self.buf = bytearray(total)
        if data:
            self._take(0, data)
        return self._finish()

    def data(self, offset: int, data: bytes, complete: bool = True) -> tuple[int, bytes] | None:
        """Take MSG_DATA ``data`` at byte ``offset``; ``complete=False`` (short frames, which get no reply) refuses a
        fragment that would complete the message."""
        if self._check(offset, len(data), data, "MSG_DATA", complete):
            self._take(offset, data)
        return self._finish()

    def zero(self, offset: int, count: int, complete: bool = True) -> tuple[int, bytes] | None:
        """Take MSG_ZERO: ``count`` zero bytes at byte ``offset`` (``complete`` as for :meth:`data`)."""
        if self._check(offset, count, None, "MSG_ZERO", complete):
            self._take(offset, bytes(count))
        return self._finish()

    def held(self, lo: int, hi: int) -> bool:
        """Whether every byte of ``[lo, hi)`` (non-empty) of the open message is held."""
        i = bisect.bisect_right(self.ends, lo)
        return self.open and lo < hi and i < len(self.starts) and self.starts[i] <= lo and hi <= self.ends[i]

    def _check(self, offset: int, n: int, data: bytes | None, what: str, complete: bool = True) -> bool:
        """Validate a fragment; ``True`` when it brings new bytes, ``False`` for an exact duplicate."""
        if not self.open:
            raise ReassemblyError(E_FRAGMENT, f"{what} at offset {offset} but no message is open (MSG_BEGIN first)")
        if n < 1:
            raise ReassemblyError(E_FRAGMENT, f"{what} at offset {offset} is empty")
        if offset > self.total or n > self.total - offset:
            raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{offset + n}) past end {self.total}")
        end = offset + n
        i = bisect.bisect_right(self.ends, offset)  # first range ending after offset
        if i < len(self.starts) and self.starts[i] < end:  # touches held bytes
            if self.starts[i] <= offset and end <= self.ends[i]:
                held = bytes(self.buf[offset:end])
                if held == (data if data is not None else bytes(n)):
                    return False  # exact duplicate: idempotent
                raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{end}) differs from the bytes held there")
            raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{end}) overlaps held [{self.starts[i]},{self.ends[i]})")
        if not complete and self.received + n == self.total:
            raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{end}) would complete the message, which only a fragment with a reply may do")
        joins = (i > 0 and self.ends[i - 1] == offset) + (i < len(self.starts) and self.starts[i] == end)
        if joins == 0 and len(self.starts) >= self.max_ranges:
            raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{end}) would make {len(self.starts) + 1} received ranges, over {self.max_ranges}")
        return True

    def _take(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        self.buf[offset:end] = data
        self.received += len(data)
        self.version += 1
        i = bisect.bisect_right(self.ends, offset)
        left = i > 0 and self.ends[i - 1] == offset
        right = i < len(self.starts) and self.starts[i] == end
        if left and right:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif left:
            self.ends[i - 1] = end
        elif right:
            self.starts[i] = offset
        else:
            self.starts.insert(i, offset)
            self.ends.insert(i, end)

    def missing(self, start: int = 0, limit: int = QUERY_MAX_RANGES) -> list[tuple[int, int]]:
        """The first ``limit`` byte ranges ``[lo, hi)`` of the open message not yet received, from byte ``start`` on
        (a range containing ``start`` is clipped to begin there); all of them when fewer than ``limit``."""
        out: list[tuple[int, int]] = []
        if not self.open or limit < 1:
            return out
        pos = start
        i = bisect.bisect_right(self.ends, pos)
        while pos < self.total and len(out) < limit:
            if i < len(self.starts) and self.starts[i] <= pos:
                pos = self.ends[i]
                i += 1
                continue
            hi = self.starts[i] if i < len(self.starts) else self.total
            out.append((pos, hi))
            pos = hi
        return out

    def _finish(self) -> tuple[int, bytes] | None:
        if self.received < self.total:
            return None
        inner, payload, want = self.inner, bytes(self.buf), self.crc
        self.clear()
        got = crc32(payload)
        if got != want:
            raise ReassemblyError(E_MSG_CRC, f"reassembled message CRC 0x{got:08x} differs from the announced 0x{want:08x}; message discarded")
        return inner, payload


class ReplyBuffer:
    """The last reply the device sent as REPLY_HEAD: type, bytes and CRC, read in pieces by FETCH."""

    def __init__(self) -> None:
        self.type: int | None = None
        self.data = b""
        self.crc = 0

    def set(self, type_: int, data: bytes) -> None:
        self.type, self.data, self.crc = type_, data, crc32(data)

    def fetch(self, offset: int, max_bytes: int) -> bytes:
        """Bytes ``[offset, offset + max_bytes)`` (clipped to the end).

        Raises:
            ReassemblyError: no reply buffered, ``max_bytes`` zero, or ``offset`` past the end.
        """
        if self.type is None:
            raise ReassemblyError(E_FRAGMENT, "FETCH but no reply is buffered")
        if max_bytes < 1 or offset >= len(self.data):
            raise ReassemblyError(E_FRAGMENT, f"FETCH [{offset}, +{max_bytes}) outside the {len(self.data)}-byte reply")
        return self.data[offset : offset + max_bytes]
