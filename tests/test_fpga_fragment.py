"""Link protocol v2 fragmentation: reassembly properties, the board's fragment handling, and a
llama-tiny verify over a line that corrupts, drops and duplicates bytes.

References: the reassembled bytes are compared with the original message; the verify run
is compared with the functional simulator (lockstep, bit for bit) and the PyTorch golden.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.stream import grid_cuts as _grid_cuts, spans as _spans
from nhil.targets.fpga.emulator import Board
from nhil.targets.fpga.fragment import E_FRAGMENT, E_MSG_CRC, Reassembler, ReassemblyError, ReplyBuffer
from nhil.targets.fpga.frame import Deframer, Frame, crc32, encode_frame
from nhil.isa.device import DEVICE_PRESETS

pytestmark = pytest.mark.fpga

DEV = DEVICE_PRESETS["fpga-small"]
# messages rich in zero runs (so MSG_ZERO fragments occur) and in arbitrary bytes
messages = st.lists(st.one_of(st.binary(min_size=1, max_size=40), st.integers(1, 80).map(bytes)), min_size=1, max_size=12).map(b"".join)


def _cuts(data, draw, n):
    return sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=10)))) if n > 1 else []


@settings(max_examples=300)
@given(messages, st.data())
def test_any_split_round_trips(msg, data):
    """Cut the message anywhere; send each piece as MSG_DATA, or MSG_ZERO when it is all zero."""
    cuts = [c for c in _cuts(msg, data.draw, len(msg)) if 0 < c < len(msg)]
    bounds = [0, *cuts, len(msg)]
    r = Reassembler(1 << 16)
    first = bounds[1] if data.draw(st.booleans()) else 0  # MSG_BEGIN with or without data
    out = r.begin(P.WRITE_MEM, len(msg), crc32(msg), msg[:first])
    pieces = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > first]
    pieces = [(max(a, first), b) for a, b in pieces]
    for a, b in pieces:
        assert out is None and r.received == a
        piece = msg[a:b]
        out = r.zero(a, b - a) if not any(piece) and data.draw(st.booleans()) else r.data(a, piece)
    assert out == (P.WRITE_MEM, msg)
    assert not r.open  # the buffer is free for the next message


def _held(r):
    """The reassembler's state, compared before and after a refused fragment."""
    return (r.open, r.received, r.total, list(r.starts), list(r.ends), bytes(r.buf))


def _missing_ref(have, n, start):
    """Missing ranges from ``start`` computed from a per-byte ``have`` mask (independent of the range bookkeeping)."""
    out, i = [], start
    while i < n:
        if have[i]:
            i += 1
            continue
        j = i
        while j < n and not have[j]:
            j += 1
        out.append((i, j))
        i = j
    return out


@settings(max_examples=300)
@given(messages, st.data())
def test_any_order_with_duplicates_reassembles_exactly(msg, data):
    """Selective repeat: the pieces of any cut, in any order, each possibly repeated, rebuild the message exactly;
    ``missing`` always equals the complement of what was sent (per-byte reference)."""
    n = len(msg)
    cuts = [c for c in _cuts(msg, data.draw, n) if 0 < c < n]
    bounds = [0, *cuts, n]
    first = bounds[1] if data.draw(st.booleans()) else 0
    pieces = [(max(a, first), b) for a, b in zip(bounds, bounds[1:]) if b > first]
    order = data.draw(st.permutations(pieces))
    dups = data.draw(st.lists(st.integers(0, max(0, len(order) - 1)), max_size=6)) if order else []
    seq = list(order)
    for k in sorted(dups, reverse=True):  # a repeat of an earlier piece, later in the stream
        seq.insert(data.draw(st.integers(k + 1, len(seq))), order[k])
    r = Reassembler(1 << 16)
    have = bytearray(n)
    have[:first] = b"\x01" * first
    out = r.begin(P.WRITE_MEM, n, crc32(msg), msg[:first])
    for a, b in seq:
        if out is not None:  # complete: the message is closed, a late duplicate finds nothing open
            with pytest.raises(ReassemblyError) as e:
                r.data(a, msg[a:b])
            assert e.value.code == E_FRAGMENT
            continue
        start = data.draw(st.integers(0, n))
        assert r.missing(start, 1 << 20) == _missing_ref(have, n, start)
        assert r.received == sum(have)
        piece = msg[a:b]
        out = r.zero(a, b - a) if not any(piece) and data.draw(st.booleans()) else r.data(a, piece)
        have[a:b] = b"\x01" * (b - a)
    assert out == (P.WRITE_MEM, msg)
    assert not r.open


@settings(max_examples=300)
@given(messages, st.data())
def test_bad_fragments_are_refused_and_change_nothing(msg, data):
    """Overlapping (partly, or with other bytes), out-of-range, empty and orphan fragments: E_FRAGMENT, state unchanged."""
    n = len(msg)
    r = Reassembler(1 << 16)
    with pytest.raises(ReassemblyError) as e:  # nothing open yet
        r.data(0, msg[:1])
    assert e.value.code == E_FRAGMENT
    have = bytearray(n)
    assert r.begin(P.WRITE_MEM, n, crc32(msg), b"") is None
    for a, b in data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 12)), max_size=6)):
        b = min(n, a + b)
        if any(have[a:b]) or sum(have) + (b - a) >= n:
            continue  # keep the message incomplete and the pieces disjoint
        assert r.data(a, msg[a:b]) is None
        have[a:b] = b"\x01" * (b - a)
    state = _held(r)
    bad = [lambda: r.data(n, b"x"), lambda: r.zero(0, n + 1), lambda: r.data(data.draw(st.integers(0, n)), bytes(n + 1)),
           lambda: r.zero(data.draw(st.integers(0, n)), 0), lambda: r.data(n + data.draw(st.integers(0, 9)), b"ab")]
    held = [i for i in range(n) if have[i]]
    if held:  # a fragment covering a held byte and a missing one (partial overlap)
        i = data.draw(st.sampled_from(held))
        gaps = [j for j in range(n) if not have[j]]
        j = data.draw(st.sampled_from(gaps))
        lo, hi = min(i, j), max(i, j) + 1
        bad.append(lambda: r.data(lo, msg[lo:hi]))
        bad.append(lambda: r.zero(lo, hi - lo))
        k = data.draw(st.sampled_from(held))  # a held byte re-sent with another value
        bad.append(lambda: r.data(k, bytes([msg[k] ^ data.draw(st.integers(1, 255))])))
    for f in bad:
        with pytest.raises(ReassemblyError) as e:
            f()
        assert e.value.code == E_FRAGMENT
        assert _held(r) == state
    if held:  # an exact duplicate is a no-op
        k = held[0]
        assert r.data(k, msg[k : k + 1]) is None and _held(r) == state
    out = None
    for lo, hi in r.missing(0, 1 << 20):  # the right fragments still complete it
        out = r.data(lo, msg[lo:hi])
    assert out == (P.WRITE_MEM, msg)


def test_range_limit_is_enforced_hand_computed():
    r = Reassembler(100, max_ranges=2)
    r.begin(P.EXEC, 10, crc32(bytes(range(10))), b"")
    assert r.data(0, b"\x00") is None and r.data(4, b"\x04") is None
    state = _held(r)
    with pytest.raises(ReassemblyError):  # a third disjoint range
        r.data(8, b"\x08")
    assert _held(r) == state
    assert r.data(1, b"\x01") is None  # joins the first range: fine
    assert (r.starts, r.ends, r.received) == ([0, 4], [2, 5], 3)
    assert r.missing(0, 8) == [(2, 4), (5, 10)] and r.missing(3, 1) == [(3, 4)]
    assert r.data(2, bytes([2, 3])) is None and (r.starts, r.ends) == ([0], [5])


@given(messages, st.integers(0, 7), st.integers(1, 255))
def test_corrupted_reassembly_is_never_accepted(msg, bit, x):
    """A message whose bytes differ from the announced CRC is discarded with E_MSG_CRC."""
    bad = bytearray(msg)
    bad[len(bad) // 2] ^= x
    r = Reassembler(1 << 16)
    with pytest.raises(ReassemblyError) as e:
        r.begin(P.EXEC, len(msg), crc32(msg), bytes(bad))
    assert e.value.code == E_MSG_CRC and not r.open
    with pytest.raises(ReassemblyError) as e:
        r.begin(P.EXEC, (1 << 16) + 1, 0, b"")  # over the board's max message
    assert e.value.code == E_FRAGMENT


@given(st.binary(min_size=1, max_size=500), st.data())
def test_reply_buffer_fetch_any_split(reply, data):
    rb = ReplyBuffer()
    with pytest.raises(ReassemblyError):
        rb.fetch(0, 10)
    rb.set(P.READBACK, reply)
    assert rb.crc == crc32(reply)
    got, pos = b"", 0
    while pos < len(reply):
        piece = rb.fetch(pos, data.draw(st.integers(1, 64)))
        got += piece
        pos += len(piece)
    assert got == reply
    for off, mx in ((len(reply), 1), (len(reply) + 5, 10), (0, 0)):
        with pytest.raises(ReassemblyError):
            rb.fetch(off, mx)


def test_query_spans_and_grid_cuts_hand_computed():
    # pieces as inclusive cell ranges -> (first cell, count) spans of at most 64 cells
    assert _spans([(0, 0), (1, 3), (70, 70)]) == [(0, 64), (70, 1)]
    assert _spans([(10, 100)]) == [(10, 64), (74, 27)]
    assert _spans([(5, 5)]) == [(5, 1)]
    assert list(_grid_cuts(0, 100, 32)) == [0, 32, 64, 96]
    assert list(_grid_cuts(10, 100, 32)) == [10, 32, 64, 96]


# ---------------------------------------------------------------- the board's message layer
class Wire:
    """Host stub talking to an in-process Board (flags settable per request)."""

    def __init__(self, max_payload=4096):
        self.b = Board(DEV, max_payload=max_payload)
        self.d = Deframer(1 << 20)
        self.seq = 0
        (r,) = self.req(P.HELLO, P.pack_hello(5), seq=0, nonce=0)
        self.nonce = r.nonce
        assert P.unpack_hello_reply(r.payload)[3:] == (max_payload, self.b.max_message)

    def req(self, t, payload=b"", seq=None, nonce=None, flags=0):
        if seq is None:
            self.seq += 1
            seq = self.seq
        out = []
        self.b.on_bytes(encode_frame(t, flags, seq, self.nonce if nonce is None else nonce, payload), lambda w: out.extend(self.d.feed(w)))
        return [e for e in out if not (isinstance(e, Frame) and e.type == P.ACCEPTED)]


def test_board_reassembles_executes_and_serves_fetch():
    w = Wire()
    image = np.arange(300, dtype="<u2")
    image[100:200] = 0
    inner = P.pack_write_mem(3, 40, image.tobytes())
    total, crc = len(inner), crc32(inner)
    (r,) = w.req(P.MSG_BEGIN, P.pack_msg_begin(P.WRITE_MEM, total, crc, inner[:50]))
    assert r.type == P.FRAG_ACK and P.unpack_frag_ack(r.payload) == (50, total)
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(60, inner[60:70]))  # out of order: taken (selective repeat)
    assert r.type == P.FRAG_ACK and P.unpack_frag_ack(r.payload) == (60, total)
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(55, inner[55:65]))  # overlaps [60, 70) partly: refused
    assert r.type == P.ERROR and P.unpack_error(r.payload)[0] == P.E_FRAGMENT
    (r,) = w.req(P.MSG_QUERY)  # no range list asked
    assert r.payload == P.pack_frag_ack(60, total)
    (r,) = w.req(P.MSG_QUERY, P.pack_msg_query(0, 4))
    assert P.unpack_frag_ack_missing(r.payload) == (60, total, [(50, 60), (70, total)])
    (r,) = w.req(P.MSG_QUERY, P.pack_msg_query(55, 1))
    assert P.unpack_frag_ack_missing(r.payload) == (60, total, [(55, 60)])
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(60, inner[60:70]))  # an exact duplicate: no-op
    assert P.unpack_frag_ack(r.payload) == (60, total)
    seq = w.seq + 1
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(50, inner[50:60]), seq=seq)
    assert P.unpack_frag_ack(r.payload) == (70, total)
    w.seq = seq
    # a shortened retransmission with the same seq is answered from the cache
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(50, inner[50:55]), seq=seq, flags=P.F_RETX)
    assert r.flags & P.F_RETX and P.unpack_frag_ack(r.payload) == (70, total)
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(70, inner[70:208]))
    assert P.unpack_frag_ack(r.payload) == (208, total)
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(50, inner[50:55]))  # a new seq: a held sub-range, a no-op
    assert r.flags == 0 and P.unpack_frag_ack(r.payload) == (208, total)
    (r,) = w.req(P.MSG_ZERO, P.pack_msg_zero(208, 200))
    assert P.unpack_frag_ack(r.payload) == (408, total)
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(408, inner[408:]))
    assert r.type == P.ACK  # the completed WRITE_MEM's own reply
    # read it back with a split reply: REPLY_HEAD, then FETCH in 7-byte pieces
    (h,) = w.req(P.READ_MEM, P.pack_read_mem(3, 40, 300), flags=P.F_SPLIT_REPLY)
    rtype, rtotal, rcrc = P.unpack_reply_head(h.payload)
    assert (rtype, rtotal) == (P.MEM_DATA, 600)
    got = b""
    while len(got) < rtotal:
        (r,) = w.req(P.FETCH, P.pack_fetch(len(got), 7))
        off, data = P.unpack_reply_data(r.payload)
        assert off == len(got) and len(data) <= 7
        got += data
    assert crc32(got) == rcrc and np.array_equal(np.frombuffer(got, "<u2"), image)
    (r,) = w.req(P.FETCH, P.pack_fetch(600, 7))
    assert r.type == P.ERROR and P.unpack_error(r.payload)[0] == P.E_FRAGMENT
    # small replies stay inline even when a split is allowed; HELLO cannot be wrapped
    (r,) = w.req(P.STATUS, flags=P.F_SPLIT_REPLY)
    assert r.type == P.STATUS_REPLY
    (r,) = w.req(P.MSG_BEGIN, P.pack_msg_begin(P.HELLO, 8, 0, b""))
    assert P.unpack_error(r.payload)[0] == P.E_FRAGMENT


def test_board_refuses_a_message_with_a_wrong_crc_and_executes_nothing():
    w = Wire()
    inner = P.pack_write_mem(1, 0, b"\x07\x00" * 40)
    (r,) = w.req(P.MSG_BEGIN, P.pack_msg_begin(P.WRITE_MEM, len(inner), crc32(inner) ^ 1, inner))
    assert r.type == P.ERROR and P.unpack_error(r.payload)[0] == P.E_MSG_CRC
    (r,) = w.req(P.READ_MEM, P.pack_read_mem(1, 0, 40))
    assert r.payload == bytes(80)  # the write never happened


# ---------------------------------------------------------------- end to end
BYTE_FAULTS = "byte_flip=0.01,byte_drop=0.01,byte_dup=0.01,seed=1"


@pytest.mark.slow
def test_llama_tiny_verify_passes_over_a_byte_corrupting_line(tmp_path):
    """1% of the wire bytes corrupted, 1% dropped and 1% duplicated, both directions:
    the verify run still matches the golden and is bit-identical to the simulator (lockstep),
    and the link counters show the damage and the retries."""
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model="llama-tiny", target="fpga", tokens=2, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r",
                               target_options={"faults": BYTE_FAULTS}))
    assert rep["outcome"] == "PASS", rep.get("error")
    link = rep["target_stats"]["link"]
    assert rep["target_stats"]["emulator"]["faults"] == BYTE_FAULTS
    assert link["crc_errors"] > 0 and link["retries"] > 0 and link["naks"] > 0
    assert link["fragment_budget"]["min"] < 256 < link["fragment_budget"]["max"]  # the budget adapted to the line
    assert link["cells_up"] > 0 and link["cells_down"] > 0 and 16 <= link["cell_up"] <= 256  # bulk went as short-frame streams
    assert rep["target_stats"]["load"]["reloads"] == {**rep["target_stats"]["load"]["reloads"], "full": 1, "warm": 2, "mismatch": 0}
    checks = {c["name"]: c["passed"] for c in rep["checks"]}
    assert checks["bit_identical_to_sim"] and checks["free_running_tokens"] and checks["teacher_forced_top1"]
    lock = rep["target_stats"]["lockstep"]
    assert lock["first_mismatch"] is None and lock["readbacks_compared"] > 0


def test_goodput_benchmark_delivers_bit_exact_rows_through_byte_faults():
    from nhil.targets.fpga.bench import BENCH_FAULTS_LIGHT, goodput_benchmark

    r = goodput_benchmark(64 << 10, faults=BENCH_FAULTS_LIGHT)
    assert r["verified"] and r["nbytes"] == 64 << 10  # one fpga-small row image, read back and compared
    assert r["link_kBps"] > 0 and r["retries"] > 0 and r["crc_errors"] > 0 and r["fragment_budget_min"] < 256


def test_a_line_that_goes_bad_mid_run_ends_in_link_fail_with_a_clear_message():
    """Board in-process on a pty; after the session is up its line starts corrupting half the bytes:
    the bounded retries run out and the target raises LinkError (LINK_FAIL), naming the request."""
    import threading

    from nhil.errors import LinkError
    from nhil.targets.fpga import FpgaTarget
    from nhil.targets.fpga.emulator import open_pty, serve_fd
    from nhil.targets.fpga.faults import FaultInjector, FaultSpec

    board = Board(DEV)
    master, slave, path = open_pty()
    stop = threading.Event()
    th = threading.Thread(target=serve_fd, args=(board, master), kwargs={"should_stop": stop.is_set}, daemon=True)
    th.start()
    try:
        with FpgaTarget(port=path, max_retries=3, frame_timeout=0.1) as t:
            t.write_row(0, 1, 2, np.arange(DEV.cols, dtype=np.uint16))  # clean line: works
            board.inj = FaultInjector(FaultSpec.parse("byte_flip=0.5,seed=2"))
            with pytest.raises(LinkError) as e:
                t.read_row(0, 1, 2)
            msg = str(e.value)
            assert e.value.outcome == "LINK_FAIL" and "READ_MEM" in msg and ("attempts" in msg or "bursts" in msg)
            assert "crc_errors=" in msg or "timeouts=" in msg  # the link counters are in the message
    finally:
        stop.set()
        th.join(5)
        os.close(master)
        os.close(slave)


def test_board_sends_the_replies_to_one_read_in_one_write_in_order():
    """A window of frames arriving in one read is answered with one write holding every reply, in request order."""
    w = Wire()
    inner = bytes(range(200))
    wire = encode_frame(P.MSG_BEGIN, 0, 10, w.nonce, P.pack_msg_begin(P.STATUS, len(inner), crc32(inner), b""))
    wire += b"".join(encode_frame(P.MSG_DATA, 0, 11 + i, w.nonce, P.pack_msg_data(40 * k, inner[40 * k : 40 * k + 40])) for i, k in enumerate((3, 1, 2)))
    wire += encode_frame(P.MSG_QUERY, 0, 14, w.nonce, P.pack_msg_query(0, 8))
    writes = []
    w.b.on_bytes(wire, writes.append)
    assert len(writes) == 1
    replies = list(w.d.feed(writes[0]))
    assert [r.seq for r in replies] == [10, 11, 12, 13, 14]
    assert [P.unpack_frag_ack(r.payload)[0] for r in replies[:4]] == [0, 40, 80, 120]
    assert P.unpack_frag_ack_missing(replies[4].payload) == (120, 200, [(0, 40), (160, 200)])
