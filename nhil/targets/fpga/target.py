"""``FpgaTarget``, the ``fpga`` execution target: load, reload, execute and rows over a link session.

The host side of the FPGA link is three layers (``docs/link-protocol.md`` section 0):

* ``transport.py``: the only code that touches a port (pyserial URL, or an in-memory pair);
* ``session.py`` (with ``bulk.py``): framing, ARQ, timeouts, counters, the replay guard;
* this module: the :class:`~nhil.targets.base.Target` interface in requests of the protocol.

Without a port the target starts a board emulator on a pseudo-terminal (``launch.py``).
Later loads of the same program keep the weight rows the board still holds, checked by CRC
(:meth:`FpgaTarget.reload`, section 4a). Link failures raise the errors of ``errors.py``
(all :class:`~nhil.errors.LinkError`, outcome ``LINK_FAIL``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref
import zlib

import numpy as np

from nhil.errors import LoadError, RunError, SetupError
from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import OPINFO, Op
from nhil.isa.program import Program
from nhil.targets.base import Capabilities, ReadbackDigest, ResolvedInstr, SyncRecord, Target, check_program_fits
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga import stream as S
from nhil.targets.fpga.errors import ProtocolViolation
from nhil.targets.fpga.frame import crc32
from nhil.targets.fpga.launch import start_emulator, stop_emulator
from nhil.targets.fpga.progress import LoadProgress
from nhil.targets.fpga.session import DEFAULT_BAUD, Session
from nhil.targets.fpga.transport import Transport, open_serial

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
        transport: an open :class:`~nhil.targets.fpga.transport.Transport` to use instead of a port
            (e.g. one end of ``transport.memory_pair()``; ``close`` closes it).
    """

    name = "fpga"

    def __init__(self, port: str | None = None, baud: int | None = None, device: str | DeviceConfig | None = "aim-like", faults: str | None = None, *,
                 rtl: bool = False, open_timeout: float = 10.0, frame_timeout: float = 0.5, run_timeout: float = 60.0, max_retries: int = 32,
                 chunk_bytes: int = 65536, max_fragment: int | None = None, progress: bool | None = None, board: str | None = None,
                 transport: Transport | None = None, **_ignored) -> None:
        self.board = board or os.environ.get("FPGA_BOARD") or None
        if self.board:
            from nhil.boards import get_board

            b = get_board(self.board)
            port, baud, device = b.url, b.baud, b.device
        self.port = port or (transport.url if transport is not None else None) or os.environ.get("FPGA_PORT") or None
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
        self.run_timeout = run_timeout
        self.chunk_bytes = max(2, chunk_bytes & ~1)
        self.progress = progress
        self._transport = transport  # given by the caller (opened by open() otherwise)
        self.session = Session(baud=self.baud, open_timeout=open_timeout, frame_timeout=frame_timeout, run_timeout=run_timeout,
                               max_retries=max_retries, max_fragment=max_fragment)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.info: dict = {}
        self._caps: Capabilities | None = None
        self._digest = ReadbackDigest()
        self._counts: dict[str, int] = {}
        self.load_seconds = 0.0
        self.load_bytes = 0
        self._words: dict = {}  # Instr -> encoded word (the same instructions recur every step)
        self._resident = None  # (weakref to the program loaded last, its MEM_CRC pieces) while the board holds it
        self.reloads = {"full": 0, "warm": 0, "mismatch": 0, "seconds": 0.0}

    @property
    def link(self) -> dict:
        """The session's link counters (``session.COUNTERS``)."""
        return self.session.link

    # ------------------------------------------------------------ session
    def open(self) -> None:
        """Open the port (starting an emulator when there is none), HELLO, then INFO for the capabilities.

        Raises:
            LinkError: (``errors.py``) the port, the emulator or the handshake failed.
        """
        if self.session.transport is not None:
            return
        try:
            transport, self._transport = self._transport, None
            if transport is None:
                if self.port is None:
                    self.proc, self.url = start_emulator(self.device_name, self.faults, self.rtl, timeout=900.0 if self.rtl else 20.0)  # RTL: first build
                    weakref.finalize(self, stop_emulator, self.proc)
                else:
                    self.url = self.port
                transport = open_serial(self.url, self.baud, write_timeout=max(10.0, self.run_timeout))
            else:
                self.url = transport.url
            self.session.open(transport)
            self._read_info()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.session.close()
        if self.proc is not None:
            stop_emulator(self.proc)
            self.proc = None

    def _read_info(self) -> None:
        f = self.session.transact(P.INFO, b"", P.INFO_REPLY, reply_size=4096)
        try:
            info = json.loads(f.payload.decode())
            dev = DeviceConfig.from_dict(info["device"])
            ops = frozenset(Op[o] for o in info["ops"])
            caps = Capabilities(int(info["isa_version"]), ops, frozenset(str(x) for x in info["formats"]), dev)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise ProtocolViolation(f"board at {self.url}: malformed INFO reply ({type(e).__name__}: {e})") from None
        self.info = info
        self._caps = caps

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
        s = self.session
        imgs = [img for img in program.bank_images if img.data is not None]
        total = sum(int(img.data.size) * 2 for img in imgs)
        t0 = time.monotonic()
        s.transact(P.LOAD_PROGRAM, P.pack_load_program(len(imgs)), P.ACK)
        crc = 0
        nbytes = nwrites = 0
        self._resident = None
        kept: dict[int, np.ndarray] = {}  # row -> image of the rows with non-zero images (what a warm reload keeps)
        with LoadProgress(total, self.progress, s.link) as bar:
            for img in imgs:
                flat = np.ascontiguousarray(img.data, dtype="<u2").reshape(-1)
                if flat.size != d.channels * d.banks * d.cols:
                    raise LoadError(f"bank image row {img.row} has {flat.size} elements, device rows hold {d.channels * d.banks * d.cols}")
                if flat.any():
                    kept[img.row] = flat
                # once the line is known to be noisy (messages travel as short-frame streams), one message per
                # max_message bytes saves the stop-and-wait begin and end of each 64 KiB chunk (decided per row)
                noisy = s.known_noisy(below=self.chunk_bytes)
                chunk = max(1, min(s.max_message if noisy else self.chunk_bytes, s.max_message - 8, S.MAX_OFFSET) // 2)
                for off in range(0, flat.size, chunk):
                    seg = flat[off : off + chunk]
                    if seg.any():  # the board's memory is zero after LOAD_PROGRAM
                        pl = P.pack_write_mem(img.row, off, seg.tobytes())
                        s.transact(P.WRITE_MEM, pl, P.ACK)
                        crc = zlib.crc32(pl, crc)
                        nbytes += len(pl)
                        nwrites += 1
                    bar.advance(seg.size * 2)
        s.transact(P.LOAD_END, P.pack_load_end(nbytes, nwrites, crc), P.ACK)
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
        if res is None or res[0]() is not program or self.session.dead:
            self.load(program)
            return
        pieces = res[1]
        ranges = _row_ranges(pieces)
        if len(ranges) > P.MAX_KEEP_RANGES:
            self.load(program)
            return
        t0 = time.monotonic()
        s = self.session
        s.transact(P.RESET, P.pack_reset(ranges), P.ACK)
        bad = []
        for row, count, want in pieces:
            got = P.unpack_mem_crc_reply(s.transact(P.MEM_CRC, P.pack_mem_crc(row, count), P.MEM_CRC_REPLY, reply_size=4).payload)
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
        max_message = self.session.max_message
        limit = max_message - 4
        cur, size, rsize = [], 0, 0
        for r in block:
            pl = b"" if r.payload is None else np.ascontiguousarray(r.payload, dtype=P.payload_dtype(r.instr.op)).tobytes()
            isz = P.exec_item_bytes(len(pl))
            rb = P.readback_bytes(r.instr.op, r.instr.n, lanes) if OPINFO[r.instr.op].data_out else 0
            if cur and (size + isz > limit or rsize + rb > limit):
                yield cur, rsize
                cur, size, rsize = [], 0, 0
            if isz > limit or rb > limit:
                raise RunError(f"instruction {r.index} ({r.instr.op.name}) needs {max(isz, rb)} bytes in one message, the board's max message is {max_message}")
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
            f = self.session.transact(P.EXEC, P.pack_exec(items), P.READBACK, reply_size=4 + rsize)
            try:
                rbs = P.unpack_readback(f.payload)
            except P.ProtocolError as e:
                raise ProtocolViolation(f"malformed READBACK from the board: {e}") from None
            outs = [r for r, _ in group if OPINFO[r.instr.op].data_out]
            if len(rbs) != len(outs):
                raise ProtocolViolation(f"protocol violation: EXEC of {len(group)} instructions returned {len(rbs)} readbacks, expected {len(outs)}")
            for r, a in zip(outs, rbs):
                want = (r.instr.n, np.float32) if r.instr.op is Op.RD_ACC else (r.instr.n * lanes, np.uint16)
                if a.size != want[0] or a.dtype != want[1]:
                    raise ProtocolViolation(f"protocol violation: readback of instruction {r.index} ({r.instr.op.name}) is {a.size} x {a.dtype}, expected {want[0]} x {np.dtype(want[1])}")
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
        f = self.session.transact(P.READ_MEM, P.pack_read_mem(row, (ch * d.banks + bank) * d.cols, d.cols), P.MEM_DATA, reply_size=2 * d.cols)
        if len(f.payload) != 2 * d.cols:
            raise ProtocolViolation(f"protocol violation: READ_MEM of {d.cols} elements returned {len(f.payload)} bytes")
        return np.frombuffer(f.payload, dtype="<u2").astype(np.uint16)

    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        d = self._check_bank(ch, bank)
        a = np.ascontiguousarray(data, dtype="<u2").reshape(-1)
        if a.size != d.cols:
            raise RunError(f"write_row needs {d.cols} elements, got {a.size}")
        self.session.transact(P.WRITE_MEM, P.pack_write_mem(row, (ch * d.banks + bank) * d.cols, a.tobytes()), P.ACK)

    def status(self) -> dict:
        """The board's STATUS counters (one round trip)."""
        return self.session.status()

    def trace(self) -> list[SyncRecord]:
        return list(self._digest.records)

    def stats(self) -> dict:
        s = self.session
        out = {"instructions": dict(self._counts), "link": s.link_stats(), "port": self.url or self.port, "baud": self.baud, "board": self.board}
        if self.proc is not None or (self.port is None and self.url):
            out["emulator"] = {"device": self.device_name, "faults": self.faults or "none", "rtl": self.rtl}
        if self.load_bytes:
            out["load"] = {"bytes": self.load_bytes, "seconds": round(self.load_seconds, 3), "MB_per_s": round(self.load_bytes / max(self.load_seconds, 1e-9) / 1e6, 2),
                           "reloads": {**self.reloads, "seconds": round(self.reloads["seconds"], 3)}}
        if self.info:
            out["board"] = {"name": self.info.get("board"), "backend": self.info.get("backend"), "max_payload": s.max_payload, "max_message": s.max_message}
        return out
