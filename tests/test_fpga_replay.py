"""Replay-proof sessions (docs/link-protocol.md section 3): the board executes each sequence number
at most once per session; retransmissions within the reply window get the kept reply, anything
older is refused with E_REPLAY; the host counts the stale replies and the run stays bit-identical."""

from __future__ import annotations

import numpy as np
import pytest

from nhil.isa.device import DEVICE_PRESETS
from nhil.targets.fpga import FpgaTarget
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.emulator import Board
from nhil.targets.fpga.frame import Deframer, Frame, encode_frame
from nhil.targets.fpga.replay import REPLY_WINDOW, ReplyWindow, seq_newer
from nhil.targets.sim import SimTarget

from fpga_programs import program, run  # tests/fpga_programs.py

DEV = DEVICE_PRESETS["fpga-small"]
ROW_ELEMS = DEV.channels * DEV.banks * DEV.cols


def test_seq_order_is_rfc1982_serial_arithmetic_with_wrap():
    assert seq_newer(2, 1) and not seq_newer(1, 2) and not seq_newer(5, 5)
    assert seq_newer(1, 65535) and seq_newer(3, 65534)  # the host wraps 65535 -> 1 (0 is HELLO's)
    assert not seq_newer(65535, 1)
    assert seq_newer(1 + 32767, 1) and not seq_newer(1 + 32768, 1)  # half the space ahead, by RFC 1982


def test_reply_window_keeps_the_last_replies_and_refuses_older_seqs():
    w = ReplyWindow(size=4)
    assert w.check(7, P.STATUS) == ("new", None)
    for s in range(1, 11):
        w.record(s, P.WRITE_MEM, P.ACK, bytes([s]))
    assert w.check(10, P.WRITE_MEM) == ("retx", (P.ACK, b"\x0a"))
    assert w.check(7, P.WRITE_MEM) == ("retx", (P.ACK, b"\x07"))
    verdict, why = w.check(6, P.WRITE_MEM)  # older than the 4 kept
    assert verdict == "replay" and "seq 6" in why and "last executed seq 10" in why
    assert w.check(9, P.RESET)[0] == "replay"  # a kept seq under another type is not a retransmission
    assert w.check(11, P.WRITE_MEM) == ("new", None)


class Wire:
    """In-process host stub that records every request frame it sends (for replaying them)."""

    def __init__(self):
        self.b = Board(DEV, max_payload=4096)
        self.d = Deframer(1 << 20)
        self.seq = 0
        self.nonce = 0
        self.sent: dict[int, bytes] = {}

    def raw(self, data: bytes) -> list[Frame]:
        out = []
        self.b.on_bytes(data, lambda w: out.extend(self.d.feed(w)))
        return [e for e in out if isinstance(e, Frame) and e.type != P.ACCEPTED]

    def req(self, t, payload=b""):
        self.seq += 1
        frame = encode_frame(t, 0, self.seq, self.nonce, payload)
        self.sent[self.seq] = frame
        (r,) = self.raw(frame)
        return r

    def hello(self, host_nonce=5):
        (r,) = self.raw(encode_frame(P.HELLO, 0, 0, 0, P.pack_hello(host_nonce)))
        assert r.type == P.HELLO_REPLY
        self.nonce = P.unpack_hello_reply(r.payload)[2]
        return r

    def row(self, row: int) -> bytes:
        r = self.req(P.READ_MEM, P.pack_read_mem(row, 0, 64))
        assert r.type == P.MEM_DATA
        return r.payload


def _session_of_60():
    """seq 1: RESET (wipes memory); seq 2: LOAD_PROGRAM (starts the load checksum); seqs 3..60:
    WRITE_MEM row 7 := the seq number, row 9 := 9 once at seq 3. Re-executing any of them changes
    the memory or the load counters."""
    w = Wire()
    w.hello()
    assert w.req(P.RESET, P.pack_reset()).type == P.ACK
    assert w.req(P.LOAD_PROGRAM, P.pack_load_program(2)).type == P.ACK
    assert w.req(P.WRITE_MEM, P.pack_write_mem(9, 0, np.full(64, 9, "<u2").tobytes())).type == P.ACK
    while w.seq < 60:
        assert w.req(P.WRITE_MEM, P.pack_write_mem(7, 0, np.full(64, w.seq + 1, "<u2").tobytes())).type == P.ACK
    return w


@pytest.mark.parametrize("back", [1, 5, 50, 59])
def test_a_replayed_request_is_never_executed_again(back):
    w = _session_of_60()
    before_rows = (w.row(7), w.row(9))
    newest = 60
    load = (w.b.load_crc, w.b.load_bytes, w.b.load_writes)
    seq = newest - (back - 1)  # 1 back = the request just answered
    (r,) = w.raw(w.sent[seq])
    if back <= REPLY_WINDOW:  # a retransmission: the kept reply again, flagged RETX
        assert r.type == P.ACK and r.seq == seq and r.flags & P.F_RETX
    else:  # older than the window: refused, naming the seq
        assert r.type == P.ERROR and r.seq == seq
        code, msg = P.unpack_error(r.payload)
        assert code == P.E_REPLAY and f"seq {seq} is not newer than the last executed seq" in msg
        assert w.b.counters["replays"] == 1
    assert (w.b.load_crc, w.b.load_bytes, w.b.load_writes) == load  # no WRITE_MEM / RESET / LOAD ran again
    assert (w.row(7), w.row(9)) == before_rows
    assert np.frombuffer(before_rows[0], "<u2")[0] == 60 and np.frombuffer(before_rows[1], "<u2")[0] == 9


def test_replayed_reset_and_load_program_are_refused_and_the_board_keeps_serving():
    w = _session_of_60()
    rows = (w.row(7), w.row(9))
    for seq in (1, 2):  # RESET would zero row 9, LOAD_PROGRAM would restart the load checksum
        (r,) = w.raw(w.sent[seq])
        assert r.type == P.ERROR and P.unpack_error(r.payload)[0] == P.E_REPLAY
    assert (w.row(7), w.row(9)) == rows
    assert w.req(P.WRITE_MEM, P.pack_write_mem(7, 0, np.full(64, 123, "<u2").tobytes())).type == P.ACK
    assert np.frombuffer(w.row(7), "<u2")[0] == 123


def test_repeated_hello_keeps_the_session_a_new_one_changes_the_nonce():
    w = _session_of_60()
    nonce = w.nonce
    (r,) = w.raw(encode_frame(P.HELLO, 0, 0, 0, P.pack_hello(5)))  # the same HELLO again (retransmitted or replayed)
    assert P.unpack_hello_reply(r.payload)[2] == nonce
    (r,) = w.raw(w.sent[20])  # the window survived: still refused
    assert P.unpack_error(r.payload)[0] == P.E_REPLAY
    old = dict(w.sent)
    w.hello(host_nonce=6)  # another host (or a new process) opens a new session: new nonce
    assert w.nonce != nonce
    row9 = w.row(9)
    (r,) = w.raw(old[1])  # the old session's RESET, replayed: its nonce is stale
    assert r.type == P.ERROR and P.unpack_error(r.payload)[0] == P.E_SESSION
    assert w.row(9) == row9 and np.frombuffer(row9, "<u2")[0] == 9  # memory survives a HELLO (warm reload)


def test_replays_on_the_line_leave_the_run_bit_identical_and_are_counted():
    """A line that, before some requests, replays the request 1, 5 and 50 back (raw frames, as
    sent): the board answers each replay from its window or refuses it, never executes it; the host
    ignores those replies (stale: another seq) and counts them; the results are the simulator's."""
    prog = program()
    ref = run(prog, SimTarget(device=DEV))
    with FpgaTarget(device="fpga-small", progress=False) as t:
        sent: dict[int, bytes] = {}
        replayed = []
        real_write = t.session.transport.write
        dec = Deframer(1 << 24)

        def write(data: bytes) -> None:
            frames = [e for e in dec.feed(data) if isinstance(e, Frame) and e.type in P.REQUESTS and e.seq]
            for f in frames:
                if f.seq not in sent:
                    for back in (1, 5, 50):
                        old = f.seq - back
                        if old in sent and f.seq % 7 == 0:  # now and then, replay old requests first
                            real_write(sent[old])
                            replayed.append(back)
                    sent[f.seq] = data
            real_write(data)

        t.session.transport.write = write
        runs = []
        while t.session.seq < 80:  # enough requests for replays 50 back; each run starts with a RESET (warm reload)
            runs.append(run(prog, t))
        st = t.stats()["link"]
        board = t.status()
    for got in runs:  # a replayed RESET or LOAD executed again would have wiped the weights or the KV cache
        for x, y in zip(ref[0], got[0]):
            for k in x:
                assert x[k].tobytes() == y[k].tobytes(), k
    assert all(ref[1] == got[1] for got in runs)
    assert {1, 5, 50} <= set(replayed)
    # each replay is answered (kept reply or E_REPLAY) before the request written after it, so the
    # host reads every one of those answers while it waits for its own: each is a stale reply
    assert st["stale_replies"] >= len(replayed)
    assert board["duplicates"] >= 1


def test_every_failed_outcome_keeps_the_link_counters_and_a_failed_check(tmp_path):
    """A board reset mid-run (LINK_FAIL after the target opened) and a line that never answers HELLO:
    both reports name the stage, keep the link counters, and their checks say the run failed."""
    from nhil.verify import VerifyOptions, verify

    dirs = dict(goldens_dir=tmp_path / "g", runs_dir=tmp_path / "runs")
    rep = verify(VerifyOptions(model="llama-tiny", target="fpga", tokens=3, target_options={"faults": "reset_after=100"}, **dirs))
    assert rep["outcome"] == "LINK_FAIL" and "board reset detected" in rep["error"], rep.get("error")
    link = rep["target_stats"]["link"]
    assert link["frames_tx"] > 0 and link["frames_rx"] > 0
    assert not all(c["passed"] for c in rep["checks"]) and rep["checks"][-1]["name"] == f"stage_{rep['stage']}"
    rep = verify(VerifyOptions(model="llama-tiny", target="fpga", tokens=3, target_options={"port": "loop://", "open_timeout": 0.5}, **dirs))
    assert rep["outcome"] == "LINK_FAIL" and rep["stage"] == "open_target", (rep["stage"], rep.get("error"))
    assert rep["checks"][-1] == {"name": "stage_open_target", "passed": False, "detail": "LINK_FAIL: " + rep["error"]}


# ---------------------------------------------------------------- frames against the board
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _board_state(w: Wire) -> tuple:
    b = w.b
    mem = b"".join(b.backend.read(r, 0, 64).tobytes() for r in (7, 9))
    return mem, b.load_crc, b.load_bytes, b.load_writes, b.state, b.window.hi, tuple(b.window._kept), b.nonce, b.session


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(P.REQUESTS) + [0x00, 0x5A, 0x80, 0xFF]), st.binary(max_size=48), st.integers(0, 65535), st.booleans())
def test_every_refused_frame_leaves_the_board_state_unchanged(type_, payload, seq, stale_nonce):
    """Random well-framed requests (valid CRC) after a session of 60 requests: whenever the board
    answers ERROR or NAK, memory, load counters, reply window, nonce and session are as before."""
    w = _session_of_60()
    before = _board_state(w)
    nonce = w.nonce ^ 1 if stale_nonce else w.nonce
    replies = w.raw(encode_frame(type_, 0, seq, nonce, payload))
    assert replies, "the board answers every intact frame"
    if all(r.type in (P.ERROR, P.NAK) for r in replies):
        after = _board_state(w)
        device = lambda st_: st_[:5] + st_[7:]  # noqa: E731 - memory, load counters, state, nonce, session
        assert device(after) == device(before)
        if after[5:7] != before[5:7]:  # a new seq was answered with ERROR: that reply is kept for its retransmissions
            assert after[5] == seq and w.b.window.check(seq, type_)[0] == "retx"
    # and it keeps serving: the next fresh request works
    w.seq = max(w.seq, w.b.window.hi or 0)
    assert w.req(P.STATUS).type == P.STATUS_REPLY or w.b.nonce != before[7]
