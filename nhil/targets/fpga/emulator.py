"""Board emulator: the device side of the link protocol, executing with the functional simulator.

``Board`` is the protocol state machine (transport independent): feed it received bytes
with a ``send`` callback and it answers. ``serve_fd`` runs it on a file descriptor (the
master side of a pseudo-terminal, or a TCP connection). The emulator trusts nothing
from the wire: every length, row, offset, count and instruction field is checked
against the device's real sizes before memory is touched, and any failure becomes an
ERROR reply (or a NAK for frames that cannot be trusted) while the board keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
import time
import zlib
from typing import Callable

import numpy as np

from nhil.errors import NhilError, ProgramFormatError, RunError, SetupError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, OPINFO, Instr, Op
from nhil.targets.base import DEVICE_OPS, ResolvedInstr
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.faults import FaultInjector, FaultSpec
from nhil.targets.fpga.fragment import QUERY_MAX_RANGES, Reassembler, ReassemblyError, ReplyBuffer
from nhil.targets.fpga import stream as S
from nhil.targets.fpga.replay import ReplyWindow
from nhil.targets.fpga.frame import DEFAULT_MAX_PAYLOAD, END, Bad, Deframer, Frame, Short, encode_frame
from nhil.targets.sim.device import PimState

MAX_RESERVE_ROWS = 1024  # cap on the row pre-allocation a LOAD_PROGRAM hint may ask for
DEFAULT_MAX_MESSAGE = 1 << 20  # reassembly / reply buffer of the emulated board (bytes)
_END_B = bytes([END])


def board_formats(d: DeviceConfig) -> frozenset[str]:
    """Weight formats the board claims in INFO: exactly the RTL's (``nhil.targets.rtl.target.rtl_formats``),
    whichever backend executes (the board is that RTL on an FPGA; the simulator backend stands in for it)."""
    from nhil.targets.rtl.target import rtl_formats

    return rtl_formats(d)


class ReqError(Exception):
    """A request the device refuses: becomes ``ERROR code message``."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class SimBackend:
    """Device memory and execution on :class:`PimState`."""

    name = "sim"

    def __init__(self, device: DeviceConfig) -> None:
        self.d = device
        self.state = PimState(device)

    def reset(self, rows_hint: int = 0) -> None:
        self.state = PimState(self.d, reserve_rows=min(rows_hint, MAX_RESERVE_ROWS) + 8)

    def _segments(self, offset: int, count: int):
        """(ch, bank, col0, col1, i0) pieces of the element range [offset, offset+count) of a row image."""
        cols = self.d.cols
        pos = offset
        end = offset + count
        while pos < end:
            cb, c0 = divmod(pos, cols)
            c1 = min(cols, c0 + end - pos)
            yield cb // self.d.banks, cb % self.d.banks, c0, c1, pos - offset
            pos += c1 - c0

    def write(self, row: int, offset: int, data: np.ndarray) -> None:
        s = self.state.slot(row, allocate=True)
        self.state.drop_decoded(s)
        mem = self.state.mem
        for ch, bank, c0, c1, i0 in self._segments(offset, data.size):
            mem[ch, bank, s, c0:c1] = data[i0 : i0 + c1 - c0]

    def read(self, row: int, offset: int, count: int) -> np.ndarray:
        out = np.zeros(count, np.uint16)
        s = self.state.slot(row, allocate=False)
        if s >= 0:
            mem = self.state.mem
            for ch, bank, c0, c1, i0 in self._segments(offset, count):
                out[i0 : i0 + c1 - c0] = mem[ch, bank, s, c0:c1]
        return out

    def reset_keep(self, keep: np.ndarray) -> None:
        """RESET with RESET_KEEP_ROWS: rows where ``keep`` (bool ``[rows]``) is set stay, the rest read as zero."""
        self.state.reset_keep(keep)

    def mem_crc(self, row: int, count: int) -> int:
        """CRC-32 (zlib) of the row images of rows ``[row, row + count)``, each ``[channel][bank][col]`` uint16 LE."""
        crc = 0
        zero = None
        st = self.state
        for r in range(row, row + count):
            if st.slot(r, allocate=False) < 0:
                if zero is None:
                    zero = bytes(self.d.channels * self.d.banks * self.d.cols * 2)
                crc = zlib.crc32(zero, crc)
            else:
                crc = zlib.crc32(st.row_image(r).astype("<u2", copy=False), crc)
        return crc & 0xFFFFFFFF

    def commit(self) -> None:
        """End of a load (nothing to do for the simulator)."""

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        out = []
        for idx, ins, pl in block:
            r = self.state.step(idx, ins, pl)
            if r is not None:
                out.append(r)
        return out

    def instructions(self) -> int:
        return sum(self.state.counts.values())


class RtlBackend(SimBackend):
    """Executes EXEC blocks on the RTL target; a PimState mirror collects the loaded image."""

    name = "rtl"

    def __init__(self, device: DeviceConfig) -> None:
        super().__init__(device)
        try:
            from nhil.targets.rtl import RtlTarget
        except ImportError as e:
            raise SetupError(f"the RTL target is not available ({e}); run the emulator without --rtl") from None
        self.rtl = RtlTarget(device=device)
        self.rtl.open()
        self.loaded = False
        self.n = 0

    def reset(self, rows_hint: int = 0) -> None:
        super().reset(rows_hint)
        self.loaded = False

    def reset_keep(self, keep: np.ndarray) -> None:
        # the mirror holds every row the host wrote (the RTL only changes rows when it runs): clear it like the
        # simulator and hand the whole image to the RTL again before the next EXEC (which also clears GB/ACC/CFRs)
        super().reset_keep(keep)
        self.loaded = False

    def commit(self) -> None:
        from nhil.isa.program import BankImage, Program

        st = self.state
        imgs = [BankImage(int(r), st.mem[:, :, int(s)].copy()) for r, s in enumerate(st.row_slot) if s >= 0]
        self.rtl.load(Program(self.d, [], [], [], {}, imgs, {}, {"inputs": {}, "outputs": {}}, {}))
        self.loaded = True

    def write(self, row: int, offset: int, data: np.ndarray) -> None:
        super().write(row, offset, data)
        if self.loaded:
            for ch, bank, _c0, _c1, _i0 in self._segments(offset, data.size):
                self.rtl.write_row(ch, bank, row, super().read(row, (ch * self.d.banks + bank) * self.d.cols, self.d.cols))

    def read(self, row: int, offset: int, count: int) -> np.ndarray:
        if not self.loaded:
            return super().read(row, offset, count)
        out = np.zeros(count, np.uint16)
        for ch, bank, c0, c1, i0 in self._segments(offset, count):
            out[i0 : i0 + c1 - c0] = np.asarray(self.rtl.read_row(ch, bank, row))[c0:c1]
        return out

    def mem_crc(self, row: int, count: int) -> int:
        if not self.loaded:  # the mirror is the memory until the next EXEC hands it to the RTL
            return super().mem_crc(row, count)
        image = self.d.channels * self.d.banks * self.d.cols
        crc = 0
        for r in range(row, row + count):  # after EXECs the RTL holds rows the mirror never saw
            crc = zlib.crc32(self.read(r, 0, image).astype("<u2", copy=False), crc)
        return crc & 0xFFFFFFFF

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        if not self.loaded:
            self.commit()
        self.n += len(block)
        return list(self.rtl.execute(block))

    def instructions(self) -> int:
        return self.n


class Board:
    """Device side of protocol v2 (``docs/link-protocol.md``).

    Args:
        device: the device config served.
        faults: fault injection spec (applied to received and sent bytes).
        rtl: execute on the RTL target instead of the simulator.
        max_payload: largest payload accepted/sent per frame (bytes).
        max_message: largest request reassembled from fragments, and largest reply (bytes).
        log: where to report rejected frames and errors (``None``: silent).
    """

    def __init__(self, device: DeviceConfig, faults: FaultSpec | None = None, rtl: bool = False, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 max_message: int = DEFAULT_MAX_MESSAGE, log=None) -> None:
        self.d = device
        self.max_payload = max_payload
        self.max_message = max(max_message, max_payload)
        self.rtl = rtl
        self.faults = faults or FaultSpec()
        self.inj = FaultInjector(self.faults)
        self._flush = None  # set while on_bytes collects replies
        self.log = log
        self._decoded: dict[bytes, Instr] = {}  # word -> decoded Instr (valid words only)
        self.resets_done = 0
        self.t0 = time.monotonic()
        self.backend = RtlBackend(self.d) if self.rtl else SimBackend(self.d)  # the RTL simulator process outlives reboots
        self.boot()

    # ------------------------------------------------------------ lifecycle
    def boot(self) -> None:
        """Power-up: new session nonce, memory cleared, no session, empty reply cache."""
        self.nonce = int.from_bytes(os.urandom(4), "little") or 1
        self.backend.reset()
        self.deframer = Deframer(self.max_payload)
        self.reasm = Reassembler(self.max_message)
        self.replies = ReplyBuffer()
        self.session = False
        self.window = ReplyWindow()  # executed seqs of this session and their replies (replay.py)
        self.host_nonce: int | None = None  # the host nonce of the HELLO that opened the session
        self.state = 0
        self.load_crc = 0
        self.load_bytes = 0
        self.load_writes = 0
        self.counters = {"frames_ok": 0, "frames_bad": 0, "duplicates": 0, "replays": 0, "errors": 0, "last_error": 0, "short_ok": 0, "short_dropped": 0}
        self._last_fetch = -1  # qid of the last S_FETCH served (its copies get S_DONE only)
        self._bitmap: tuple = (None, b"")  # (reassembly version, query fields) -> bits of the last S_QUERY answered
        self.streaming = False  # the last intact frame was a short one: damaged runs get no NAK (section 12)

    def _log(self, msg: str) -> None:
        if self.log is not None:
            print(f"fpga-emu: {msg}", file=self.log, flush=True)

    # ------------------------------------------------------------ bytes in, frames out
    def on_bytes(self, data: bytes, send: Callable[[bytes], None]) -> None:
        """Process received bytes; ``send(wire_bytes)`` the replies they cause.

        Replies are collected and sent in one call at the end (fewer writes when a window of frames
        arrives at once), except that ACCEPTED goes out at once, before its EXEC runs.
        """
        data = self.inj.rx(data)
        out: list[bytes] = []

        def flush() -> None:
            if out:
                send(self.inj.tx_many(out))
                out.clear()

        self._flush = flush
        try:
            self._on_frames(data, out.append)
        finally:
            self._flush = None
            flush()

    def _on_frames(self, data: bytes, send: Callable[[bytes], None]) -> None:
        for ev in self.deframer.feed(data):
            if isinstance(ev, Bad):
                self.counters["frames_bad"] += 1
                if ev.seq is not None:  # CRC-valid but inconsistent: the seq is trustworthy
                    self._send(send, P.ERROR, ev.seq, P.pack_error(P.E_BAD_LENGTH, f"header length disagrees with the {ev.nbytes}-byte frame"))
                elif not self.streaming:  # inside a stream of short frames a NAK would tell the host nothing
                    self._log(f"rejected {ev.nbytes}-byte frame: {P.ERROR_NAMES.get(ev.reason, ev.reason)}")
                    self._send(send, P.NAK, self.window.hi or 0, P.pack_error(ev.reason, ""))
                continue
            self.counters["frames_ok"] += 1
            if isinstance(ev, Short):
                self.streaming = True
                self.short(ev, send)
            else:
                self.streaming = False
                self.handle(ev, send)
            if self.faults.reset_after and self.resets_done == 0 and self.counters["frames_ok"] >= self.faults.reset_after:
                self.resets_done += 1
                self._log(f"injected board reset after {self.counters['frames_ok']} frames")
                self.boot()
                self.deframer.synced = True

    def _send(self, send, type_: int, seq: int, payload: bytes = b"", flags: int = 0) -> None:
        # the extra END closes the frame even if its last END is lost on the line; faults are applied at the flush
        send(encode_frame(type_, flags, seq, self.nonce, payload) + _END_B)
        if type_ == P.ACCEPTED and self._flush is not None:
            self._flush()

    def _reply(self, send, seq: int, rtype: int, rpayload: bytes, split: bool, flags: int = 0) -> None:
        """Send a reply inline, or (request flagged F_SPLIT_REPLY, payload over INLINE_REPLY_MAX) as REPLY_HEAD for FETCH."""
        if split and len(rpayload) > P.INLINE_REPLY_MAX:
            self.replies.set(rtype, rpayload)
            self._send(send, P.REPLY_HEAD, seq, P.pack_reply_head(rtype, len(rpayload), self.replies.crc), flags)
        else:
            self._send(send, rtype, seq, rpayload, flags)

    # ------------------------------------------------------------ short frames (section 12)
    def short(self, f: Short, send) -> None:
        """A short frame: data for the open message, a bitmap query, or a fetch of buffered reply cells.

        Short frames never get an ERROR: one that does not parse, names another message (tag), arrives
        without a session, overlaps held bytes or would complete the message is dropped and counted.
        """
        c = self.counters
        try:
            x = S.parse(f.type, f.body)
        except S.ShortError as e:
            c["short_dropped"] += 1
            self._log(f"dropped short frame: {e}")
            return
        if not self.session or f.type not in S.HOST_SHORT:
            c["short_dropped"] += 1
            return
        c["short_ok"] += 1
        if f.type == S.S_PING:
            send(_END_B + S.s_ping(x.qid, S.S_PONG))
            return
        r = self.reasm
        if f.type in (S.S_DATA, S.S_ZERO):
            if not r.open or S.tag_of(r.crc) != x.tag:
                c["short_dropped"] += 1
                return
            try:
                if f.type == S.S_DATA:
                    r.data(x.offset, x.data, complete=False)
                else:
                    r.zero(x.offset, x.count, complete=False)
            except ReassemblyError:
                c["short_dropped"] += 1
            return
        cell = 1 << x.log2cell
        if f.type == S.S_QUERY:
            if not r.open or S.tag_of(r.crc) != x.tag:
                send(_END_B + S.s_bitmap(x.qid, S.ST_GONE, b""))
                return
            key = (r.version, x.offset, x.log2cell, x.ncells)  # the host sends each query in copies: answer them alike
            if key != self._bitmap[0]:
                flags = [r.held(a, min(a + cell, r.total)) if a < r.total else False for a in range(x.offset, x.offset + x.ncells * cell, cell)]
                self._bitmap = (key, S.bits_of(flags))
            send(_END_B + S.s_bitmap(x.qid, S.ST_OK, self._bitmap[1]))
            return
        rb = self.replies  # S_FETCH: the cells of the buffered reply the host still lacks
        if rb.type is None or S.tag_of(rb.crc) != x.tag or cell + 6 > self.max_payload:
            send(_END_B + S.s_done(x.qid, S.ST_GONE, 0))
            return
        if x.qid == self._last_fetch:  # a copy of the S_FETCH just served: S_DONE only
            send(_END_B + S.s_done(x.qid, S.ST_OK, 0))
            return
        self._last_fetch = x.qid
        sent = 0
        lead = _END_B
        for i in range(x.ncells):  # one frame per send: per-frame faults hit each frame
            a = x.offset + i * cell
            if S.bit(x.want, i) and a < len(rb.data):
                send(lead + S.s_data(x.tag, a, rb.data[a : a + cell], S.S_REPLY))
                lead = b""
                sent += 1
        send(lead + S.s_done(x.qid, S.ST_OK, sent))

    # ------------------------------------------------------------ requests
    def handle(self, f: Frame, send) -> None:
        if f.type not in P.REQUESTS:
            self._error(send, f.seq, P.E_UNKNOWN_TYPE, f"unknown message type 0x{f.type:02x}")
            return
        if f.type == P.HELLO:
            try:
                proto, isa, host_nonce = P.unpack_hello(f.payload)
            except P.ProtocolError as e:
                self._error(send, f.seq, P.E_BAD_LENGTH, str(e))
                return
            if proto != P.PROTOCOL_VERSION or isa != P.ISA_VERSION:
                self._error(send, f.seq, P.E_VERSION, f"board speaks protocol v{P.PROTOCOL_VERSION} / ISA v{P.ISA_VERSION}, host asked for protocol v{proto} / ISA v{isa}")
                return
            if not (self.session and host_nonce == self.host_nonce):  # a new session (a repeated HELLO changes nothing)
                if self.session:  # frames of the old session, replayed later, carry the old nonce: refused (E_SESSION)
                    self.nonce = int.from_bytes(os.urandom(4), "little") or 1
                self.session, self.host_nonce = True, host_nonce
                self.window.clear()
                self.reasm.clear()
                self.replies = ReplyBuffer()
            self._send(send, P.HELLO_REPLY, f.seq, P.pack_hello_reply(self.nonce, self.max_payload, self.max_message))
            return
        if not self.session or f.nonce != self.nonce:
            why = "no session since power-up" if not self.session else f"request carries session nonce 0x{f.nonce:08x}"
            self._error(send, f.seq, P.E_SESSION, f"HELLO needed: {why}; board session nonce is 0x{self.nonce:08x} (the board was reset, or another host opened a new session)")
            return
        split = bool(f.flags & P.F_SPLIT_REPLY)
        if f.type == P.FETCH:  # read-only: never cached, always answered afresh (a retry may ask for fewer bytes)
            try:
                off, mx = P.unpack_fetch(f.payload)
                data = self.replies.fetch(off, min(mx, self.max_payload - P.DATA_HEADER))
            except P.ProtocolError as e:
                self._error(send, f.seq, P.E_BAD_LENGTH, str(e))
                return
            except ReassemblyError as e:
                self._error(send, f.seq, e.code, str(e))
                return
            self._send(send, P.REPLY_DATA, f.seq, P.pack_reply_data(off, data))
            return
        if f.type == P.MSG_QUERY:  # read-only, never cached: where the open message stands, and what it lacks
            try:
                start, limit = P.unpack_msg_query(f.payload)
            except P.ProtocolError as e:
                self._error(send, f.seq, P.E_BAD_LENGTH, str(e))
                return
            limit = min(limit, QUERY_MAX_RANGES, (self.max_payload - 8) // 8)
            self._send(send, P.FRAG_ACK, f.seq, P.pack_frag_ack(self.reasm.received, self.reasm.total, self.reasm.missing(start, limit)))
            return
        verdict, kept = self.window.check(f.seq, f.type)
        if verdict == "retx":
            self.counters["duplicates"] += 1
            self._reply(send, f.seq, kept[0], kept[1], split, P.F_RETX)
            return
        if verdict == "replay":  # executed at most once: refused, nothing changes, nothing is kept
            self.counters["replays"] += 1
            self._error(send, f.seq, P.E_REPLAY, kept)
            return
        try:
            rtype, rpayload = self._dispatch_msg(f, send)
        except ReassemblyError as e:
            rtype, rpayload = P.ERROR, P.pack_error(e.code, str(e))
            self.counters["errors"] += 1
            self.counters["last_error"] = e.code
            self._log(f"seq {f.seq} {P.NAMES.get(f.type)}: {P.ERROR_NAMES.get(e.code)} {e}")
        except ReqError as e:
            rtype, rpayload = P.ERROR, P.pack_error(e.code, str(e))
            self.counters["errors"] += 1
            self.counters["last_error"] = e.code
            self._log(f"seq {f.seq} {P.NAMES.get(f.type)}: {P.ERROR_NAMES.get(e.code)} {e}")
        except P.ProtocolError as e:
            rtype, rpayload = P.ERROR, P.pack_error(P.E_BAD_LENGTH, str(e))
            self.counters["errors"] += 1
            self.counters["last_error"] = P.E_BAD_LENGTH
        except Exception as e:  # the device must keep serving whatever happens
            rtype, rpayload = P.ERROR, P.pack_error(P.E_INTERNAL, f"{type(e).__name__}: {e}")
            self.counters["errors"] += 1
            self.counters["last_error"] = P.E_INTERNAL
            self._log(f"internal error on seq {f.seq}: {type(e).__name__}: {e}")
        if len(rpayload) > (self.max_message if split else self.max_payload):
            rtype, rpayload = P.ERROR, P.pack_error(P.E_OVERSIZE, f"reply of {len(rpayload)} bytes exceeds the board's max " + (
                f"message {self.max_message}; split the request" if split else f"payload {self.max_payload}; flag the request F_SPLIT_REPLY or split it"))
        self.window.record(f.seq, f.type, rtype, rpayload)
        self._reply(send, f.seq, rtype, rpayload, split)

    def _dispatch_msg(self, f: Frame, send) -> tuple[int, bytes]:
        """MSG_BEGIN / MSG_DATA / MSG_ZERO feed the reassembler; a completed message is dispatched as its inner request."""
        if f.type == P.MSG_BEGIN:
            inner, total, crc, data = P.unpack_msg_begin(f.payload)
            if inner not in P.INNER_REQUESTS:
                raise ReqError(P.E_FRAGMENT, f"message type 0x{inner:02x} cannot travel as a fragmented message")
            done = self.reasm.begin(inner, total, crc, data)
        elif f.type == P.MSG_DATA:
            done = self.reasm.data(*P.unpack_msg_data(f.payload))
        elif f.type == P.MSG_ZERO:
            done = self.reasm.zero(*P.unpack_msg_zero(f.payload))
        else:
            return self._dispatch(f, send)
        if done is None:
            return P.FRAG_ACK, P.pack_frag_ack(self.reasm.received, self.reasm.total)
        inner, payload = done
        return self._dispatch(Frame(inner, f.flags, f.seq, f.nonce, payload), send)

    def _error(self, send, seq: int, code: int, msg: str) -> None:
        self.counters["errors"] += 1
        self.counters["last_error"] = code
        self._log(f"seq {seq}: {P.ERROR_NAMES.get(code)} {msg}")
        self._send(send, P.ERROR, seq, P.pack_error(code, msg))

    def _check_range(self, row: int, offset: int, count: int) -> None:
        d = self.d
        image = d.channels * d.banks * d.cols
        if row >= d.rows:
            raise ReqError(P.E_ADDRESS, f"row {row} >= {d.rows} rows")
        if count == 0 or offset >= image or count > image - offset:
            raise ReqError(P.E_ADDRESS, f"elements [{offset}, {offset + count}) outside the {image}-element row image")

    def _dispatch(self, f: Frame, send) -> tuple[int, bytes]:
        t, p = f.type, f.payload
        d = self.d
        if t == P.INFO:
            info = {
                "protocol": P.PROTOCOL_VERSION,
                "isa_version": P.ISA_VERSION,
                "ops": sorted(o.name for o in DEVICE_OPS),
                "formats": sorted(board_formats(d)),
                "device": dataclasses.asdict(d),
                "max_payload": self.max_payload,
                "max_message": self.max_message,
                "board": "nhil-fpga-emu",
                "backend": self.backend.name,
            }
            return P.INFO_REPLY, json.dumps(info, sort_keys=True).encode()
        if t == P.STATUS:
            c = self.counters
            vals = dict(board_nonce=self.nonce, state=self.state, frames_ok=c["frames_ok"], frames_bad=c["frames_bad"], duplicates=c["duplicates"],
                        instructions=self.backend.instructions(), last_error=c["last_error"], uptime_ms=int((time.monotonic() - self.t0) * 1000))
            return P.STATUS_REPLY, P.pack_status(vals)
        if t == P.RESET:
            keep = P.unpack_reset(p)
            if keep is None:
                self.backend.reset()
                self.state = 0
                return P.ACK, b""
            mask = np.zeros(d.rows, bool)
            for row, count in keep:  # check every range before changing anything
                if count == 0 or row >= d.rows or count > d.rows - row:
                    raise ReqError(P.E_ADDRESS, f"RESET keeps rows [{row}, {row + count}) outside the device's {d.rows} rows")
                mask[row : row + count] = True
            self.backend.reset_keep(mask)
            return P.ACK, b""
        if t == P.MEM_CRC:
            row, count = P.unpack_mem_crc(p)
            if count == 0 or row >= d.rows or count > d.rows - row:
                raise ReqError(P.E_ADDRESS, f"MEM_CRC of rows [{row}, {row + count}) outside the device's {d.rows} rows")
            return P.MEM_CRC_REPLY, P.pack_mem_crc_reply(self.backend.mem_crc(row, count))
        if t == P.LOAD_PROGRAM:
            rows = P.unpack_load_program(p)
            if rows > d.rows:
                raise ReqError(P.E_ADDRESS, f"program has {rows} rows, device has {d.rows}")
            self.backend.reset(rows)
            self.state = 1
            self.load_crc = self.load_bytes = self.load_writes = 0
            return P.ACK, b""
        if t == P.WRITE_MEM:
            row, off, data = P.unpack_write_mem(p)
            n = len(data) // 2
            self._check_range(row, off, n)
            self.backend.write(row, off, np.frombuffer(data, dtype="<u2"))
            if self.state == 1:
                self.load_crc = zlib.crc32(p, self.load_crc)
                self.load_bytes += len(p)
                self.load_writes += 1
            return P.ACK, b""
        if t == P.READ_MEM:
            row, off, count = P.unpack_read_mem(p)
            self._check_range(row, off, count)
            if 2 * count > (self.max_message if f.flags & P.F_SPLIT_REPLY else self.max_payload):
                raise ReqError(P.E_OVERSIZE, f"READ_MEM of {count} elements exceeds the board's max reply size")
            return P.MEM_DATA, self.backend.read(row, off, count).astype("<u2").tobytes()
        if t == P.LOAD_END:
            nbytes, nwrites, crc = P.unpack_load_end(p)
            if self.state != 1:
                raise ReqError(P.E_STATE, "LOAD_END without LOAD_PROGRAM")
            if (nbytes, nwrites, crc) != (self.load_bytes, self.load_writes, self.load_crc):
                # refused without touching the load in progress: a forged or replayed LOAD_END cannot abort it, and
                # only a LOAD_END whose counts and CRC match what the board received ever commits
                raise ReqError(P.E_LOAD_CHECK, f"load check failed: host sent {nwrites} writes / {nbytes} B / crc 0x{crc:08x}, board received {self.load_writes} / {self.load_bytes} B / 0x{self.load_crc:08x}")
            self.backend.commit()
            self.state = 2
            return P.ACK, b""
        if t == P.EXEC:
            block = self._parse_exec(p)
            self._send(send, P.ACCEPTED, f.seq)
            try:
                rbs = self.backend.execute(block)
            except RunError as e:
                raise ReqError(P.E_RUN, str(e)) from None
            except NhilError as e:
                raise ReqError(P.E_RUN, str(e)) from None
            return P.READBACK, P.pack_readback(rbs)
        raise ReqError(P.E_UNKNOWN_TYPE, f"message type 0x{t:02x} not handled")

    def _parse_exec(self, p: bytes) -> list[ResolvedInstr]:
        block = []
        for idx, word, pl in P.unpack_exec(p):
            ins = self._decoded.get(word)
            if ins is None:
                try:
                    ins = Instr.decode(word, idx)
                except ProgramFormatError as e:
                    raise ReqError(P.E_BAD_INSTR, str(e)) from None
                if len(self._decoded) > (1 << 17):
                    self._decoded.clear()
                self._decoded[word] = ins
            if ins.op not in DEVICE_OPS:
                raise ReqError(P.E_BAD_INSTR, f"instruction {idx}: {ins.op.name} is not a device opcode of ISA v{P.ISA_VERSION}")
            if ins.flags & (FLAG_POS_SLOT | FLAG_POS_COL):
                raise ReqError(P.E_BAD_INSTR, f"instruction {idx} ({ins.op.name}): position-relative flags must be resolved by the host")
            if OPINFO[ins.op].data_in:
                dt = P.payload_dtype(ins.op)
                if len(pl) == 0 or len(pl) % dt.itemsize:
                    raise ReqError(P.E_BAD_LENGTH, f"instruction {idx} ({ins.op.name}): payload of {len(pl)} bytes is not a whole number of {dt.itemsize}-byte elements")
                payload = np.frombuffer(pl, dtype=dt).astype(np.float32 if ins.op is Op.WR_ACC else np.uint16)
            else:
                if pl:
                    raise ReqError(P.E_BAD_LENGTH, f"instruction {idx} ({ins.op.name}) takes no payload, got {len(pl)} bytes")
                payload = None
            block.append(ResolvedInstr(idx, ins, payload))
        return block


# ---------------------------------------------------------------- transports
def serve_fd(board: Board, rfd: int, wfd: int | None = None, should_stop: Callable[[], bool] = lambda: False) -> str:
    """Serve ``board`` on a file descriptor until EOF or ``should_stop()``; returns why it stopped."""
    wfd = rfd if wfd is None else wfd

    def send(b: bytes) -> None:
        mv = memoryview(b)
        while mv:
            try:
                k = os.write(wfd, mv)
            except BlockingIOError:
                select.select([], [wfd], [], 0.5)
                continue
            mv = mv[k:]

    while not should_stop():
        r, _, _ = select.select([rfd], [], [], 0.2)
        if not r:
            continue
        try:
            data = os.read(rfd, 1 << 20)
        except OSError as e:  # EIO on a pty whose other side closed
            return f"read error: {e}"
        if not data:
            return "eof"
        board.on_bytes(data, send)
    return "stopped"


def open_pty() -> tuple[int, int, str]:
    """A raw pseudo-terminal: (master fd, slave fd, slave path)."""
    import tty

    master, slave = os.openpty()
    tty.setraw(slave)
    return master, slave, os.ttyname(slave)


def serve_pty(board: Board, announce=print, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Open a pty, announce its path, serve until ``should_stop`` (keeps the slave open so host reconnects work)."""
    master, slave, path = open_pty()
    announce(path)
    try:
        while not should_stop():
            why = serve_fd(board, master, should_stop=should_stop)
            if why != "stopped":
                time.sleep(0.05)
    finally:
        os.close(master)
        os.close(slave)


def serve_tcp(board: Board, port: int, host: str = "127.0.0.1", announce=print, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Listen on ``host:port`` (loopback unless told otherwise); one connection at a time."""
    import socket

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    announce(f"socket://{host}:{srv.getsockname()[1]}")
    try:
        while not should_stop():
            r, _, _ = select.select([srv], [], [], 0.2)
            if not r:
                continue
            conn, peer = srv.accept()
            board._log(f"connection from {peer[0]}:{peer[1]}")
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                serve_fd(board, conn.fileno(), should_stop=should_stop)
            finally:
                conn.close()
    finally:
        srv.close()


def log_stream():
    return sys.stderr
