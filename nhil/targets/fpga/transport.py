"""Transports of the FPGA link: the only code of the host side that touches a port.

A :class:`Transport` moves bytes and knows nothing of frames: ``write(data)`` sends all of
``data``, ``read(timeout)`` returns the bytes that arrived (``b""`` when none came within
``timeout`` seconds), ``close()`` lets go of the port. The session (``session.py``) frames,
retransmits and times out on top of it. Two kinds:

* :class:`SerialTransport` (:func:`open_serial`): any pyserial URL, the board's serial
  device (``/dev/ttyUSB0``), the emulator's pseudo-terminal, ``socket://host:port`` (the
  emulator's TCP mode, ``nhil fpga-emu --tcp``), ``rfc2217://host:port``, ``loop://``;
* :class:`MemoryTransport` (:func:`memory_pair`): two connected ends in memory, for tests.
  An end with a handler (:meth:`MemoryTransport.serve`, e.g. the emulator's
  ``Board.on_bytes``) answers inside the other end's ``write``: no thread, no socket.

Errors: :class:`~nhil.targets.fpga.errors.TransportError` naming the URL. A
:class:`~nhil.errors.NhilError` raised inside a read or write (verify's stage timeout,
a signal handler) passes through unchanged, so its outcome stays ``TIMEOUT``.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable

from nhil.errors import NhilError, SetupError
from nhil.targets.fpga.errors import TransportError

WRITE_CHUNK = 16384  # bytes per os.write while draining the receive side
POLL_S = 0.02  # longest single wait of a serial read (pyserial's timeout, select's cap)


class Transport:
    """Bytes to and from a board. ``url`` names the port in messages."""

    url: str = ""

    def write(self, data: bytes) -> None:
        """Send all of ``data``.

        Raises:
            TransportError: the port failed or did not take the bytes in time.
        """
        raise NotImplementedError

    def read(self, timeout: float) -> bytes:
        """The bytes received so far, waiting up to ``timeout`` seconds for the first; ``b""`` if none came.

        Raises:
            TransportError: the port failed.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Let go of the port (never raises)."""


class SerialTransport(Transport):
    """A pyserial port (already open).

    Args:
        ser: the ``serial.Serial`` (or URL handler) object, opened with a read timeout of ``POLL_S``.
        url: its URL, for messages.
        write_timeout: seconds a write may take before it fails.
    """

    def __init__(self, ser, url: str, write_timeout: float = 10.0) -> None:
        self._ser = ser
        self.url = url
        self.write_timeout = write_timeout
        self._pending = bytearray()  # bytes read while a write waited for the port
        try:  # a selectable descriptor (device, pty, socket://) lets read wait exactly until its timeout
            self._fd = ser.fileno() if hasattr(ser, "fileno") else None
        except Exception:
            self._fd = None

    def write(self, data: bytes) -> None:
        """Write ``data``, reading whatever arrives meanwhile (kept for the next :meth:`read`): a board answering a
        long burst fills the line back to us while we still write, and if neither side read, both would block."""
        try:
            if self._fd is None:
                self._ser.write(data)
                return
            mv = memoryview(data)
            deadline = time.monotonic() + self.write_timeout
            while mv:
                r, w, _ = select.select([self._fd], [self._fd], [], 0.05)
                if r:
                    self._pending += self._ser.read(self._ser.in_waiting or 1)
                if w:
                    try:
                        mv = mv[os.write(self._fd, mv[:WRITE_CHUNK]) :]
                    except BlockingIOError:
                        pass
                if mv and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(mv)} of {len(data)} bytes not accepted within {self.write_timeout:.0f} s")
        except NhilError:  # e.g. verify's stage timeout interrupting the write: keep its outcome (TIMEOUT)
            raise
        except Exception as e:  # SerialException, SerialTimeoutException, OSError
            raise TransportError(f"write to {self.url} failed: {e}") from None

    def read(self, timeout: float) -> bytes:
        if self._pending:
            out = bytes(self._pending)
            self._pending.clear()
            return out
        try:
            ser = self._ser
            n = ser.in_waiting
            if not n and self._fd is not None:  # wait no longer than the timeout (read(1) blocks up to ser.timeout)
                if not select.select([self._fd], [], [], max(0.0, min(timeout, POLL_S)))[0]:
                    return b""
                n = ser.in_waiting
            data = ser.read(n if n else 1)
            if data and not n:
                more = ser.in_waiting
                if more:
                    data += ser.read(more)
            return data
        except NhilError:  # e.g. verify's stage timeout interrupting the read: keep its outcome (TIMEOUT)
            raise
        except Exception as e:
            raise TransportError(f"read from {self.url} failed: {e}") from None

    def close(self) -> None:
        try:
            self._ser.close()
        except Exception:
            pass


def open_serial(url: str, baud: int, write_timeout: float = 10.0) -> SerialTransport:
    """Open the pyserial URL ``url`` at ``baud``.

    Raises:
        SetupError: pyserial is not installed.
        TransportError: the port cannot be opened (names the URL and pyserial's reason).
    """
    try:
        import serial
    except ImportError:
        raise SetupError("the fpga target needs pyserial: pip install pyserial") from None
    try:
        ser = serial.serial_for_url(url, baudrate=baud, timeout=POLL_S, write_timeout=write_timeout)
    except (serial.SerialException, OSError, ValueError) as e:
        raise TransportError(f"cannot open serial port {url}: {e}") from None
    return SerialTransport(ser, url, write_timeout)


class MemoryTransport(Transport):
    """One end of an in-memory pair (:func:`memory_pair`); safe to use from two threads.

    ``write`` hands the bytes to the other end: to its handler when it has one (called in the
    writer's thread, before ``write`` returns), else to its inbox, which its ``read`` empties.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.peer: MemoryTransport | None = None
        self.closed = False
        self._inbox = bytearray()
        self._cv = threading.Condition()
        self._handler: Callable[[bytes], None] | None = None

    def serve(self, handler: Callable[[bytes, Callable[[bytes], None]], None]) -> None:
        """Answer every write of the other end with ``handler(data, send)`` (``send`` writes back from this end),
        e.g. ``end.serve(board.on_bytes)`` puts the board emulator behind this end."""
        self._handler = lambda data: handler(data, self.write)

    def write(self, data: bytes) -> None:
        peer = self.peer
        if self.closed or peer is None or peer.closed:
            raise TransportError(f"write to {self.url} failed: the other end is closed")
        peer._deliver(bytes(data))

    def _deliver(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler(data)
            return
        with self._cv:
            self._inbox += data
            self._cv.notify_all()

    def read(self, timeout: float) -> bytes:
        with self._cv:
            if not self._inbox and timeout > 0:
                self._cv.wait(timeout)
            out = bytes(self._inbox)
            self._inbox.clear()
        if not out and self.closed:
            raise TransportError(f"read from {self.url} failed: this end is closed")
        return out

    def close(self) -> None:
        self.closed = True
        with self._cv:
            self._cv.notify_all()


def memory_pair(url: str = "memory://") -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory ends ``(host, device)``; what one writes the other reads."""
    a, b = MemoryTransport(url + "host"), MemoryTransport(url + "device")
    a.peer, b.peer = b, a
    return a, b
