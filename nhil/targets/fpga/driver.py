"""Host side of the FPGA link: ``FpgaTarget``, the ``fpga`` execution target.

Stop-and-wait request/reply over any pyserial URL (``/dev/ttyUSB0``, ``rfc2217://host:port``,
``socket://host:port``, ``loop://``), protocol v2 in ``docs/link-protocol.md``. Every frame
is retransmitted (same seq, bounded retries, exponential backoff of the reply timeout)
until its reply arrives; the board answers a repeated seq from its reply cache, so nothing
executes twice. Requests over 64 bytes travel as fragmented messages: MSG_BEGIN and the last
byte stop-and-wait, everything between as bursts of headerless short frames (section 12:
S_DATA / S_ZERO, closed by S_QUERY bitmaps and S_PINGs) of which only the pieces not shown
held are sent again; large replies are buffered on the board (REPLY_HEAD) and read by S_FETCH
bursts the same way. The piece size follows the per-byte survival measured on each burst
(``k = -1 / ln q``), so a line that corrupts, drops and duplicates 1% of its bytes each still
carries a few hundred kB/s over the emulator's pty. Later loads of the same program keep the
weight rows the board still holds, checked by CRC (:meth:`FpgaTarget.reload`, section 4a).
A changed board session nonce, or an ``E_SESSION`` error, means the board was reset
mid-session: that ends the run with ``LinkError`` (state is gone), never a retry.
"""

from __future__ import annotations

import collections
import json
import math
import os
import select
import subprocess
import sys
import time
import weakref
import zlib

import numpy as np

from nhil.errors import LinkError, LoadError, NhilError, RunError, SetupError
from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import OPINFO, Op
from nhil.isa.program import Program
from nhil.targets.base import Capabilities, ReadbackDigest, ResolvedInstr, SyncRecord, Target, check_program_fits
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga import stream as S
from nhil.targets.fpga.frame import BAD_CRC, DEFAULT_MAX_PAYLOAD, END, OVERHEAD, Bad, Deframer, Frame, Short, crc32, encode_frame

DEFAULT_BAUD = 3_000_000
COUNTERS = (
    "frames_tx", "frames_rx", "bytes_tx", "bytes_rx", "payload_tx", "payload_rx", "crc_errors", "framing_errors",
    "naks", "retries", "resyncs", "timeouts", "stale_replies", "duplicate_replies", "board_errors",
    "messages", "fragments", "zero_bytes", "fetches", "shrinks", "grows", "msg_crc_errors", "reply_crc_errors",
    "short_tx", "short_rx", "cells_up", "cells_down", "cell_up", "cell_down", "polls",
)
DIRECT_MAX = 64  # requests with a larger payload travel as fragmented messages
MIN_FRAGMENT = 16  # smallest fragment data budget (bytes)
GROW, SHRINK = 1.5, 0.8  # budget x GROW after a good exchange, x SHRINK**k after the k-th failure in a row
MIN_RTO = 0.005  # seconds: floor of the adaptive reply timeout
MAX_CELL = 1 << 15  # largest cell of a short-frame stream (bytes)
SWIN_MIN, SWIN_MAX = 16, 1024  # short frames per burst (adapts: doubles after a burst with progress, halves without)
RANGE_BUDGET = 768  # most pieces outstanding in an upload: the board keeps up to 1024 held ranges (fragment.MAX_RANGES)
PER_FRAME_S = 0.0001  # allowance for the board to process one frame of a burst (the emulator takes ~10-20 us)
WRITE_CHUNK = 16384  # bytes per os.write while draining the receive side (_write)
PING_COPIES = 6  # S_PINGs closing a burst
FETCH_COPIES = 3  # copies of each S_FETCH (the board serves the first and answers the others with S_DONE only)
TAIL_FILL = 48  # a burst of fewer pieces sends each several times, to about this many frames
QUERY_COPIES = 4  # copies of each S_QUERY closing an upload burst
_END_B = bytes([END])


def _stop_proc(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def start_emulator(device: str, faults: str = "", rtl: bool = False, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start ``nhil fpga-emu`` as a subprocess; returns (process, pty path).

    Raises:
        LinkError: the emulator did not announce its pty in ``timeout`` seconds.
    """
    cmd = [sys.executable, "-m", "nhil.targets.fpga.cli", "--device", device, "--faults", faults or ""]
    if rtl:
        cmd.append("--rtl")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    path = line.decode(errors="replace").strip()
    if not path:
        code = proc.poll()
        _stop_proc(proc)
        raise LinkError(f"board emulator ({' '.join(cmd[2:])}) " + (f"exited with code {code}" if code is not None else f"did not announce its pty within {timeout:.0f} s") + " (its stderr is above)")
    return proc, path


def _grid_cuts(a: int, e: int, g: int) -> list[int]:
    """Starts of the pieces of ``[a, e)`` cut at the multiples of ``g``."""
    return [a, *range((a // g + 1) * g, e, g)]


def _spans(cells: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(first cell, count <= MAX_CELLS)`` query spans covering the inclusive cell ranges ``cells`` (ascending)."""
    out: list[tuple[int, int]] = []
    end = -1  # first cell not covered yet
    for c0, c1 in cells:
        while c1 >= end:
            start = max(c0, end)
            out.append((start, S.MAX_CELLS))
            end = start + S.MAX_CELLS
    if out:  # trim the last span to the cells it needs
        c0, _ = out[-1]
        out[-1] = (c0, max(c1 for _, c1 in cells if c1 >= c0) - c0 + 1)
    return out


CRC_PIECE_ROWS = 16  # rows per MEM_CRC request of a warm reload (16 MiB of aim-like row images)


def _crc_pieces(kept: dict[int, np.ndarray]) -> list[tuple[int, int, int]]:
    """``(row, count, crc)`` MEM_CRC requests covering the rows of ``kept`` (row -> its image, flat uint16):
    runs of consecutive rows cut every ``CRC_PIECE_ROWS``, ``crc`` the CRC-32 of their images in row order."""
    out: list[tuple[int, int, int]] = []
    for row in sorted(kept):
        img = kept[row].astype("<u2", copy=False)
        if out and out[-1][0] + out[-1][1] == row and out[-1][1] < CRC_PIECE_ROWS:
            r0, n, acc = out[-1]
            out[-1] = (r0, n + 1, crc32(img, acc))
        else:
            out.append((row, 1, crc32(img)))
    return out


def _row_ranges(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Merge MEM_CRC pieces into maximal ``(row, count)`` ranges for RESET_KEEP_ROWS."""
    out: list[tuple[int, int]] = []
    for row, count, _ in pieces:
        if out and out[-1][0] + out[-1][1] == row:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((row, count))
    return out


class FpgaTarget(Target):
    """The FPGA prototype behind a serial link (or the board emulator on a pty).

    Args:
        port: pyserial URL of the board; ``None``: ``$FPGA_PORT``, else start a board
            emulator on a pseudo-terminal (stopped by ``close``).
        baud: line rate (``$FPGA_BAUD``, default 3 000 000); also scales the per-frame timeout.
        device: device preset the started emulator serves (ignored for a real board, whose
            INFO reply tells its device).
        faults: fault spec for the started emulator (``$FPGA_FAULTS``), see ``faults.py``.
        rtl: the started emulator executes on the RTL target.
        open_timeout: seconds to establish the session (HELLO + INFO).
        frame_timeout: base seconds to wait for a reply, plus the frame's wire time at ``baud``;
            doubles after each timeout (capped at 16x).
        run_timeout: seconds an accepted EXEC may run before its READBACK must arrive.
        max_retries: transmissions of one frame before ``LinkError`` (each fragment of a
            message, and each FETCH, has its own budget of retries).
        chunk_bytes: WRITE_MEM data bytes per request during a load (capped by the board's max message).
        max_fragment: cap on the data bytes per frame (the adaptive budget starts here; default
            the board's max payload).
        progress: show a progress bar for loads (``None``: when the image exceeds 8 MiB and stderr is a tty).
        board: name of a board in the boards file (``$FPGA_BOARD``; :mod:`nhil.boards`): its URL, baud
            and device preset replace ``port``, ``baud`` and ``device``.
    """

    name = "fpga"

    def __init__(self, port: str | None = None, baud: int | None = None, device: str | DeviceConfig | None = "aim-like", faults: str | None = None, *,
                 rtl: bool = False, open_timeout: float = 10.0, frame_timeout: float = 0.5, run_timeout: float = 60.0, max_retries: int = 32,
                 chunk_bytes: int = 65536, max_fragment: int | None = None, progress: bool | None = None, board: str | None = None, **_ignored) -> None:
        self.board = board or os.environ.get("FPGA_BOARD") or None
        if self.board:
            from nhil.boards import get_board

            b = get_board(self.board)
            port, baud, device = b.url, b.baud, b.device
        self.port = port or os.environ.get("FPGA_PORT") or None
        try:
            self.baud = int(baud if baud is not None else os.environ.get("FPGA_BAUD", DEFAULT_BAUD))
        except ValueError:
            raise SetupError(f"FPGA_BAUD must be an integer, got {os.environ.get('FPGA_BAUD')!r}") from None
        dev = device.name if isinstance(device, DeviceConfig) else (device or "aim-like")
        if self.port is None and dev not in DEVICE_PRESETS:
            raise SetupError(f"unknown device {dev!r} for the board emulator; presets: {', '.join(DEVICE_PRESETS)}")
        self.device_name = dev
        self.faults = faults if faults is not None else os.environ.get("FPGA_FAULTS", "")
        if self.faults:
            from nhil.targets.fpga.faults import FaultSpec

            FaultSpec.parse(self.faults)  # fail early on a bad spec
            if self.port is not None:
                raise SetupError("fault injection is done by the board emulator: pass --faults to `nhil fpga-emu`, or leave FPGA_PORT unset so the target starts one")
        self.rtl = rtl
        self.open_timeout = open_timeout
        self.frame_timeout = frame_timeout
        self.run_timeout = run_timeout
        self.max_retries = max(1, max_retries)
        self.chunk_bytes = max(2, chunk_bytes & ~1)
        self.max_fragment = max_fragment
        self.progress = progress
        self.ser = None
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.board_nonce: int | None = None
        self.max_payload = DEFAULT_MAX_PAYLOAD
        self.max_message = DEFAULT_MAX_PAYLOAD
        self.budget = self.budget_max = self.budget_min_seen = DEFAULT_MAX_PAYLOAD - P.BEGIN_HEADER
        self._fails = 0  # failed exchanges in a row
        self.swin = SWIN_MIN  # short frames per burst (section 12)
        self._lnq: dict[str, float | None] = {"up": None, "down": None}  # ln(per-byte survival) per direction
        self._qid = 0  # id of the last S_QUERY / S_FETCH
        self._exec_s = 0.0  # smoothed seconds from ACCEPTED to an EXEC's reply
        self._fd: int | None = None  # selectable descriptor of the port, if it has one
        self._srtt: float | None = None
        self._rttvar = 0.0
        self.info: dict = {}
        self._caps: Capabilities | None = None
        self._seq = 0
        self._rx = Deframer(DEFAULT_MAX_PAYLOAD)
        self._q: collections.deque = collections.deque()
        self._digest = ReadbackDigest()
        self._counts: dict[str, int] = {}
        self.link = dict.fromkeys(COUNTERS, 0)
        self.load_seconds = 0.0
        self.load_bytes = 0
        self._words: dict = {}  # Instr -> encoded word (the same instructions recur every step)
        self._dead: str | None = None  # set once a board reset was detected: the session is over
        self._resident = None  # (weakref to the program loaded last, its MEM_CRC pieces) while the board holds it
        self.reloads = {"full": 0, "warm": 0, "mismatch": 0, "seconds": 0.0}

    # ------------------------------------------------------------ session
    def open(self) -> None:
        if self.ser is not None:
            return
        try:
            import serial
        except ImportError:
            raise SetupError("the fpga target needs pyserial: pip install pyserial") from None
        if self.port is None:
            self.proc, self.url = start_emulator(self.device_name, self.faults, self.rtl, timeout=900.0 if self.rtl else 20.0)  # RTL: first build
            weakref.finalize(self, _stop_proc, self.proc)
        else:
            self.url = self.port
        try:
            self.ser = serial.serial_for_url(self.url, baudrate=self.baud, timeout=0.02, write_timeout=max(10.0, self.run_timeout))
            try:  # a selectable descriptor (device, pty, socket://) lets _recv wait exactly until its deadline
                self._fd = self.ser.fileno() if hasattr(self.ser, "fileno") else None
            except Exception:
                self._fd = None
        except (serial.SerialException, OSError, ValueError) as e:
            self.close()
            raise LinkError(f"cannot open serial port {self.url}: {e}") from None
        try:
            self._hello()
            self._read_info()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.ser is not None:
            try:
                self.ser.close()
            except Exception:
                pass
            self.ser = None
        if self.proc is not None:
            _stop_proc(self.proc)
            self.proc = None

    def _hello(self) -> None:
        host_nonce = int.from_bytes(os.urandom(4), "little")
        frame = encode_frame(P.HELLO, 0, 0, 0, P.pack_hello(host_nonce))
        deadline = time.monotonic() + self.open_timeout
        wait = 0.1
        echoed = False
        while time.monotonic() < deadline:
            self._write(b"\xc0\xc0" + frame + _END_B, len(P.pack_hello(host_nonce)))
            until = min(deadline, time.monotonic() + wait)
            while True:
                ev = self._recv(until)
                if ev is None:
                    break
                if not isinstance(ev, Frame):
                    continue
                if ev.type == P.HELLO:
                    echoed = True
                    continue
                if ev.seq != 0:
                    continue
                if ev.type == P.ERROR:
                    code, msg = P.unpack_error(ev.payload)
                    raise LinkError(f"board at {self.url} refused HELLO: {P.ERROR_NAMES.get(code, code)}: {msg}")
                if ev.type != P.HELLO_REPLY:
                    continue
                try:
                    proto, isa, nonce, maxp, maxm = P.unpack_hello_reply(ev.payload)
                except P.ProtocolError as e:
                    raise LinkError(f"board at {self.url}: malformed HELLO reply: {e}") from None
                if proto != P.PROTOCOL_VERSION or isa != P.ISA_VERSION:
                    raise LinkError(f"board at {self.url} speaks link protocol v{proto} / ISA v{isa}; this nhil needs protocol v{P.PROTOCOL_VERSION} / ISA v{P.ISA_VERSION}")
                if not 64 <= maxp <= (1 << 24):
                    raise LinkError(f"board at {self.url} announced an implausible max payload of {maxp} bytes")
                self.board_nonce = nonce
                self.max_payload = maxp
                self.max_message = max(maxp, maxm)
                self._rx.max_payload = maxp
                self._rx.max_wire = 2 * (maxp + OVERHEAD)
                cap = maxp - P.BEGIN_HEADER - 8  # room for MSG_BEGIN / WRITE_MEM headers
                self.budget_max = max(MIN_FRAGMENT, min(cap, self.max_fragment or cap))
                self.budget = self.budget_min_seen = self.budget_max
                return
            self.link["timeouts"] += 1
            wait = min(wait * 2, 2.0)
        hint = " (the line echoes our own frames: a loopback, not a board)" if echoed else f": is the board powered, the port right and the baud rate {self.baud} what the board uses?"
        raise LinkError(f"no HELLO reply from {self.url} within {self.open_timeout:.1f} s{hint}")

    def _read_info(self) -> None:
        f = self._transact(P.INFO, b"", P.INFO_REPLY, reply_size=4096)
        try:
            info = json.loads(f.payload.decode())
            dev = DeviceConfig.from_dict(info["device"])
            ops = frozenset(Op[o] for o in info["ops"])
            caps = Capabilities(int(info["isa_version"]), ops, frozenset(str(x) for x in info["formats"]), dev)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise LinkError(f"board at {self.url}: malformed INFO reply ({type(e).__name__}: {e})") from None
        self.info = info
        self._caps = caps

    # ------------------------------------------------------------ bytes
    def _write(self, data: bytes, payload_bytes: int) -> None:
        """Write ``data``, reading whatever arrives meanwhile into the receive queue: a board answering a long
        burst fills the line back to us while we still write, and if neither side read, both would block."""
        try:
            if self._fd is None:
                self.ser.write(data)
            else:
                mv = memoryview(data)
                deadline = time.monotonic() + max(10.0, self.run_timeout)
                while mv:
                    r, w, _ = select.select([self._fd], [self._fd], [], 0.05)
                    if r:
                        self._feed(self.ser.read(self.ser.in_waiting or 1))
                    if w:
                        try:
                            mv = mv[os.write(self._fd, mv[:WRITE_CHUNK]) :]
                        except BlockingIOError:
                            pass
                    if mv and time.monotonic() > deadline:
                        raise TimeoutError(f"{len(mv)} of {len(data)} bytes not accepted within {max(10.0, self.run_timeout):.0f} s")
        except NhilError:  # e.g. verify's stage timeout interrupting the write: keep its outcome (TIMEOUT)
            raise
        except Exception as e:  # SerialException, SerialTimeoutException, OSError
            raise LinkError(f"write to {self.url} failed: {e}") from None
        self.link["frames_tx"] += 1
        self.link["bytes_tx"] += len(data)
        self.link["payload_tx"] += payload_bytes

    def _recv(self, deadline: float) -> Frame | Short | Bad | None:
        """Next received frame or bad run, or ``None`` at ``deadline``."""
        while not self._q:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                n = self.ser.in_waiting
                if not n and self._fd is not None:  # wait no longer than the deadline (read(1) blocks up to ser.timeout)
                    if not select.select([self._fd], [], [], min(left, 0.02))[0]:
                        continue
                    n = self.ser.in_waiting
                data = self.ser.read(n if n else 1)
                if data and not n:
                    more = self.ser.in_waiting
                    if more:
                        data += self.ser.read(more)
            except NhilError:  # e.g. verify's stage timeout interrupting the read: keep its outcome (TIMEOUT)
                raise
            except Exception as e:
                raise LinkError(f"read from {self.url} failed: {e}") from None
            self._feed(data)
        return self._q.popleft()

    def _feed(self, data: bytes) -> None:
        """Decode received bytes into the queue of frames / bad runs, counting them."""
        if not data:
            return
        self.link["bytes_rx"] += len(data)
        for ev in self._rx.feed(data):
            if isinstance(ev, Bad):
                self.link["resyncs"] += 1
                self.link["crc_errors" if ev.reason == BAD_CRC else "framing_errors"] += 1
            else:
                self.link["frames_rx"] += 1
                self.link["payload_rx"] += len(ev.payload if isinstance(ev, Frame) else ev.body)
            self._q.append(ev)

    def _rto(self, nbytes: int) -> float:
        """Reply timeout: RFC 6298 SRTT + 4 RTTVAR (floor MIN_RTO, ceiling ``frame_timeout``; ``frame_timeout`` before
        the first sample) plus twice the wire time of ``nbytes`` at the baud rate."""
        base = self.frame_timeout if self._srtt is None else min(self.frame_timeout, max(MIN_RTO, self._srtt + 4 * self._rttvar))
        return base + 2 * 10 * nbytes / self.baud

    def _rtt_sample(self, r: float) -> None:
        if self._srtt is None:
            self._srtt, self._rttvar = r, r / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - r)
            self._srtt = 0.875 * self._srtt + 0.125 * r

    def _adapt(self, ok: bool) -> None:
        """Fragment budget: x GROW after a good exchange, x SHRINK**k after the k-th failed exchange in a row."""
        if ok:
            self._fails = 0
            if self.budget < self.budget_max:
                self.budget = min(self.budget_max, int(self.budget * GROW) + 1)
                self.link["grows"] += 1
        else:
            self._fails += 1
            if self.budget > MIN_FRAGMENT:
                self.budget = max(MIN_FRAGMENT, int(self.budget * SHRINK ** self._fails))
                self.link["shrinks"] += 1
                self.budget_min_seen = min(self.budget_min_seen, self.budget)

    def _copies(self) -> int:
        """Copies of each frame sent back to back: 1 on a clean line, 2-3 when the budget shows a noisy one."""
        return 1 if self.budget >= 1024 else (2 if self.budget >= 256 else (3 if self.budget >= 64 else 4))

    def _split_reply(self, reply_size: int) -> bool:
        """Ask for REPLY_HEAD + FETCH when the reply would not fit the budget, or the line is noisy."""
        return reply_size > self.budget or self.budget < 256

    # ------------------------------------------------------------ request / reply
    def _exchange(self, type_: int, make, reply_size: int, name: str) -> Frame:
        """Send one frame until a reply with its seq arrives; ``make(budget) -> payload`` builds each attempt.

        A retransmission keeps the seq; ``make`` may return a shorter payload after the budget shrank
        (fragments only: the board's reply says how much it holds). Returns the reply frame (may be
        ERROR or REPLY_HEAD; ACCEPTED switches to the run timeout).

        Raises:
            LinkError: retries exhausted, board reset detected.
        """
        if self.ser is None:
            raise LinkError("the fpga target is not open")
        if self._dead:
            raise LinkError(self._dead)
        self._seq = (self._seq % 0xFFFF) + 1
        seq = self._seq
        why = ""
        backoff = 1
        for attempt in range(self.max_retries):
            if attempt:
                self.link["retries"] += 1
                if why == "timeout":
                    time.sleep(min(0.0005 * 2 ** (attempt - 1), 0.05))
            payload = make(self.budget)
            flags = (P.F_RETX if attempt else 0) | (P.F_SPLIT_REPLY if self._split_reply(reply_size) else 0)
            frame = encode_frame(type_, flags, seq, self.board_nonce, payload) + _END_B
            copies = self._copies()
            for _ in range(copies):  # every copy after the first is answered from the reply cache
                self._write(frame, len(payload))
            t_sent = time.monotonic()
            deadline = t_sent + backoff * self._rto(copies * (len(frame) + min(reply_size, self.budget)) + 64)
            accepted = False
            t_acc = run_deadline = poll = 0.0  # set when ACCEPTED arrives
            bad = 0
            while True:
                ev = self._recv(deadline)
                if ev is None and accepted and time.monotonic() < run_deadline:
                    # the EXEC runs, or its reply was lost: ask again (same seq; a busy board answers when done,
                    # from its cache) at growing intervals, without spending the retry budget, up to the run timeout
                    self.link["polls"] += 1
                    self._write(frame, len(payload))
                    poll = min(2 * poll, 1.0)
                    deadline = min(run_deadline, time.monotonic() + poll)
                    continue
                if ev is None:
                    self.link["timeouts"] += 1
                    why = "timeout"
                    backoff = min(backoff * 2, 16)
                    break
                if isinstance(ev, Bad):
                    why = "corrupted reply"
                    bad += 1
                    if bad >= copies:
                        break
                    continue
                if isinstance(ev, Short):  # the tail of an earlier stream (its last answer was lost)
                    self.link["stale_replies"] += 1
                    continue
                if ev.nonce != self.board_nonce:
                    self._dead = f"board reset detected during {name}: its session nonce changed from 0x{self.board_nonce:08x} to 0x{ev.nonce:08x}; device state is lost, the run cannot continue"
                    raise LinkError(self._dead)
                if ev.type in P.REQUESTS:
                    continue  # our own frame echoed back (loopback line)
                if ev.type == P.NAK:
                    self.link["naks"] += 1
                    why = "NAK"
                    bad += 1
                    if bad >= copies:
                        break
                    continue
                if ev.seq != seq:
                    self.link["stale_replies"] += 1
                    continue
                if ev.flags & P.F_RETX:
                    self.link["duplicate_replies"] += 1
                if ev.type == P.ACCEPTED:
                    if not accepted:
                        accepted, t_acc = True, time.monotonic()
                        run_deadline = t_acc + self.run_timeout
                        poll = self._rto(len(frame) + min(reply_size, self.budget)) + 2 * self._exec_s
                        deadline = min(run_deadline, t_acc + poll)
                    continue
                if accepted:  # how long the board takes to execute: the first poll waits twice that
                    self._exec_s = 0.8 * self._exec_s + 0.2 * (time.monotonic() - t_acc)
                if attempt == 0 and not accepted:  # Karn: never from a retransmission (copies answer alike)
                    self._rtt_sample(time.monotonic() - t_sent)
                self._adapt(True)
                return ev
            self._adapt(False)
        raise LinkError(f"{name} (seq {seq}) got no valid reply from {self.url} after {self.max_retries} attempts (last: {why}); link: {self._brief()}")

    # ------------------------------------------------------------ short-frame streams (section 12)
    def _cell(self, direction: str) -> int:
        """Cell size (bytes, a power of two) for short-frame streams in ``direction`` ("up": to the board, "down").

        From the per-byte survival estimated on earlier bursts: ``k * q^(k + overhead)`` (data bytes delivered per
        frame sent) peaks at ``k = -1 / ln q``; before any estimate, the fragment budget."""
        lnq = self._lnq[direction]
        k = float(self.budget) if lnq is None else (-1.0 / lnq if lnq < -1e-9 else float(MAX_CELL))
        k = max(float(MIN_FRAGMENT), min(k, float(MAX_CELL), float(self.max_payload - 16), float(self.budget_max)))
        return 1 << max(4, int(round(math.log2(k))))

    def _learn(self, direction: str, delivered: int, sent: int, wire_bytes: float) -> None:
        """Update the per-byte survival estimate from ``delivered`` of ``sent`` frames of mean ``wire_bytes``."""
        if sent <= 0 or wire_bytes <= 0:
            return
        r = (delivered + 0.5) / (sent + 1.0)
        sample = math.log(r) / wire_bytes
        if not delivered:  # nothing got through: at least halve the frames
            sample = min(sample, -2.0 / max(1.0, wire_bytes - S.SHORT_OVERHEAD))
        old = self._lnq[direction]
        self._lnq[direction] = sample if old is None else 0.5 * old + 0.5 * sample
        self.link["cell_up" if direction == "up" else "cell_down"] = self._cell(direction)

    def _sburst(self, frames: list[bytes], back: int, name: str, on_short, answers: int = 0) -> None:
        """Write short ``frames`` back to back (after one END), then ``PING_COPIES`` S_PINGs, and hand every other
        short frame received to ``on_short(Short) -> bool`` (True: it answers this burst) until the first S_PONG
        (the board answers in order, so everything it sent for the burst came before), a grace after the latest
        answer for the rest of the ``answers`` frames expected, or the reply timeout (the board's time per frame,
        the wire time of the bytes sent and the ``back`` bytes expected at the baud rate). Only answers to this
        burst shorten the wait: the spare copies of the previous burst's answers arrive now too.

        After a timeout the board may still be working through the burst: before returning, S_PINGs go out again
        and, if they too go unanswered, a regular STATUS (answered in order, with retries), so the next burst
        never queues behind this one. Never raises for lost frames: the caller sends again what is missing.

        Raises:
            LinkError: the link is closed, STATUS got no reply, or the board was reset.
        """
        if self.ser is None:
            raise LinkError("the fpga target is not open")
        if self._dead:
            raise LinkError(self._dead)
        self._qid = (self._qid + 1) & 0xFFFF
        ping = self._qid
        frames = [*frames, *[S.s_ping(ping)] * PING_COPIES]
        wire = _END_B + b"".join(frames)
        self._write(wire, len(wire))
        self.link["frames_tx"] += len(frames) - 1
        self.link["short_tx"] += len(frames)
        t0 = time.monotonic()
        wait = self._rto(len(wire) + back) + PER_FRAME_S * len(frames)
        deadline = t0 + wait
        expect = answers + PING_COPIES
        per_frame = PER_FRAME_S + 10 * (back / expect + 8) / self.baud
        synced = True
        while True:
            ev = self._recv(deadline)
            if ev is None:
                if synced:
                    self.link["timeouts"] += 1
                if not synced:  # the catch-up ping went unanswered too: a regular STATUS, answered in order once the
                    self.status()  # board is through the burst (and raising 'board reset detected' if it was reset)
                    return
                # catch up before the next burst: a fresh ping, answered once the board is through this burst
                self._qid = (self._qid + 1) & 0xFFFF
                ping = self._qid
                self._write(_END_B + S.s_ping(ping) * PING_COPIES, 0)
                self.link["short_tx"] += PING_COPIES
                wait = min(2 * wait, 2.0)
                deadline = time.monotonic() + wait
                synced = False
                continue
            if isinstance(ev, Bad):
                continue
            if isinstance(ev, Frame):  # a late regular reply: only a changed nonce matters
                if ev.nonce != self.board_nonce and ev.type not in P.REQUESTS:
                    self._dead = f"board reset detected during {name}: its session nonce changed from 0x{self.board_nonce:08x} to 0x{ev.nonce:08x}; device state is lost, the run cannot continue"
                    raise LinkError(self._dead)
                self.link["stale_replies"] += 1
                continue
            self.link["short_rx"] += 1
            if ev.type == S.S_PONG:
                if ev.body == ping.to_bytes(2, "little"):  # (no RTT sample: a burst's time is mostly the board's work)
                    return
                continue
            if on_short(ev) and synced:
                expect = max(0, expect - 1)
                deadline = min(deadline, time.monotonic() + 0.002 + expect * per_frame)

    def _after_burst(self, progress: bool, stalls: int, what: str) -> int:
        """Burst size and stall count after a burst; returns the new count of bursts in a row without progress.

        The burst doubles after progress (to ``SWIN_MAX``) and halves without. After 2, 4, 8 ... stalled bursts,
        STATUS: a board that was reset drops short frames silently (no session), and only a regular frame shows
        its new nonce.

        Raises:
            LinkError: the board was reset, or ``max_retries`` bursts in a row made no progress (``what`` says where).
        """
        self.swin = min(SWIN_MAX, self.swin * 2) if progress else max(SWIN_MIN, self.swin // 2)
        stalls = 0 if progress else stalls + 1
        if stalls >= 2 and stalls & (stalls - 1) == 0:
            self.status()
        if stalls >= self.max_retries:
            raise LinkError(f"{what} in {stalls} bursts; link: {self._brief()}")
        return stalls

    def _lost(self, name: str, what: str):
        """The board answered a short query with 'no such message / reply': find out why, then raise."""
        self.status()  # raises 'board reset detected' when the nonce changed
        raise LinkError(f"{name}: the board no longer holds the {what} (short-frame status GONE); it was discarded mid-transfer; link: {self._brief()}")

    def _stream_up(self, payload: bytes, total: int, tag: int, lo: int, hi: int, name: str) -> None:
        """Make the board hold bytes ``[lo, hi)`` of the open message with S_DATA / S_ZERO frames in bursts, each
        closed by S_QUERYs whose bitmaps show which pieces arrived; pieces not shown held are sent again with the
        same boundaries, or cut on a finer power-of-two grid (a piece is held whole or not at all, so a repeat is
        new bytes or an exact duplicate). Pieces lie on the grid of cells of ``_cell("up")`` bytes up to the last
        grid line before ``hi``; the rest is cut into power-of-two *solo* pieces, each asked about by a query of
        one cell of its own size (a bitmap cell must not reach into the message's last, unsent byte). At most
        ``RANGE_BUDGET`` pieces are outstanding, so the board's table of held ranges never fills.

        Raises:
            LinkError: no progress in ``max_retries`` bursts in a row, the board lost the message.
        """
        g = self._cell("up")
        pend: list[tuple[int, int, bool, bool]] = []  # (start, end, zero, solo) sent and not yet shown held, ascending
        frontier = lo
        stalls = 0
        mv = memoryview(payload)
        while pend or frontier < hi:
            g2 = self._cell("up")
            if g2 < g:  # finer grid: cut the outstanding data pieces (nested grids keep every piece inside an old one)
                pend = [p for a, e, z, so in pend for p in ([(a, e, z, so)] if z or so else
                                                             [(x, min(e, (x // g2 + 1) * g2), False, False) for x in _grid_cuts(a, e, g2)])]
                g = g2
            hb = hi // g * g  # last grid line at or before hi: solo pieces after it
            burst = pend[: self.swin]
            again = len(burst)
            while len(burst) < self.swin and len(pend) < RANGE_BUDGET and frontier < hi:
                a = frontier
                if a >= hb:  # binary cut of the remainder: 2^k bytes each, largest first
                    e = a + (1 << ((hi - a).bit_length() - 1))
                    piece = (a, e, False, True)
                else:
                    e = min(hb, (a // g + 1) * g)
                    zero = not any(mv[a:e])
                    if zero:  # a run of zero cells goes as one S_ZERO (at most half a query span)
                        while e < hb and e - a < S.MAX_CELLS * g // 2 and not any(mv[e : e + g]):
                            e += g
                    piece = (a, e, zero, False)
                pend.append(piece)
                burst.append(piece)
                frontier = e
            if not burst:
                return
            wires = [S.s_zero(tag, a, e - a) if z else S.s_data(tag, a, payload[a:e]) for a, e, z, _ in burst]
            copies = 1 if len(burst) >= TAIL_FILL else -(-TAIL_FILL // len(burst))  # the last few pieces: several copies each
            frames = wires if copies == 1 else [f for f in wires for _ in range(copies)]
            spans = _spans([(a // g, (e - 1) // g) for a, e, _, so in burst if not so])
            queries = [(c0 * g, g, n) for c0, n in spans] + [(a, e - a, 1) for a, e, _, so in burst if so]
            qids = []
            for off, cell, n in queries:
                self._qid = (self._qid + 1) & 0xFFFF
                qids.append(self._qid)
                frames.extend([S.s_query(tag, self._qid, off, cell.bit_length() - 1, n)] * QUERY_COPIES)
            answers: dict[int, S.Bitmap] = {}

            mine = set(qids)

            def on_short(ev):
                if ev.type == S.S_BITMAP:
                    try:
                        b = S.parse(ev.type, ev.body)
                    except S.ShortError:
                        return False
                    if b.qid in mine:
                        answers.setdefault(b.qid, b)
                        return True
                return False

            self._sburst(frames, 20 * QUERY_COPIES * len(queries), name, on_short, QUERY_COPIES * len(queries))
            held: set[tuple[int, int]] = set()  # (offset, cell size) of cells shown held
            answered: set[tuple[int, int]] = set()
            for qid, (off, cell, n) in zip(qids, queries):
                b = answers.get(qid)
                if b is None:
                    continue
                if b.status != S.ST_OK:
                    self._lost(name, "message")
                if len(b.bits) != (n + 7) // 8:
                    raise LinkError(f"protocol violation: {name}: S_BITMAP of {len(b.bits)} bytes for {n} cells")
                answered.update((off + i * cell, cell) for i in range(n))
                held.update((off + i * cell, cell) for i in range(n) if S.bit(b.bits, i))
            seen = shown = 0
            wire = 0
            done = set()
            for k, (a, e, z, so) in enumerate(burst):
                cells = [(a, e - a)] if so else [(c * g, g) for c in range(a // g, (e - 1) // g + 1)]
                if all(c in answered for c in cells):
                    seen += 1
                    wire += len(wires[k])
                    if all(c in held for c in cells):
                        shown += 1
                        done.add(a)
            if copies == 1:  # with copies the delivery rate says little about one frame
                self._learn("up", shown, seen, wire / max(1, seen))
            self.link["retries"] += again
            self.link["cells_up"] += len(done)
            self.link["zero_bytes"] += sum(e - a for a, e, z, _ in burst if z and a in done)
            pend = [p for p in pend if p[0] not in done]
            stalls = self._after_burst(bool(done), stalls, f"{name}: no piece of [{lo}, {hi}) of {total} got through")

    def _transact(self, type_: int, payload: bytes, expect: int, reply_size: int = 0) -> Frame:
        """One request and its (inline or fetched) reply; payloads over DIRECT_MAX go as a fragmented message.

        Args:
            reply_size: bytes the reply payload may take (decides F_SPLIT_REPLY).

        Raises:
            LinkError: retries exhausted, board reset detected, protocol violation.
            RunError: the board refused the request (run error, address out of range).
        """
        name = P.NAMES[type_]
        if len(payload) > DIRECT_MAX and type_ in P.INNER_REQUESTS:
            ev = self._send_message(type_, payload, reply_size, name)
        else:
            ev = self._exchange(type_, lambda _b: payload, reply_size, name)
        if ev.type == P.REPLY_HEAD:
            ev = self._fetch(ev, name)
        if ev.type == P.ERROR:
            self._board_error(name, ev)
        if ev.type != expect:
            raise LinkError(f"protocol violation: {name} answered with {P.NAMES.get(ev.type, hex(ev.type))}, expected {P.NAMES[expect]}")
        return ev

    def _send_message(self, type_: int, payload: bytes, reply_size: int, name: str) -> Frame:
        """Send ``payload`` as a message: MSG_BEGIN (stop-and-wait) with as many first bytes as the fragment budget
        allows (none once the line is known to be noisy), the rest but the last byte as short frames
        (:meth:`_stream_up`), and the last byte as MSG_DATA / MSG_ZERO (stop-and-wait), whose reply is the inner
        request's. Every byte before ``pos`` is held by the board and
        none after it, between the steps. A message the board reports as E_MSG_CRC is sent again (3 times at most).

        Returns the inner request's reply.
        """
        total = len(payload)
        crc = crc32(payload)
        tag = S.tag_of(crc)
        self.link["messages"] += 1
        for _ in range(3):
            pos = 0
            begun = False
            while True:
                if not begun:  # on a line known to be noisy MSG_BEGIN carries no data: a short frame survives best
                    first = 0 if self._lnq["up"] is not None else total
                    t, make = P.MSG_BEGIN, (lambda b, n=first: P.pack_msg_begin(type_, total, crc, payload[: min(n, max(1, b))]))
                else:
                    if total - 1 > pos:  # all but the last byte as short frames; the last one completes the message
                        self._stream_up(payload, total, tag, pos, total - 1, name)
                        pos = total - 1
                    if payload[pos:].count(0) == total - pos:
                        t, zero = P.MSG_ZERO, P.pack_msg_zero(pos, total - pos)
                        make = lambda _b, zero=zero: zero
                    else:
                        t = P.MSG_DATA
                        make = lambda b, a=pos: P.pack_msg_data(a, payload[a : min(total, a + max(1, b))])
                ev = self._exchange(t, make, reply_size, f"{name} ({P.NAMES[t]} @{pos}/{total})")
                self.link["fragments"] += 1
                if t == P.MSG_ZERO:
                    self.link["zero_bytes"] += total - pos
                if ev.type != P.FRAG_ACK:
                    if ev.type == P.REPLY_HEAD:
                        ev = self._fetch(ev, name)
                    if ev.type == P.ERROR and P.unpack_error(ev.payload)[0] == P.E_MSG_CRC:
                        self.link["msg_crc_errors"] += 1
                        break
                    return ev
                try:
                    got, tot = P.unpack_frag_ack(ev.payload)
                except P.ProtocolError as e:
                    raise LinkError(f"protocol violation: {e}") from None
                if tot != total or not pos <= got < total or (begun and got == pos):
                    raise LinkError(f"protocol violation: {name} fragment at {pos} acknowledged as {got} of {tot} bytes (message of {total})")
                pos, begun = got, True
        raise LinkError(f"{name}: the board reassembled a message of {total} bytes with a wrong CRC 3 times; link: {self._brief()}")

    def _fetch(self, head: Frame, name: str) -> Frame:
        """Read a REPLY_HEAD's reply by S_FETCH bursts (each asks for up to 64 missing cells, the board streams them
        as S_REPLY and ends with S_DONE); check the CRC of the whole (3 tries).

        Raises:
            LinkError: no progress in ``max_retries`` bursts, the board lost the reply, CRC mismatch 3 times.
        """
        try:
            rtype, total, crc = P.unpack_reply_head(head.payload)
        except P.ProtocolError as e:
            raise LinkError(f"protocol violation: {e}") from None
        if total > self.max_message:
            raise LinkError(f"protocol violation: {name} reply of {total} bytes exceeds the board's max message {self.max_message}")
        tag = S.tag_of(crc)
        for _ in range(3):
            buf = bytearray(total)
            g = self._cell("down")
            miss = [(a, min(total, a + g)) for a in range(0, total, g)]  # cells still to read
            asked_before: set[int] = set()
            stalls = 0
            while miss:
                g2 = self._cell("down")
                if g2 < g:
                    miss = [(x, min(e, x + g2)) for a, e in miss for x in range(a, e, g2)]
                    g = g2
                burst = miss[: self.swin]
                spans = _spans([(a // g, (e - 1) // g) for a, e in burst])
                want = {a for a, _ in burst}
                frames, qids, asked = [], [], []
                for c0, n in spans:
                    self._qid = (self._qid + 1) & 0xFFFF
                    qids.append(self._qid)
                    cells = [(c0 + i) * g in want for i in range(n)]
                    asked.append([(c0 + i) * g for i in range(n) if cells[i]])
                    frames.extend([S.s_fetch(tag, self._qid, c0 * g, g.bit_length() - 1, n, S.bits_of(cells))] * FETCH_COPIES)
                got: dict[int, int] = {}
                dones: dict[int, S.Done] = {}
                ends = dict(burst)

                mine = set(qids)

                def on_short(ev):
                    try:
                        x = S.parse(ev.type, ev.body)
                    except S.ShortError:
                        return False
                    if ev.type == S.S_REPLY:
                        e = ends.get(x.offset)
                        if x.tag == tag and e is not None and len(x.data) == e - x.offset:
                            buf[x.offset : e] = x.data
                            got[x.offset] = e
                            return True
                        self.link["stale_replies"] += 1
                    elif ev.type == S.S_DONE and x.qid in mine:
                        dones.setdefault(x.qid, x)
                        return True
                    return False

                self._sburst(frames, sum(e - a + S.SHORT_OVERHEAD for a, e in burst) + 8 * len(frames), f"{name} (S_FETCH)", on_short, len(burst) + len(frames))
                self.link["fetches"] += len(qids)
                seen = shown = 0
                nbytes = 0
                for qid, offs in zip(qids, asked):
                    d = dones.get(qid)
                    if d is not None and d.status != S.ST_OK:
                        self._lost(name, "reply")
                    if d is not None or any(o in got for o in offs):  # the request arrived: its cells were sent
                        seen += len(offs)
                        shown += sum(1 for o in offs if o in got)
                        nbytes += sum(ends[o] - o for o in offs)
                self._learn("down", shown, seen, S.SHORT_OVERHEAD + nbytes / max(1, seen))
                self.link["retries"] += sum(1 for a, _ in burst if a in asked_before)
                asked_before.update(a for a, _ in burst)
                self.link["cells_down"] += len(got)
                miss = [p for p in miss if p[0] not in got]
                stalls = self._after_burst(bool(got), stalls, f"{name}: reading a {total}-byte reply made no progress")
            if crc32(buf) == crc:
                return Frame(rtype, head.flags, head.seq, head.nonce, bytes(buf))
            self.link["reply_crc_errors"] += 1
        raise LinkError(f"{name}: the reply of {total} bytes fetched 3 times never matched its CRC; link: {self._brief()}")

    def _board_error(self, name: str, ev: Frame):
        code, msg = P.unpack_error(ev.payload)
        self.link["board_errors"] += 1
        cname = P.ERROR_NAMES.get(code, str(code))
        if code == P.E_SESSION:
            self._dead = f"board reset detected during {name}: {msg}; device state is lost, the run cannot continue"
            raise LinkError(self._dead)
        if code in (P.E_RUN, P.E_ADDRESS, P.E_BAD_INSTR):
            raise RunError(f"board refused {name}: {msg}" if code != P.E_RUN else msg)
        raise LinkError(f"board refused {name}: {cname}: {msg}")

    def _brief(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.link.items() if v)

    # ------------------------------------------------------------ Target
    def capabilities(self) -> Capabilities:
        """From the board's INFO reply; opens the link (and starts the emulator) if not open yet."""
        if self._caps is None:
            self.open()
        return self._caps

    def load(self, program: Program) -> None:
        caps = self.capabilities()
        check_program_fits(program, caps, self.name)
        d = caps.device
        imgs = [img for img in program.bank_images if img.data is not None]
        total = sum(int(img.data.size) * 2 for img in imgs)
        t0 = time.monotonic()
        self._transact(P.LOAD_PROGRAM, P.pack_load_program(len(imgs)), P.ACK)
        crc = 0
        nbytes = nwrites = 0
        show = self.progress if self.progress is not None else (total > (8 << 20) and sys.stderr.isatty())
        done, next_note = 0, t0 + 30.0
        bar = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

            bar = Progress(TextColumn("load → fpga"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            task = bar.add_task("load", total=total)
            bar.start()
        self._resident = None
        kept: dict[int, np.ndarray] = {}  # row -> image of the rows with non-zero images (what a warm reload keeps)
        try:
            for img in imgs:
                flat = np.ascontiguousarray(img.data, dtype="<u2").reshape(-1)
                if flat.size != d.channels * d.banks * d.cols:
                    raise LoadError(f"bank image row {img.row} has {flat.size} elements, device rows hold {d.channels * d.banks * d.cols}")
                if flat.any():
                    kept[img.row] = flat
                # once the line is known to be noisy (messages travel as short-frame streams), one message per
                # max_message bytes saves the stop-and-wait begin and end of each 64 KiB chunk (decided per row)
                noisy = self._lnq["up"] is not None or self.budget < self.chunk_bytes
                chunk = max(1, min(self.max_message if noisy else self.chunk_bytes, self.max_message - 8, S.MAX_OFFSET) // 2)
                for off in range(0, flat.size, chunk):
                    seg = flat[off : off + chunk]
                    if seg.any():  # the board's memory is zero after LOAD_PROGRAM
                        pl = P.pack_write_mem(img.row, off, seg.tobytes())
                        self._transact(P.WRITE_MEM, pl, P.ACK)
                        crc = zlib.crc32(pl, crc)
                        nbytes += len(pl)
                        nwrites += 1
                    done += seg.size * 2
                    if bar is not None:
                        bar.update(task, advance=seg.size * 2)
                    elif total > (64 << 20) and time.monotonic() > next_note:  # no terminal: a line every 30 s
                        el = time.monotonic() - t0
                        print(f"[nhil] load -> fpga: {done / 1e6:.0f} of {total / 1e6:.0f} MB in {el:.0f} s ({done / el / 1e3:.0f} kB/s of image; "
                              f"{self.link['retries']} retries, {self.link['crc_errors']} CRC errors)", file=sys.stderr, flush=True)
                        next_note = time.monotonic() + 30.0
        finally:
            if bar is not None:
                bar.stop()
        self._transact(P.LOAD_END, P.pack_load_end(nbytes, nwrites, crc), P.ACK)
        self.load_seconds = time.monotonic() - t0
        self.load_bytes = total
        self.reloads["full"] += 1
        self._resident = (weakref.ref(program), _crc_pieces(kept))
        self._digest = ReadbackDigest()
        self._counts = {}

    def reload(self, program: Program) -> None:
        """Restore the state after ``load(program)`` without sending the weights again, when the board still holds them.

        If ``program`` is the one this session loaded last: RESET with RESET_KEEP_ROWS listing the rows whose images
        are non-zero (the board zeroes every other row, e.g. the KV cache, and clears GB, ACC and CFRs), then MEM_CRC
        of the kept rows (pieces of at most ``CRC_PIECE_ROWS``) against the CRC-32 of the program's images. Any
        mismatch (the program wrote into a weight row, or the board's memory changed) falls back to a full ``load``
        and is counted in ``stats()["load"]["reloads"]["mismatch"]``; so the resulting state is always exactly
        ``load``'s. Otherwise (another program, nothing loaded): ``load``.

        Raises:
            LinkError, LoadError: as ``load``.
        """
        res = self._resident
        if res is None or res[0]() is not program or self._dead:
            self.load(program)
            return
        pieces = res[1]
        ranges = _row_ranges(pieces)
        if len(ranges) > P.MAX_KEEP_RANGES:
            self.load(program)
            return
        t0 = time.monotonic()
        self._transact(P.RESET, P.pack_reset(ranges), P.ACK)
        bad = []
        for row, count, want in pieces:
            got = P.unpack_mem_crc_reply(self._transact(P.MEM_CRC, P.pack_mem_crc(row, count), P.MEM_CRC_REPLY, reply_size=4).payload)
            if got != want:
                bad.append((row, count))
        if bad:
            self.reloads["mismatch"] += 1
            where = ", ".join(f"[{r}, {r + c})" for r, c in bad[:4]) + (" ..." if len(bad) > 4 else "")
            print(f"[nhil] fpga: board rows {where} differ from the program's images after RESET_KEEP_ROWS (the program writes "
                  f"into rows that hold weights, or the board's memory changed): loading the whole program again", file=sys.stderr, flush=True)
            self.load(program)
            return
        self.reloads["warm"] += 1
        self.reloads["seconds"] += time.monotonic() - t0
        self._digest = ReadbackDigest()
        self._counts = {}

    def _groups(self, block: list[ResolvedInstr]):
        """Split a block into EXEC frames whose request and READBACK both fit the max payload."""
        lanes = self.capabilities().device.lanes
        limit = self.max_message - 4
        cur, size, rsize = [], 0, 0
        for r in block:
            pl = b"" if r.payload is None else np.ascontiguousarray(r.payload, dtype=P.payload_dtype(r.instr.op)).tobytes()
            isz = P.exec_item_bytes(len(pl))
            rb = P.readback_bytes(r.instr.op, r.instr.n, lanes) if OPINFO[r.instr.op].data_out else 0
            if cur and (size + isz > limit or rsize + rb > limit):
                yield cur, rsize
                cur, size, rsize = [], 0, 0
            if isz > limit or rb > limit:
                raise RunError(f"instruction {r.index} ({r.instr.op.name}) needs {max(isz, rb)} bytes in one message, the board's max message is {self.max_message}")
            cur.append((r, pl))
            size += isz
            rsize += rb
        if cur:
            yield cur, rsize

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        lanes = self.capabilities().device.lanes
        for group, rsize in self._groups(block):
            items = []
            for r, pl in group:
                word = self._words.get(r.instr)
                if word is None:
                    try:
                        word = r.instr.encode()
                    except Exception as e:
                        raise RunError(f"instruction {r.index}: {e}") from None
                    if len(self._words) > (1 << 17):
                        self._words.clear()
                    self._words[r.instr] = word
                items.append((r.index, word, pl))
            f = self._transact(P.EXEC, P.pack_exec(items), P.READBACK, reply_size=4 + rsize)
            try:
                rbs = P.unpack_readback(f.payload)
            except P.ProtocolError as e:
                raise LinkError(f"malformed READBACK from the board: {e}") from None
            outs = [r for r, _ in group if OPINFO[r.instr.op].data_out]
            if len(rbs) != len(outs):
                raise LinkError(f"protocol violation: EXEC of {len(group)} instructions returned {len(rbs)} readbacks, expected {len(outs)}")
            for r, a in zip(outs, rbs):
                want = (r.instr.n, np.float32) if r.instr.op is Op.RD_ACC else (r.instr.n * lanes, np.uint16)
                if a.size != want[0] or a.dtype != want[1]:
                    raise LinkError(f"protocol violation: readback of instruction {r.index} ({r.instr.op.name}) is {a.size} x {a.dtype}, expected {want[0]} x {np.dtype(want[1])}")
            it = iter(rbs)
            for r, _ in group:
                op = r.instr.op
                self._counts[op.name] = self._counts.get(op.name, 0) + 1
                if OPINFO[op].data_out:
                    a = next(it)
                    out.append(a)
                    self._digest.add(a)
                elif op is Op.SYNC:
                    self._digest.sync(r.index)
        return out

    def _check_bank(self, ch: int, bank: int) -> DeviceConfig:
        d = self.capabilities().device
        if not (0 <= ch < d.channels and 0 <= bank < d.banks):
            raise RunError(f"channel {ch} / bank {bank} outside the device ({d.channels} channels x {d.banks} banks)")
        return d

    def read_row(self, ch: int, bank: int, row: int) -> np.ndarray:
        d = self._check_bank(ch, bank)
        f = self._transact(P.READ_MEM, P.pack_read_mem(row, (ch * d.banks + bank) * d.cols, d.cols), P.MEM_DATA, reply_size=2 * d.cols)
        if len(f.payload) != 2 * d.cols:
            raise LinkError(f"protocol violation: READ_MEM of {d.cols} elements returned {len(f.payload)} bytes")
        return np.frombuffer(f.payload, dtype="<u2").astype(np.uint16)

    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        d = self._check_bank(ch, bank)
        a = np.ascontiguousarray(data, dtype="<u2").reshape(-1)
        if a.size != d.cols:
            raise RunError(f"write_row needs {d.cols} elements, got {a.size}")
        self._transact(P.WRITE_MEM, P.pack_write_mem(row, (ch * d.banks + bank) * d.cols, a.tobytes()), P.ACK)

    def status(self) -> dict:
        """The board's STATUS counters (one round trip)."""
        st = P.unpack_status(self._transact(P.STATUS, b"", P.STATUS_REPLY, reply_size=32).payload)
        st["state"] = P.STATE_NAMES.get(st["state"], st["state"])
        st["last_error"] = P.ERROR_NAMES.get(st["last_error"], st["last_error"])
        return st

    def trace(self) -> list[SyncRecord]:
        return list(self._digest.records)

    def stats(self) -> dict:
        link = dict(self.link)
        link["wire_efficiency"] = round(link["payload_tx"] / link["bytes_tx"], 4) if link["bytes_tx"] else None
        link["fragment_budget"] = {"now": self.budget, "min": self.budget_min_seen, "max": self.budget_max}
        out = {"instructions": dict(self._counts), "link": link, "port": self.url or self.port, "baud": self.baud, "board": self.board}
        if self.proc is not None or (self.port is None and self.url):
            out["emulator"] = {"device": self.device_name, "faults": self.faults or "none", "rtl": self.rtl}
        if self.load_bytes:
            out["load"] = {"bytes": self.load_bytes, "seconds": round(self.load_seconds, 3), "MB_per_s": round(self.load_bytes / max(self.load_seconds, 1e-9) / 1e6, 2),
                           "reloads": {**self.reloads, "seconds": round(self.reloads["seconds"], 3)}}
        if self.info:
            out["board"] = {"name": self.info.get("board"), "backend": self.info.get("backend"), "max_payload": self.max_payload, "max_message": self.max_message}
        return out
