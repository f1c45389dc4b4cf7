"""One link session with a board: handshake, stop-and-wait ARQ, timeouts, counters, replay guard.

Protocol v2 of ``docs/link-protocol.md`` over any :class:`~nhil.targets.fpga.transport.Transport`.
:meth:`Session.open` does the HELLO handshake (section 3) and learns the board's session
nonce and max payload. :meth:`Session.transact` is one request and its reply: every frame
is retransmitted (same seq, bounded retries, exponential backoff of the reply timeout)
until its reply arrives; the board answers a repeated seq from its window of replies, so
nothing executes twice. Sequence numbers only move forward within the session (1..65535,
0 is HELLO's); a reply with another seq is stale, counted and ignored. Requests over
``DIRECT_MAX`` bytes travel as fragmented messages: MSG_BEGIN and the last byte
stop-and-wait, the bytes between as bursts of short frames (section 12, ``bulk.py``);
large replies are buffered on the board (REPLY_HEAD) and fetched by bulk bursts too.
A changed board nonce, or ``E_SESSION``, means the board was reset mid-session: that ends
the session with :class:`~nhil.targets.fpga.errors.BoardReset` (state is gone), never a retry.

Counters (``Session.link``, in every report's ``target_stats.link``) are named in ``COUNTERS``.
"""

from __future__ import annotations

import collections
import os
import time

from nhil.errors import RunError
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.bulk import MIN_FRAGMENT, Bulk
from nhil.targets.fpga.errors import (BoardError, BoardReset, LinkTimeout, ProtocolViolation, ReplayRefused, RetriesExhausted, TransportError,
                                      VersionMismatch)
from nhil.targets.fpga.frame import BAD_CRC, DEFAULT_MAX_PAYLOAD, END, OVERHEAD, Bad, Deframer, Frame, Short, encode_frame
from nhil.targets.fpga.transport import Transport

DEFAULT_BAUD = 3_000_000
COUNTERS = (
    "frames_tx", "frames_rx", "bytes_tx", "bytes_rx", "payload_tx", "payload_rx", "crc_errors", "framing_errors",
    "naks", "retries", "resyncs", "timeouts", "stale_replies", "duplicate_replies", "board_errors",
    "messages", "fragments", "zero_bytes", "fetches", "shrinks", "grows", "msg_crc_errors", "reply_crc_errors",
    "short_tx", "short_rx", "cells_up", "cells_down", "cell_up", "cell_down", "polls",
)
DIRECT_MAX = 64  # requests with a larger payload travel as fragmented messages
GROW, SHRINK = 1.5, 0.8  # budget x GROW after a good exchange, x SHRINK**k after the k-th failure in a row
MIN_RTO = 0.005  # seconds: floor of the adaptive reply timeout
_END_B = bytes([END])


class Session:
    """The host's end of one link session; see the module docstring.

    Args:
        transport: an open transport, or ``None`` until :meth:`open`.
        baud: line rate (scales the wire-time part of every timeout).
        open_timeout: seconds to get the HELLO reply.
        frame_timeout: base seconds to wait for a reply, plus the frame's wire time at ``baud``;
            doubles after each timeout (capped at 16x).
        run_timeout: seconds an accepted EXEC may run before its reply must arrive.
        max_retries: transmissions of one frame (and bursts without progress) before giving up.
        max_fragment: cap on the data bytes per frame (default: the board's max payload).
    """

    def __init__(self, transport: Transport | None = None, *, baud: int = DEFAULT_BAUD, open_timeout: float = 10.0, frame_timeout: float = 0.5,
                 run_timeout: float = 60.0, max_retries: int = 32, max_fragment: int | None = None) -> None:
        self.transport = transport
        self.baud = baud
        self.open_timeout = open_timeout
        self.frame_timeout = frame_timeout
        self.run_timeout = run_timeout
        self.max_retries = max(1, max_retries)
        self.max_fragment = max_fragment
        self.board_nonce: int | None = None
        self.max_payload = DEFAULT_MAX_PAYLOAD
        self.max_message = DEFAULT_MAX_PAYLOAD
        self.budget = self.budget_max = self.budget_min_seen = DEFAULT_MAX_PAYLOAD - P.BEGIN_HEADER
        self._fails = 0  # failed exchanges in a row
        self._exec_s = 0.0  # smoothed seconds from ACCEPTED to an EXEC's reply
        self._srtt: float | None = None
        self._rttvar = 0.0
        self.seq = 0  # last sequence number sent
        self._rx = Deframer(DEFAULT_MAX_PAYLOAD)
        self._q: collections.deque = collections.deque()
        self.link = dict.fromkeys(COUNTERS, 0)
        self.dead: str | None = None  # set once a board reset was detected: the session is over
        self.bulk = Bulk(self)

    @property
    def url(self) -> str:
        return self.transport.url if self.transport is not None else "(not open)"

    # ------------------------------------------------------------ open / close
    def open(self, transport: Transport) -> None:
        """Use ``transport`` and do the HELLO handshake.

        Raises:
            LinkTimeout: no HELLO reply within ``open_timeout``.
            VersionMismatch: the board speaks another protocol / ISA version (its HELLO_REPLY, or E_VERSION).
            BoardError, ProtocolViolation: the board refused HELLO otherwise, or its reply is malformed.
        """
        self.transport = transport
        host_nonce = int.from_bytes(os.urandom(4), "little")
        hello = P.pack_hello(host_nonce)
        frame = encode_frame(P.HELLO, 0, 0, 0, hello)
        deadline = time.monotonic() + self.open_timeout
        wait = 0.1
        echoed = False
        while time.monotonic() < deadline:
            self.write(b"\xc0\xc0" + frame + _END_B, len(hello))
            until = min(deadline, time.monotonic() + wait)
            while True:
                ev = self.recv(until)
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
                    why = f"board at {self.url} refused HELLO: {P.ERROR_NAMES.get(code, code)}: {msg}"
                    raise VersionMismatch(why) if code == P.E_VERSION else BoardError(why, code)
                if ev.type != P.HELLO_REPLY:
                    continue
                try:
                    proto, isa, nonce, maxp, maxm = P.unpack_hello_reply(ev.payload)
                except P.ProtocolError as e:
                    raise ProtocolViolation(f"board at {self.url}: malformed HELLO reply: {e}") from None
                if proto != P.PROTOCOL_VERSION or isa != P.ISA_VERSION:
                    raise VersionMismatch(f"board at {self.url} speaks link protocol v{proto} / ISA v{isa}; this nhil needs protocol v{P.PROTOCOL_VERSION} / ISA v{P.ISA_VERSION}")
                if not 64 <= maxp <= (1 << 24):
                    raise ProtocolViolation(f"board at {self.url} announced an implausible max payload of {maxp} bytes")
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
        raise LinkTimeout(f"no HELLO reply from {self.url} within {self.open_timeout:.1f} s{hint}")

    def close(self) -> None:
        """Close the transport (the session cannot be used again without :meth:`open`)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def check_alive(self) -> None:
        """Raises TransportError when not open, BoardReset once a board reset ended the session."""
        if self.transport is None:
            raise TransportError("the fpga target is not open")
        if self.dead:
            raise BoardReset(self.dead)

    def reset_detected(self, name: str, nonce: int) -> BoardReset:
        """Mark the session dead after a reply of another session nonce; returns the error to raise."""
        self.dead = f"board reset detected during {name}: its session nonce changed from 0x{self.board_nonce:08x} to 0x{nonce:08x}; device state is lost, the run cannot continue"
        return BoardReset(self.dead)

    # ------------------------------------------------------------ bytes
    def write(self, data: bytes, payload_bytes: int) -> None:
        """Send wire bytes (one frame, or a burst counted as one) through the transport and count them."""
        self.transport.write(data)
        self.link["frames_tx"] += 1
        self.link["bytes_tx"] += len(data)
        self.link["payload_tx"] += payload_bytes

    def recv(self, deadline: float) -> Frame | Short | Bad | None:
        """Next received frame or bad run, or ``None`` at ``deadline`` (``time.monotonic()`` seconds)."""
        while not self._q:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._feed(self.transport.read(left))
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

    # ------------------------------------------------------------ timeouts and the fragment budget
    def rto(self, nbytes: int) -> float:
        """Reply timeout (s): RFC 6298 SRTT + 4 RTTVAR (floor MIN_RTO, ceiling ``frame_timeout``; ``frame_timeout``
        before the first sample) plus twice the wire time of ``nbytes`` at the baud rate."""
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
        """Copies of each frame sent back to back: 1 on a clean line, 2-4 when the budget shows a noisy one."""
        return 1 if self.budget >= 1024 else (2 if self.budget >= 256 else (3 if self.budget >= 64 else 4))

    def known_noisy(self, below: int) -> bool:
        """True once bulk bursts measured the line to the board, or the fragment budget shrank under ``below`` bytes."""
        return self.bulk.lnq["up"] is not None or self.budget < below

    # ------------------------------------------------------------ request / reply
    def exchange(self, type_: int, make, reply_size: int, name: str) -> Frame:
        """Send one frame until a reply with its seq arrives; ``make(budget) -> payload`` builds each attempt.

        A retransmission keeps the seq; ``make`` may return a shorter payload after the budget shrank
        (fragments only: the board's reply says how much it holds). Returns the reply frame (may be
        ERROR or REPLY_HEAD; ACCEPTED switches to the run timeout).

        Raises:
            LinkTimeout, RetriesExhausted: ``max_retries`` attempts, the last timed out / NAKed / damaged.
            BoardReset: a reply of another session nonce.
        """
        self.check_alive()
        self.seq = (self.seq % 0xFFFF) + 1
        seq = self.seq
        why = ""
        backoff = 1
        for attempt in range(self.max_retries):
            if attempt:
                self.link["retries"] += 1
                if why == "timeout":
                    time.sleep(min(0.0005 * 2 ** (attempt - 1), 0.05))
            payload = make(self.budget)
            split = reply_size > self.budget or self.budget < 256  # REPLY_HEAD + FETCH: too big for the budget, or a noisy line
            flags = (P.F_RETX if attempt else 0) | (P.F_SPLIT_REPLY if split else 0)
            frame = encode_frame(type_, flags, seq, self.board_nonce, payload) + _END_B
            copies = self._copies()
            for _ in range(copies):  # every copy after the first is answered from the reply window
                self.write(frame, len(payload))
            t_sent = time.monotonic()
            deadline = t_sent + backoff * self.rto(copies * (len(frame) + min(reply_size, self.budget)) + 64)
            accepted = False
            t_acc = run_deadline = poll = 0.0  # set when ACCEPTED arrives
            bad = 0
            while True:
                ev = self.recv(deadline)
                if ev is None and accepted and time.monotonic() < run_deadline:
                    # the EXEC runs, or its reply was lost: ask again (same seq; a busy board answers when done,
                    # from its window) at growing intervals, without spending the retry budget, up to the run timeout
                    self.link["polls"] += 1
                    self.write(frame, len(payload))
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
                    raise self.reset_detected(name, ev.nonce)
                if ev.type in P.REQUESTS:
                    continue  # our own frame echoed back (loopback line)
                if ev.type == P.NAK:
                    self.link["naks"] += 1
                    why = "NAK"
                    bad += 1
                    if bad >= copies:
                        break
                    continue
                if ev.seq != seq:  # the replay guard: an answer to another request is never taken for this one
                    self.link["stale_replies"] += 1
                    continue
                if ev.flags & P.F_RETX:
                    self.link["duplicate_replies"] += 1
                if ev.type == P.ACCEPTED:
                    if not accepted:
                        accepted, t_acc = True, time.monotonic()
                        run_deadline = t_acc + self.run_timeout
                        poll = self.rto(len(frame) + min(reply_size, self.budget)) + 2 * self._exec_s
                        deadline = min(run_deadline, t_acc + poll)
                    continue
                if accepted:  # how long the board takes to execute: the first poll waits twice that
                    self._exec_s = 0.8 * self._exec_s + 0.2 * (time.monotonic() - t_acc)
                if attempt == 0 and not accepted:  # Karn: never from a retransmission (copies answer alike)
                    self._rtt_sample(time.monotonic() - t_sent)
                self._adapt(True)
                return ev
            self._adapt(False)
        err = LinkTimeout if why == "timeout" else RetriesExhausted
        raise err(f"{name} (seq {seq}) got no valid reply from {self.url} after {self.max_retries} attempts (last: {why}); link: {self.brief()}")

    def transact(self, type_: int, payload: bytes, expect: int, reply_size: int = 0) -> Frame:
        """One request and its (inline or fetched) reply; payloads over DIRECT_MAX go as a fragmented message.

        Args:
            reply_size: bytes the reply payload may take (decides F_SPLIT_REPLY).

        Raises:
            LinkError: (a subclass of it, ``errors.py``) retries exhausted, board reset, protocol violation, refusal.
            RunError: the board refused the request (run error, address out of range, bad instruction).
        """
        name = P.NAMES[type_]
        if len(payload) > DIRECT_MAX and type_ in P.INNER_REQUESTS:
            ev = self.bulk.send_message(type_, payload, reply_size, name)
        else:
            ev = self.exchange(type_, lambda _b: payload, reply_size, name)
        if ev.type == P.REPLY_HEAD:
            ev = self.bulk.fetch(ev, name)
        if ev.type == P.ERROR:
            self._board_error(name, ev)
        if ev.type != expect:
            raise ProtocolViolation(f"protocol violation: {name} answered with {P.NAMES.get(ev.type, hex(ev.type))}, expected {P.NAMES[expect]}")
        return ev

    def _board_error(self, name: str, ev: Frame):
        code, msg = P.unpack_error(ev.payload)
        self.link["board_errors"] += 1
        cname = P.ERROR_NAMES.get(code, str(code))
        if code == P.E_SESSION:
            self.dead = f"board reset detected during {name}: {msg}; device state is lost, the run cannot continue"
            raise BoardReset(self.dead)
        if code in (P.E_RUN, P.E_ADDRESS, P.E_BAD_INSTR):
            raise RunError(f"board refused {name}: {msg}" if code != P.E_RUN else msg)
        raise (ReplayRefused if code == P.E_REPLAY else BoardError)(f"board refused {name}: {cname}: {msg}", code)

    # ------------------------------------------------------------ board state, counters
    def status(self) -> dict:
        """The board's STATUS counters (one round trip); ``state`` and ``last_error`` by name."""
        st = P.unpack_status(self.transact(P.STATUS, b"", P.STATUS_REPLY, reply_size=32).payload)
        st["state"] = P.STATE_NAMES.get(st["state"], st["state"])
        st["last_error"] = P.ERROR_NAMES.get(st["last_error"], st["last_error"])
        return st

    def brief(self) -> str:
        """The non-zero counters, for error messages."""
        return ", ".join(f"{k}={v}" for k, v in self.link.items() if v)

    def link_stats(self) -> dict:
        """The counters plus ``wire_efficiency`` (payload / wire bytes sent) and the fragment budget's range."""
        link = dict(self.link)
        link["wire_efficiency"] = round(link["payload_tx"] / link["bytes_tx"], 4) if link["bytes_tx"] else None
        link["fragment_budget"] = {"now": self.budget, "min": self.budget_min_seen, "max": self.budget_max}
        return link

