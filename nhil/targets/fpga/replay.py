"""The board's replay guard: each request sequence number is executed at most once per session.

Protocol v2 as first written kept a one-entry reply cache, so a request answered several
requests ago (a LOAD_PROGRAM, a RESET) that arrived again -- replayed by a faulty link
adapter, a buggy host, or on purpose -- was executed again and wiped the weights or the KV
cache. ``docs/link-protocol.md`` section 3 now requires:

* sequence numbers of one session (one board nonce) only move forward: ``s`` is *newer*
  than the last executed ``hi`` when ``0 < (s - hi) mod 65536 < 32768`` (RFC 1982 serial
  number arithmetic on 16 bits; the host skips 0, which is HELLO's);
* a newer request is executed and its reply kept in a window of the last
  :data:`REPLY_WINDOW` replies;
* a request whose (seq, type) is in the window is a retransmission: the kept reply is sent
  again (flag RETX), nothing is executed;
* anything else -- older than ``hi`` and not in the window, or in the window under
  another type -- is refused with ``ERROR E_REPLAY`` naming the seq, and changes nothing.

The host has one regular request outstanding at a time (windows use short frames, which
carry no seq), so the window only has to cover the host's retransmissions; 32 replies
cover a retransmission of any of the last 32 requests.
"""

from __future__ import annotations

from collections import OrderedDict

REPLY_WINDOW = 32  # replies kept for retransmissions; older requests are refused
SEQ_MOD = 1 << 16


def seq_newer(s: int, hi: int) -> bool:
    """True if 16-bit sequence number ``s`` comes after ``hi`` (RFC 1982 serial arithmetic)."""
    return 0 < (s - hi) % SEQ_MOD < SEQ_MOD // 2


class ReplyWindow:
    """Executed requests of one session: the newest seq and the last :data:`REPLY_WINDOW` replies.

    ``check(seq, type)`` says what to do with a request: ``("new", None)`` execute it and
    :meth:`record` the reply; ``("retx", (reply type, payload))`` resend that reply;
    ``("replay", why)`` refuse it with E_REPLAY (``why`` names the seq and the newest one).
    """

    def __init__(self, size: int = REPLY_WINDOW) -> None:
        self.size = size
        self.clear()

    def clear(self) -> None:
        """Forget every executed seq (a new session)."""
        self.hi: int | None = None
        self._kept: OrderedDict[int, tuple[int, int, bytes]] = OrderedDict()  # seq -> (req type, reply type, reply payload)

    def check(self, seq: int, type_: int):
        kept = self._kept.get(seq)
        if kept is not None and kept[0] == type_:
            return "retx", (kept[1], kept[2])
        if self.hi is None or seq_newer(seq, self.hi):
            return "new", None
        how = "was executed as another request type" if kept is not None else f"is older than the {self.size} replies the board keeps"
        return "replay", f"seq {seq} is not newer than the last executed seq {self.hi} and {how}: refused as a replayed request (executed at most once per session)"

    def record(self, seq: int, type_: int, rtype: int, rpayload: bytes) -> None:
        """Remember the reply of newly executed request ``seq`` (now the newest)."""
        self._kept[seq] = (type_, rtype, rpayload)
        self._kept.move_to_end(seq)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        self.hi = seq
