"""Bulk bursts of short frames (``docs/link-protocol.md`` section 12): the session's way to move many bytes.

On a line that damages 1-3% of its bytes a stop-and-wait frame per fragment spends most of
the time on headers and replies. :class:`Bulk` sends a request too large for one frame as a
message (:meth:`Bulk.send_message`, section 6), whose inside goes up as short frames
(:meth:`Bulk.stream_up`: S_DATA / S_ZERO bursts closed by S_QUERY bitmaps), and reads a
buffered reply down (:meth:`Bulk.fetch`: S_FETCH bursts answered by S_REPLY cells and S_DONE); each
burst ends with S_PINGs (:meth:`Bulk.sburst`), and only the pieces not shown held are sent
again. The piece size follows the per-byte survival measured on each burst
(``k = -1 / ln q``, :meth:`Bulk.cell`), so a line that corrupts, drops and duplicates 1% of
its bytes each still carries a few hundred kB/s over the emulator's pty.

A :class:`Bulk` belongs to one :class:`~nhil.targets.fpga.session.Session` (``session.bulk``)
and writes, reads, times out and counts through it.
"""

from __future__ import annotations

import math
import time

from nhil.targets.fpga import protocol as P
from nhil.targets.fpga import stream as S
from nhil.targets.fpga.errors import BoardError, ProtocolViolation, RetriesExhausted
from nhil.targets.fpga.frame import END, Bad, Frame, crc32

MIN_FRAGMENT = 16  # smallest fragment data budget (bytes)
MAX_CELL = 1 << 15  # largest cell of a short-frame stream (bytes)
SWIN_MIN, SWIN_MAX = 16, 1024  # short frames per burst (adapts: doubles after a burst with progress, halves without)
RANGE_BUDGET = 768  # most pieces outstanding in an upload: the board keeps up to 1024 held ranges (fragment.MAX_RANGES)
PER_FRAME_S = 0.0001  # allowance for the board to process one frame of a burst (the emulator takes ~10-20 us)
PING_COPIES = 6  # S_PINGs closing a burst
FETCH_COPIES = 3  # copies of each S_FETCH (the board serves the first and answers the others with S_DONE only)
TAIL_FILL = 48  # a burst of fewer pieces sends each several times, to about this many frames
QUERY_COPIES = 4  # copies of each S_QUERY closing an upload burst
_END_B = bytes([END])


class Bulk:
    """Short-frame bursts of one session ``s``: the cell size estimator, uploads into an open message, fetches.

    State: ``lnq`` (ln of the per-byte survival measured per direction, ``None`` before a burst), ``swin``
    (short frames per burst), and the id of the last S_QUERY / S_FETCH / S_PING.
    """

    def __init__(self, s) -> None:
        self.s = s
        self.swin = SWIN_MIN
        self.lnq: dict[str, float | None] = {"up": None, "down": None}  # ln(per-byte survival) per direction
        self._qid = 0

    def cell(self, direction: str) -> int:
        """Cell size (bytes, a power of two) for short-frame streams in ``direction`` ("up": to the board, "down").

        From the per-byte survival estimated on earlier bursts: ``k * q^(k + overhead)`` (data bytes delivered per
        frame sent) peaks at ``k = -1 / ln q``; before any estimate, the fragment budget."""
        lnq = self.lnq[direction]
        k = float(self.s.budget) if lnq is None else (-1.0 / lnq if lnq < -1e-9 else float(MAX_CELL))
        k = max(float(MIN_FRAGMENT), min(k, float(MAX_CELL), float(self.s.max_payload - 16), float(self.s.budget_max)))
        return 1 << max(4, int(round(math.log2(k))))

    def learn(self, direction: str, delivered: int, sent: int, wire_bytes: float) -> None:
        """Update the per-byte survival estimate from ``delivered`` of ``sent`` frames of mean ``wire_bytes``."""
        if sent <= 0 or wire_bytes <= 0:
            return
        r = (delivered + 0.5) / (sent + 1.0)
        sample = math.log(r) / wire_bytes
        if not delivered:  # nothing got through: at least halve the frames
            sample = min(sample, -2.0 / max(1.0, wire_bytes - S.SHORT_OVERHEAD))
        old = self.lnq[direction]
        self.lnq[direction] = sample if old is None else 0.5 * old + 0.5 * sample
        self.s.link["cell_up" if direction == "up" else "cell_down"] = self.cell(direction)

    def sburst(self, frames: list[bytes], back: int, name: str, on_short, answers: int = 0) -> None:
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
            TransportError, LinkTimeout, BoardReset: the link is closed, STATUS got no reply, or the board was reset.
        """
        self.s.check_alive()
        self._qid = (self._qid + 1) & 0xFFFF
        ping = self._qid
        frames = [*frames, *[S.s_ping(ping)] * PING_COPIES]
        wire = _END_B + b"".join(frames)
        self.s.write(wire, len(wire))
        self.s.link["frames_tx"] += len(frames) - 1
        self.s.link["short_tx"] += len(frames)
        t0 = time.monotonic()
        wait = self.s.rto(len(wire) + back) + PER_FRAME_S * len(frames)
        deadline = t0 + wait
        expect = answers + PING_COPIES
        per_frame = PER_FRAME_S + 10 * (back / expect + 8) / self.s.baud
        synced = True
        while True:
            ev = self.s.recv(deadline)
            if ev is None:
                if synced:
                    self.s.link["timeouts"] += 1
                if not synced:  # the catch-up ping went unanswered too: a regular STATUS, answered in order once the
                    self.s.status()  # board is through the burst (and raising 'board reset detected' if it was reset)
                    return
                # catch up before the next burst: a fresh ping, answered once the board is through this burst
                self._qid = (self._qid + 1) & 0xFFFF
                ping = self._qid
                self.s.write(_END_B + S.s_ping(ping) * PING_COPIES, 0)
                self.s.link["short_tx"] += PING_COPIES
                wait = min(2 * wait, 2.0)
                deadline = time.monotonic() + wait
                synced = False
                continue
            if isinstance(ev, Bad):
                continue
            if isinstance(ev, Frame):  # a late regular reply: only a changed nonce matters
                if ev.nonce != self.s.board_nonce and ev.type not in P.REQUESTS:
                    raise self.s.reset_detected(name, ev.nonce)
                self.s.link["stale_replies"] += 1
                continue
            self.s.link["short_rx"] += 1
            if ev.type == S.S_PONG:
                if ev.body == ping.to_bytes(2, "little"):  # (no RTT sample: a burst's time is mostly the board's work)
                    return
                continue
            if on_short(ev) and synced:
                expect = max(0, expect - 1)
                deadline = min(deadline, time.monotonic() + 0.002 + expect * per_frame)

    def after_burst(self, progress: bool, stalls: int, what: str) -> int:
        """Burst size and stall count after a burst; returns the new count of bursts in a row without progress.

        The burst doubles after progress (to ``SWIN_MAX``) and halves without. After 2, 4, 8 ... stalled bursts,
        STATUS: a board that was reset drops short frames silently (no session), and only a regular frame shows
        its new nonce.

        Raises:
            BoardReset, RetriesExhausted: the board was reset, or ``max_retries`` bursts in a row made no progress (``what`` says where).
        """
        self.swin = min(SWIN_MAX, self.swin * 2) if progress else max(SWIN_MIN, self.swin // 2)
        stalls = 0 if progress else stalls + 1
        if stalls >= 2 and stalls & (stalls - 1) == 0:
            self.s.status()
        if stalls >= self.s.max_retries:
            raise RetriesExhausted(f"{what} in {stalls} bursts; link: {self.s.brief()}")
        return stalls

    def lost(self, name: str, what: str):
        """The board answered a short query with 'no such message / reply': find out why, then raise."""
        self.s.status()  # raises 'board reset detected' when the nonce changed
        raise BoardError(f"{name}: the board no longer holds the {what} (short-frame status GONE); it was discarded mid-transfer; link: {self.s.brief()}")

    def stream_up(self, payload: bytes, total: int, tag: int, lo: int, hi: int, name: str) -> None:
        """Make the board hold bytes ``[lo, hi)`` of the open message with S_DATA / S_ZERO frames in bursts, each
        closed by S_QUERYs whose bitmaps show which pieces arrived; pieces not shown held are sent again with the
        same boundaries, or cut on a finer power-of-two grid (a piece is held whole or not at all, so a repeat is
        new bytes or an exact duplicate). Pieces lie on the grid of cells of ``_cell("up")`` bytes up to the last
        grid line before ``hi``; the rest is cut into power-of-two *solo* pieces, each asked about by a query of
        one cell of its own size (a bitmap cell must not reach into the message's last, unsent byte). At most
        ``RANGE_BUDGET`` pieces are outstanding, so the board's table of held ranges never fills.

        Raises:
            RetriesExhausted, BoardError: no progress in ``max_retries`` bursts in a row, the board lost the message.
        """
        g = self.cell("up")
        pend: list[tuple[int, int, bool, bool]] = []  # (start, end, zero, solo) sent and not yet shown held, ascending
        frontier = lo
        stalls = 0
        mv = memoryview(payload)
        while pend or frontier < hi:
            g2 = self.cell("up")
            if g2 < g:  # finer grid: cut the outstanding data pieces (nested grids keep every piece inside an old one)
                pend = [p for a, e, z, so in pend for p in ([(a, e, z, so)] if z or so else
                                                             [(x, min(e, (x // g2 + 1) * g2), False, False) for x in S.grid_cuts(a, e, g2)])]
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
            spans = S.spans([(a // g, (e - 1) // g) for a, e, _, so in burst if not so])
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

            self.sburst(frames, 20 * QUERY_COPIES * len(queries), name, on_short, QUERY_COPIES * len(queries))
            held: set[tuple[int, int]] = set()  # (offset, cell size) of cells shown held
            answered: set[tuple[int, int]] = set()
            for qid, (off, cell, n) in zip(qids, queries):
                b = answers.get(qid)
                if b is None:
                    continue
                if b.status != S.ST_OK:
                    self.lost(name, "message")
                if len(b.bits) != (n + 7) // 8:
                    raise ProtocolViolation(f"protocol violation: {name}: S_BITMAP of {len(b.bits)} bytes for {n} cells")
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
                self.learn("up", shown, seen, wire / max(1, seen))
            self.s.link["retries"] += again
            self.s.link["cells_up"] += len(done)
            self.s.link["zero_bytes"] += sum(e - a for a, e, z, _ in burst if z and a in done)
            pend = [p for p in pend if p[0] not in done]
            stalls = self.after_burst(bool(done), stalls, f"{name}: no piece of [{lo}, {hi}) of {total} got through")

    def send_message(self, type_: int, payload: bytes, reply_size: int, name: str) -> Frame:
        """Send the request ``type_`` with ``payload`` as a message (section 6): MSG_BEGIN (stop-and-wait) with as
        many first bytes as the fragment budget allows (none once the line is known to be noisy), the rest but the
        last byte as short frames (:meth:`stream_up`), and the last byte as MSG_DATA / MSG_ZERO (stop-and-wait),
        whose reply is the inner request's. Every byte before ``pos`` is held by the board and none after it,
        between the steps. A message the board reports as E_MSG_CRC is sent again (3 times at most).

        Returns the inner request's reply (maybe ERROR).

        Raises:
            RetriesExhausted: the board reassembled the message with a wrong CRC 3 times (or as ``stream_up``).
            ProtocolViolation: a FRAG_ACK that does not fit the message.
        """
        total = len(payload)
        crc = crc32(payload)
        tag = S.tag_of(crc)
        self.s.link["messages"] += 1
        for _ in range(3):
            pos = 0
            begun = False
            while True:
                if not begun:  # on a line known to be noisy MSG_BEGIN carries no data: a short frame survives best
                    first = 0 if self.lnq["up"] is not None else total
                    t, make = P.MSG_BEGIN, (lambda b, n=first: P.pack_msg_begin(type_, total, crc, payload[: min(n, max(1, b))]))
                else:
                    if total - 1 > pos:  # all but the last byte as short frames; the last one completes the message
                        self.stream_up(payload, total, tag, pos, total - 1, name)
                        pos = total - 1
                    if payload[pos:].count(0) == total - pos:
                        t, zero = P.MSG_ZERO, P.pack_msg_zero(pos, total - pos)
                        make = lambda _b, zero=zero: zero
                    else:
                        t = P.MSG_DATA
                        make = lambda b, a=pos: P.pack_msg_data(a, payload[a : min(total, a + max(1, b))])
                ev = self.s.exchange(t, make, reply_size, f"{name} ({P.NAMES[t]} @{pos}/{total})")
                self.s.link["fragments"] += 1
                if t == P.MSG_ZERO:
                    self.s.link["zero_bytes"] += total - pos
                if ev.type != P.FRAG_ACK:
                    if ev.type == P.REPLY_HEAD:
                        ev = self.fetch(ev, name)
                    if ev.type == P.ERROR and P.unpack_error(ev.payload)[0] == P.E_MSG_CRC:
                        self.s.link["msg_crc_errors"] += 1
                        break
                    return ev
                try:
                    got, tot = P.unpack_frag_ack(ev.payload)
                except P.ProtocolError as e:
                    raise ProtocolViolation(f"protocol violation: {e}") from None
                if tot != total or not pos <= got < total or (begun and got == pos):
                    raise ProtocolViolation(f"protocol violation: {name} fragment at {pos} acknowledged as {got} of {tot} bytes (message of {total})")
                pos, begun = got, True
        raise RetriesExhausted(f"{name}: the board reassembled a message of {total} bytes with a wrong CRC 3 times; link: {self.s.brief()}")

    def fetch(self, head: Frame, name: str) -> Frame:
        """Read a REPLY_HEAD's reply by S_FETCH bursts (each asks for up to 64 missing cells, the board streams them
        as S_REPLY and ends with S_DONE); check the CRC of the whole (3 tries).

        Raises:
            RetriesExhausted, BoardError, ProtocolViolation: no progress in ``max_retries`` bursts, the board lost the reply, CRC mismatch 3 times.
        """
        try:
            rtype, total, crc = P.unpack_reply_head(head.payload)
        except P.ProtocolError as e:
            raise ProtocolViolation(f"protocol violation: {e}") from None
        if total > self.s.max_message:
            raise ProtocolViolation(f"protocol violation: {name} reply of {total} bytes exceeds the board's max message {self.s.max_message}")
        tag = S.tag_of(crc)
        for _ in range(3):
            buf = bytearray(total)
            g = self.cell("down")
            miss = [(a, min(total, a + g)) for a in range(0, total, g)]  # cells still to read
            asked_before: set[int] = set()
            stalls = 0
            while miss:
                g2 = self.cell("down")
                if g2 < g:
                    miss = [(x, min(e, x + g2)) for a, e in miss for x in range(a, e, g2)]
                    g = g2
                burst = miss[: self.swin]
                spans = S.spans([(a // g, (e - 1) // g) for a, e in burst])
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
                        self.s.link["stale_replies"] += 1
                    elif ev.type == S.S_DONE and x.qid in mine:
                        dones.setdefault(x.qid, x)
                        return True
                    return False

                self.sburst(frames, sum(e - a + S.SHORT_OVERHEAD for a, e in burst) + 8 * len(frames), f"{name} (S_FETCH)", on_short, len(burst) + len(frames))
                self.s.link["fetches"] += len(qids)
                seen = shown = 0
                nbytes = 0
                for qid, offs in zip(qids, asked):
                    d = dones.get(qid)
                    if d is not None and d.status != S.ST_OK:
                        self.lost(name, "reply")
                    if d is not None or any(o in got for o in offs):  # the request arrived: its cells were sent
                        seen += len(offs)
                        shown += sum(1 for o in offs if o in got)
                        nbytes += sum(ends[o] - o for o in offs)
                self.learn("down", shown, seen, S.SHORT_OVERHEAD + nbytes / max(1, seen))
                self.s.link["retries"] += sum(1 for a, _ in burst if a in asked_before)
                asked_before.update(a for a, _ in burst)
                self.s.link["cells_down"] += len(got)
                miss = [p for p in miss if p[0] not in got]
                stalls = self.after_burst(bool(got), stalls, f"{name}: reading a {total}-byte reply made no progress")
            if crc32(buf) == crc:
                return Frame(rtype, head.flags, head.seq, head.nonce, bytes(buf))
            self.s.link["reply_crc_errors"] += 1
        raise RetriesExhausted(f"{name}: the reply of {total} bytes fetched 3 times never matched its CRC; link: {self.s.brief()}")
