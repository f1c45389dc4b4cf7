"""Message fragmentation of link protocol v2 (``docs/link-protocol.md`` section 6).

A request too large for one frame on a noisy line travels as a *message*: MSG_BEGIN
(inner type, total length, CRC-32 of the whole, first bytes), then MSG_DATA (bytes at an
offset) and MSG_ZERO (a run of zero bytes at an offset) fragments, strictly in order.
The device keeps one reassembly buffer (:class:`Reassembler`): a fragment must start
exactly where the received bytes end and must not run past the announced total; anything
else is refused (``ReassemblyError``, sent as ``ERROR E_FRAGMENT``) and changes nothing.
When the last byte arrives the whole is checked against the CRC and executed as if it
had come in one frame. Because fragments are accepted only in order, the device needs
one counter and a running CRC, no bitmap; every fragment reply says how many bytes the
device holds, so a host whose acknowledgement was lost learns where to continue.

Large replies travel the other way through a :class:`ReplyBuffer` the host reads with
FETCH (offset, max bytes); FETCH is read-only, so it may be repeated freely.

:func:`plan_fragment` is the host's splitter: which fragment to send next for a given
position and size budget, sending zero runs as MSG_ZERO.
"""

from __future__ import annotations

import numpy as np

from nhil.targets.fpga.frame import crc32

ZERO_RUN_MIN = 24  # zero runs at least this long go as MSG_ZERO (8 payload bytes instead of n)


class ReassemblyError(Exception):
    """A fragment the device refuses; ``code`` is the protocol error code (E_FRAGMENT or E_MSG_CRC)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


E_FRAGMENT = 14
E_MSG_CRC = 15


class Reassembler:
    """Device-side reassembly of one message at a time (bounded by ``max_message`` bytes).

    ``begin``/``data``/``zero`` return ``None`` while bytes are missing and
    ``(inner_type, payload)`` when the message is complete and its CRC matches; they raise
    :class:`ReassemblyError` (state unchanged) for a fragment that is out of order,
    duplicated, overlapping, out of range, or when no message is open. A complete message
    whose CRC differs raises ``E_MSG_CRC`` and is discarded.
    """

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self.clear()

    def clear(self) -> None:
        self.open = False
        self.inner = 0
        self.total = 0
        self.crc = 0
        self.received = 0
        self.run_crc = 0
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
        return self._append(data)

    def _check(self, offset: int, n: int, what: str) -> None:
        if not self.open:
            raise ReassemblyError(E_FRAGMENT, f"{what} at offset {offset} but no message is open (MSG_BEGIN first)")
        if n < 1:
            raise ReassemblyError(E_FRAGMENT, f"{what} at offset {offset} is empty")
        # short texts: after a lost fragment every later one of a burst is refused, and these replies cross a noisy line
        if offset != self.received:
            kind = "overlap" if offset < self.received else "out of order"
            raise ReassemblyError(E_FRAGMENT, f"{what} @{offset}: {kind}, expected @{self.received}")
        if n > self.total - offset:
            raise ReassemblyError(E_FRAGMENT, f"{what} [{offset},{offset + n}) past end {self.total}")

    def data(self, offset: int, data: bytes) -> tuple[int, bytes] | None:
        self._check(offset, len(data), "MSG_DATA")
        return self._append(data)

    def zero(self, offset: int, count: int) -> tuple[int, bytes] | None:
        self._check(offset, count, "MSG_ZERO")
        self.run_crc = crc32(bytes(count), self.run_crc)  # buffer is already zero there
        self.received += count
        return self._finish()

    def _append(self, data: bytes) -> tuple[int, bytes] | None:
        n = len(data)
        self.buf[self.received : self.received + n] = data
        self.run_crc = crc32(data, self.run_crc)
        self.received += n
        return self._finish()

    def _finish(self) -> tuple[int, bytes] | None:
        if self.received < self.total:
            return None
        inner, payload, ok, got, want = self.inner, bytes(self.buf), self.run_crc == self.crc, self.run_crc, self.crc
        self.clear()
        if not ok:
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


def zero_runs(data: bytes, min_run: int = ZERO_RUN_MIN) -> np.ndarray:
    """Start/end pairs ``int64 [k, 2]`` of the runs of at least ``min_run`` zero bytes in ``data``, in order."""
    a = np.frombuffer(data, np.uint8)
    if a.size == 0:
        return np.zeros((0, 2), np.int64)
    z = np.concatenate(([0], (a == 0).view(np.int8), [0]))
    d = np.diff(z)
    starts = np.flatnonzero(d == 1)
    ends = np.flatnonzero(d == -1)
    keep = ends - starts >= min_run
    return np.stack([starts[keep], ends[keep]], axis=1).astype(np.int64)


def plan_fragment(total: int, runs: np.ndarray, pos: int, budget: int) -> tuple[str, int, int]:
    """Next fragment of a ``total``-byte message whose zero runs are ``runs``, from byte ``pos``.

    Returns ``("zero", pos, end)`` when ``pos`` lies in a zero run (the rest of that run), else
    ``("data", pos, end)`` with at most ``budget`` bytes, stopping before the next zero run.
    """
    if runs.size:
        i = int(np.searchsorted(runs[:, 1], pos, side="right"))  # first run ending after pos
        if i < len(runs):
            s, e = int(runs[i, 0]), int(runs[i, 1])
            if s <= pos:
                return "zero", pos, e
            return "data", pos, min(total, pos + max(1, budget), s)
    return "data", pos, min(total, pos + max(1, budget))
