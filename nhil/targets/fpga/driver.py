"""Host side of the FPGA link: ``FpgaTarget``, the ``fpga`` execution target.

Stop-and-wait request/reply over any pyserial URL (``/dev/ttyUSB0``, ``rfc2217://host:port``,
``socket://host:port``, ``loop://``), protocol v2 in ``docs/link-protocol.md``. Every frame
is retransmitted (same seq, bounded retries, exponential backoff of the reply timeout)
until its reply arrives; the board answers a repeated seq from its reply cache, so nothing
executes twice. Requests over 64 bytes travel as fragmented messages (MSG_BEGIN / MSG_DATA /
MSG_ZERO) and large replies are fetched in pieces (REPLY_HEAD / FETCH); the fragments between
MSG_BEGIN and the last one, and the FETCHes, go in selective-repeat windows of up to 512 frames
closed by MSG_QUERYs that list the missing ranges, and only what is missing is sent again. The
fragment size and the window adapt to the line, so a line that corrupts 1% of its bytes still
carries data at a good fraction of what its frames allow. A changed board session nonce, or an
``E_SESSION`` error, means the board was reset mid-session: that ends the run with
``LinkError`` (state is gone), never a retry.
"""

from __future__ import annotations

import collections
import json
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
from nhil.targets.fpga.fragment import ZERO_RUN_MIN, plan_fragment, zero_runs
from nhil.targets.fpga.frame import BAD_CRC, DEFAULT_MAX_PAYLOAD, END, OVERHEAD, Bad, Deframer, Frame, crc32, encode_frame

DEFAULT_BAUD = 3_000_000
COUNTERS = (
    "frames_tx", "frames_rx", "bytes_tx", "bytes_rx", "payload_tx", "payload_rx", "crc_errors", "framing_errors",
    "naks", "retries", "resyncs", "timeouts", "stale_replies", "duplicate_replies", "board_errors",
    "messages", "fragments", "zero_bytes", "fetches", "shrinks", "grows", "msg_crc_errors", "reply_crc_errors",
)
DIRECT_MAX = 64  # requests with a larger payload travel as fragmented messages
MIN_FRAGMENT = 16  # smallest fragment data budget (bytes)
GROW, SHRINK = 1.5, 0.8  # budget x GROW after a good exchange, x SHRINK**k after the k-th failure in a row
MIN_RTO = 0.02  # seconds: floor of the adaptive reply timeout
WINDOW = 16  # first and smallest window: fragments (or FETCHes) sent back to back before waiting (section 6)
WINDOW_MAX = 512  # largest window (the board keeps up to 1024 received ranges, fragment.MAX_RANGES)
QUERY_EVERY = 8  # one MSG_QUERY per this many fragments of a window, starting at that fragment
PER_FRAME_S = 0.0001  # allowance for the board to process one frame of a window (the emulator takes ~20 us)
QUERY_COPIES = 2  # copies of each range MSG_QUERY closing a window
QUERY_LAST_COPIES = 4  # plain MSG_QUERYs (8-byte reply) after them
QUERY_RANGES = 2  # missing ranges asked per MSG_QUERY (a short reply survives a noisy line)
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


def _subtract(ranges: list[tuple[int, int]], done: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges ``ranges`` minus the ranges ``done`` (both half-open), in order."""
    out = []
    for lo, hi in ranges:
        cuts = sorted((max(lo, a), min(hi, b)) for a, b in done if a < hi and b > lo)
        for a, b in cuts:
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            out.append((lo, hi))
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
    """

    name = "fpga"

    def __init__(self, port: str | None = None, baud: int | None = None, device: str | DeviceConfig | None = "aim-like", faults: str | None = None, *,
                 rtl: bool = False, open_timeout: float = 10.0, frame_timeout: float = 0.5, run_timeout: float = 60.0, max_retries: int = 32,
                 chunk_bytes: int = 65536, max_fragment: int | None = None, progress: bool | None = None, **_ignored) -> None:
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
        self.window = WINDOW  # frames per selective-repeat window (adapts, section 6)
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
                if isinstance(ev, Bad):
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
        try:
            self.ser.write(data)
        except NhilError:  # e.g. verify's stage timeout interrupting the write: keep its outcome (TIMEOUT)
            raise
        except Exception as e:  # SerialException, SerialTimeoutException, OSError
            raise LinkError(f"write to {self.url} failed: {e}") from None
        self.link["frames_tx"] += 1
        self.link["bytes_tx"] += len(data)
        self.link["payload_tx"] += payload_bytes

    def _recv(self, deadline: float) -> Frame | Bad | None:
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
            if not data:
                continue
            self.link["bytes_rx"] += len(data)
            for ev in self._rx.feed(data):
                if isinstance(ev, Bad):
                    self.link["resyncs"] += 1
                    self.link["crc_errors" if ev.reason == BAD_CRC else "framing_errors"] += 1
                else:
                    self.link["frames_rx"] += 1
                    self.link["payload_rx"] += len(ev.payload)
                self._q.append(ev)
        return self._q.popleft()

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
            bad = 0
            while True:
                ev = self._recv(deadline)
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
                    deadline = time.monotonic() + self.run_timeout
                    accepted = True
                    continue
                if attempt == 0 and not accepted and copies == 1:
                    self._rtt_sample(time.monotonic() - t_sent)
                self._adapt(True)
                return ev
            self._adapt(False)
        raise LinkError(f"{name} (seq {seq}) got no valid reply from {self.url} after {self.max_retries} attempts (last: {why}); link: {self._brief()}")

    def _burst(self, reqs: list[tuple[int, bytes]], name: str, copies: int = 1,
               tail: list[tuple[int, bytes]] | None = None, tail_copies: int = 2) -> tuple[dict[int, Frame], dict[int, Frame]]:
        """Send ``reqs`` (type, payload) back to back, each with a fresh seq in ``copies`` copies, then the ``tail``
        requests (default one MSG_QUERY) in ``tail_copies`` copies each.

        Collects replies until the last tail request's reply (the board answers in order, so everything it
        sent for the burst has arrived by then), a short grace after any tail reply, or the reply timeout.
        Returns ({request index: first valid reply}, {tail index: first valid reply}). Never raises for
        lost frames: the caller re-sends what is missing.
        """
        if self.ser is None:
            raise LinkError("the fpga target is not open")
        if self._dead:
            raise LinkError(self._dead)
        tail = [(P.MSG_QUERY, b"")] if tail is None else tail
        seqs: dict[int, int] = {}
        out = []
        nbytes = 0
        for i, (t, pl) in enumerate([*reqs, *tail]):
            self._seq = (self._seq % 0xFFFF) + 1
            seqs[self._seq] = i
            fr = encode_frame(t, 0, self._seq, self.board_nonce, pl) + _END_B
            c = copies if i < len(reqs) else tail_copies
            out.append(fr * c)
            nbytes += c * (len(fr) + (self.budget if t == P.FETCH else 16))
        wire = b"".join(out)
        self._write(wire, copies * sum(len(pl) for _, pl in reqs) + tail_copies * sum(len(pl) for _, pl in tail))
        self.link["frames_tx"] += copies * len(reqs) + tail_copies * len(tail) - 1
        last = len(reqs) + len(tail) - 1
        got: dict[int, Frame] = {}
        t_sent = time.monotonic()
        deadline = t_sent + self._rto(nbytes + 64)
        grace = 0.002
        nframes = copies * len(reqs) + tail_copies * len(tail)
        per_frame = PER_FRAME_S + 10 * (len(wire) / nframes + 32) / self.baud  # board time + wire time of one more reply
        while True:
            ev = self._recv(deadline)
            if ev is None:
                if not got:
                    self.link["timeouts"] += 1
                break
            if isinstance(ev, Bad):
                continue
            if ev.nonce != self.board_nonce:
                self._dead = f"board reset detected during {name}: its session nonce changed from 0x{self.board_nonce:08x} to 0x{ev.nonce:08x}; device state is lost, the run cannot continue"
                raise LinkError(self._dead)
            if ev.type in P.REQUESTS:
                continue
            if ev.type == P.NAK:
                self.link["naks"] += 1
                continue
            i = seqs.get(ev.seq)
            if i is None:
                self.link["stale_replies"] += 1
                continue
            if ev.type == P.ERROR and P.unpack_error(ev.payload)[0] == P.E_SESSION:
                self._board_error(name, ev)
            if i in got:
                self.link["duplicate_replies"] += 1
                continue
            got[i] = ev
            if i == last:
                if len(got) == 1 or max(j for j in got if j != last) < len(reqs):
                    self._rtt_sample(time.monotonic() - t_sent)
                break
            # the board answers in order: once reply i is here, the later ones follow as fast as it processes frames
            deadline = min(deadline, time.monotonic() + grace + (last - i) * per_frame)
        return {i: f for i, f in got.items() if i < len(reqs)}, {i - len(reqs): f for i, f in got.items() if i >= len(reqs)}

    def _adapt_burst(self, done: int, sent: int) -> None:
        """Budget and window after a burst. With selective repeat a lost frame wastes only itself, so the
        fragment size aims at about half of the frames getting through (the goodput optimum of
        ``L (1-p)^(L+overhead)`` is near a delivery rate of 1/e): grow when at least 50% did, shrink below
        25%. The window doubles after a burst with progress (up to ``WINDOW_MAX``) and halves without."""
        if done >= 0.5 * sent:
            self._adapt(True)
        elif done < 0.25 * sent:
            self._fails = 0
            self._adapt(False)
        self.window = min(WINDOW_MAX, self.window * 2) if done else max(WINDOW, self.window // 2)

    def _query(self, name: str) -> tuple[int, int]:
        """(received, total) of the board's open message, stop-and-wait."""
        ev = self._exchange(P.MSG_QUERY, lambda _b: b"", 0, f"{name} (MSG_QUERY)")
        if ev.type == P.ERROR:
            self._board_error(f"{name} (MSG_QUERY)", ev)
        if ev.type != P.FRAG_ACK:
            raise LinkError(f"protocol violation: MSG_QUERY answered with {P.NAMES.get(ev.type, hex(ev.type))}")
        return P.unpack_frag_ack(ev.payload)

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
        """Send ``payload`` as MSG_BEGIN + MSG_DATA/MSG_ZERO fragments sized by the current budget.

        Returns the inner request's reply (the reply to the completing fragment). A message the
        board reports as E_MSG_CRC is sent again (3 times at most).
        """
        total = len(payload)
        crc = crc32(payload)
        runs_all = zero_runs(payload, ZERO_RUN_MIN)
        lens = runs_all[:, 1] - runs_all[:, 0]
        self.link["messages"] += 1
        for _ in range(3):
            pos = 0
            begun = False
            stalls = 0
            while True:
                # kind and extent are fixed at the first attempt; a retransmission may only carry fewer data bytes
                kind, a, e = plan_fragment(total, runs_all[lens >= max(ZERO_RUN_MIN, self.budget // 2)], pos, self.budget)
                if begun and e < total:  # not the last fragment: stream the middle selectively, then finish in order
                    pos = self._stream(payload, total, runs_all, lens, pos, name)
                    continue
                if not begun:
                    t, end = P.MSG_BEGIN, (e if kind == "data" else pos)
                    make = lambda b, end=end: P.pack_msg_begin(type_, total, crc, payload[: min(end, max(1, b))])
                elif kind == "zero":
                    t, zero = P.MSG_ZERO, P.pack_msg_zero(a, e - a)
                    make = lambda _b, zero=zero: zero
                else:
                    t = P.MSG_DATA
                    make = lambda b, a=a, e=e: P.pack_msg_data(a, payload[a : min(e, a + max(1, b))])
                ev = self._exchange(t, make, reply_size, f"{name} ({P.NAMES[t]} @{pos}/{total})")
                self.link["fragments"] += 1
                if t == P.MSG_ZERO:
                    self.link["zero_bytes"] += e - a
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

    def _stream(self, payload: bytes, total: int, runs_all: np.ndarray, lens: np.ndarray, pos: int, name: str) -> int:
        """Selective repeat of a message's middle (section 6): fragments of ``[pos, tail)`` go in windows of up to
        ``self.window`` frames, each window closed by MSG_QUERYs asking for the missing ranges; only fragments not
        known to be held are sent again, always with their first boundaries (so a repeat is an exact duplicate).
        ``tail`` is the start of the fragment that would end the message; it is never sent here, so the
        message cannot complete inside a window. Returns ``tail``: every byte before it is held by the board.

        Raises:
            LinkError: no progress in ``max_retries`` windows, the board lost the message, protocol violation.
        """
        outstanding: list[tuple[int, int, int, bytes]] = []  # (start, end, type, payload) sent, not known held
        frontier = pos
        stalls = 0
        while True:
            # a fragment planned when the budget was larger is cut to the budget: each piece lies inside a fragment
            # the board holds entirely or not at all, so a piece is new bytes or an exact duplicate, never an overlap
            if any(t == P.MSG_DATA and e - a > self.budget for a, e, t, _ in outstanding):
                b = max(1, self.budget)
                outstanding = [piece for a, e, t, pl in outstanding for piece in (
                    [(x, min(e, x + b), t, P.pack_msg_data(x, payload[x : min(e, x + b)])) for x in range(a, e, b)]
                    if t == P.MSG_DATA and e - a > b else [(a, e, t, pl)])]
            frags = outstanding[: self.window]
            new = 0
            while len(frags) < self.window and frontier < total:
                kind, a, e = plan_fragment(total, runs_all[lens >= max(ZERO_RUN_MIN, self.budget // 2)], frontier, self.budget)
                if e >= total:
                    break
                fr = (a, e, P.MSG_ZERO, P.pack_msg_zero(a, e - a)) if kind == "zero" else (a, e, P.MSG_DATA, P.pack_msg_data(a, payload[a:e]))
                frags.append(fr)
                outstanding.append(fr)
                frontier = e
                new += 1
            if not frags:
                return frontier
            starts = sorted({frags[k][0] for k in range(0, len(frags), QUERY_EVERY)})
            # the last query is a plain one (short reply, more copies): its arrival ends the wait for the window
            tail = [(P.MSG_QUERY, P.pack_msg_query(s, QUERY_RANGES)) for s in starts] + [(P.MSG_QUERY, b"")] * QUERY_LAST_COPIES
            got, answers = self._burst([(t, pl) for _, _, t, pl in frags], name, copies=1, tail=tail, tail_copies=QUERY_COPIES)
            known = set()
            for i, ev in got.items():
                if ev.type == P.FRAG_ACK:
                    rec, tot = P.unpack_frag_ack(ev.payload)
                    if tot != total:
                        raise LinkError(f"protocol violation: {name}: fragment [{frags[i][0]}, {frags[i][1]}) acknowledged for a message of {tot} bytes, not {total}")
                    known.add(i)
                elif ev.type == P.ERROR:
                    if P.unpack_error(ev.payload)[0] != P.E_FRAGMENT:
                        self._board_error(name, ev)
                else:
                    raise LinkError(f"protocol violation: {name}: fragment [{frags[i][0]}, {frags[i][1]}) of {total} answered with {P.NAMES.get(ev.type, hex(ev.type))}")
            for j, ev in answers.items():
                if j >= len(starts):
                    continue  # the plain closing query
                if ev.type == P.ERROR:
                    self._board_error(f"{name} (MSG_QUERY)", ev)
                try:
                    rec, tot, miss = P.unpack_frag_ack_missing(ev.payload) if ev.type == P.FRAG_ACK else (0, -1, [])
                except P.ProtocolError as err:
                    raise LinkError(f"protocol violation: {name} (MSG_QUERY): {err}") from None
                if tot != total:
                    raise LinkError(f"protocol violation: {name}: the board holds no {total}-byte message any more "
                                    f"(MSG_QUERY answered {P.NAMES.get(ev.type, hex(ev.type))} {rec}/{tot}); it was discarded mid-transfer")
                lo = starts[j]
                horizon = total if len(miss) < QUERY_RANGES else miss[-1][1]
                for i, (a, e, _, _) in enumerate(frags):
                    if lo <= a and e <= horizon and not any(ml < e and a < mh for ml, mh in miss):
                        known.add(i)
            sent_again = len(frags) - new
            self.link["fragments"] += new
            self.link["retries"] += sent_again
            self.link["zero_bytes"] += sum(e - a for k, (a, e, t, _) in enumerate(frags) if t == P.MSG_ZERO and k in known)
            done = {frags[i][0] for i in known}
            outstanding = [f for f in outstanding if f[0] not in done]
            self._adapt_burst(len(known), len(frags))
            stalls = 0 if known else stalls + 1
            if stalls >= self.max_retries:
                raise LinkError(f"{name}: no fragment of [{pos}, {frontier}) of {total} got through in {stalls} windows; link: {self._brief()}")

    def _fetch(self, head: Frame, name: str) -> Frame:
        """Read a REPLY_HEAD's reply with FETCHes of the current budget; check its CRC (3 tries)."""
        try:
            rtype, total, crc = P.unpack_reply_head(head.payload)
        except P.ProtocolError as e:
            raise LinkError(f"protocol violation: {e}") from None
        if total > self.max_message:
            raise LinkError(f"protocol violation: {name} reply of {total} bytes exceeds the board's max message {self.max_message}")
        for _ in range(3):
            buf = bytearray(total)
            missing = [(0, total)]  # byte ranges still to fetch
            stalls = 0
            while missing:
                reqs, want = [], []
                for lo, hi in missing:
                    while lo < hi and len(reqs) < self.window:
                        n = min(hi - lo, max(1, self.budget))
                        reqs.append((P.FETCH, P.pack_fetch(lo, n)))
                        want.append((lo, n))
                        lo += n
                got, _ = self._burst(reqs, f"{name} (FETCH)", copies=self._copies(), tail_copies=2 * self._copies())
                self.link["fetches"] += len(reqs)
                filled = []
                for i, ev in got.items():
                    if ev.type == P.ERROR:
                        self._board_error(f"{name} (FETCH)", ev)
                    lo, n = want[i]
                    try:
                        off, data = P.unpack_reply_data(ev.payload) if ev.type == P.REPLY_DATA else (None, b"")
                    except P.ProtocolError as e:
                        raise LinkError(f"protocol violation: {e}") from None
                    if ev.type != P.REPLY_DATA or off != lo or not 0 < len(data) <= n:
                        raise LinkError(f"protocol violation: FETCH at {lo} of a {total}-byte reply answered with {P.NAMES.get(ev.type, hex(ev.type))} at {off} ({len(data)} bytes)")
                    buf[lo : lo + len(data)] = data
                    filled.append((lo, lo + len(data)))
                self._adapt_burst(len(filled), len(reqs))
                self.link["retries"] += len(reqs) - len(filled)
                missing = _subtract(missing, filled)
                stalls = 0 if filled else stalls + 1
                if stalls >= self.max_retries:
                    raise LinkError(f"{name}: FETCH of a {total}-byte reply made no progress in {stalls} bursts; link: {self._brief()}")
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
        chunk = max(1, min(self.chunk_bytes, self.max_message - 8) // 2)
        crc = 0
        nbytes = nwrites = 0
        show = self.progress if self.progress is not None else (total > (8 << 20) and sys.stderr.isatty())
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
                for off in range(0, flat.size, chunk):
                    seg = flat[off : off + chunk]
                    if seg.any():  # the board's memory is zero after LOAD_PROGRAM
                        pl = P.pack_write_mem(img.row, off, seg.tobytes())
                        self._transact(P.WRITE_MEM, pl, P.ACK)
                        crc = zlib.crc32(pl, crc)
                        nbytes += len(pl)
                        nwrites += 1
                    if bar is not None:
                        bar.update(task, advance=seg.size * 2)
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
        out = {"instructions": dict(self._counts), "link": link, "port": self.url or self.port, "baud": self.baud}
        if self.proc is not None or (self.port is None and self.url):
            out["emulator"] = {"device": self.device_name, "faults": self.faults or "none", "rtl": self.rtl}
        if self.load_bytes:
            out["load"] = {"bytes": self.load_bytes, "seconds": round(self.load_seconds, 3), "MB_per_s": round(self.load_bytes / max(self.load_seconds, 1e-9) / 1e6, 2),
                           "reloads": {**self.reloads, "seconds": round(self.reloads["seconds"], 3)}}
        if self.info:
            out["board"] = {"name": self.info.get("board"), "backend": self.info.get("backend"), "max_payload": self.max_payload, "max_message": self.max_message}
        return out
