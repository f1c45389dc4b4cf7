"""Short frames (link protocol section 12): codec properties, the board's handling, and streams through faults.

The codec is checked like the regular frames (round trip in any chunking, every single-bit error
detected); the board's side against a hand-built reassembly state; the host's streams end to end over
a pty with byte faults, bit-exactly.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nhil.isa.device import DEVICE_PRESETS
from nhil.targets.fpga import FpgaTarget
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga import stream as S
from nhil.targets.fpga.bench import synthetic_program
from nhil.targets.fpga.frame import END, SHORT_TYPES, Deframer, Frame, Short, crc32, encode_frame, encode_short
from test_fpga import Wire as _Wire

pytestmark = pytest.mark.fpga

DEV = DEVICE_PRESETS["fpga-small"]
shorts = st.tuples(st.sampled_from(list(SHORT_TYPES)), st.binary(min_size=2, max_size=300))


# ---------------------------------------------------------------- codec
def test_short_frame_layout_hand_computed():
    wire = S.s_data(0xBEEF, 0x010203, b"\xc0\x01")
    head = bytes([0x40, 0xEF, 0xBE, 0x03, 0x02, 0x01, 0xC0, 0x01])
    body = head + zlib.crc32(head).to_bytes(4, "little")
    assert wire == body.replace(b"\xdb", b"\xdb\xdd").replace(b"\xc0", b"\xdb\xdc") + b"\xc0"
    assert S.parse(0x40, body[1:-4]) == S.Data(0xBEEF, 0x010203, b"\xc0\x01")


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])  # input generation time depends on machine load
@given(shorts, st.data())
def test_every_short_frame_round_trips_in_any_chunking(fr, data):
    t, body = fr
    wire = bytes([END]) + encode_short(t, body)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    d = Deframer()
    evs = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)]):
        evs += d.feed(wire[a:b])
    assert evs == [Short(t, body)]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(shorts)
def test_every_single_bit_error_in_a_short_frame_is_detected(fr):
    t, body = fr
    wire = bytes([END]) + encode_short(t, body[:40])
    for bit in range(8, 8 * len(wire)):
        bad = bytearray(wire)
        bad[bit // 8] ^= 1 << (bit % 8)
        evs = Deframer().feed(bytes(bad) + bytes([END]))
        assert not any(isinstance(e, (Frame, Short)) for e in evs), bit


@given(st.integers(0, 0xFFFF), st.integers(0, S.MAX_OFFSET), st.integers(0, 16), st.integers(1, S.MAX_CELLS), st.data())
def test_short_fields_round_trip(tag, off, log2, n, data):
    want = bytes(data.draw(st.binary(min_size=(n + 7) // 8, max_size=(n + 7) // 8)))
    for wire, typ, expect in (
        (S.s_zero(tag, off, n), S.S_ZERO, S.Zero(tag, off, n)),
        (S.s_query(tag, 7, off, log2, n), S.S_QUERY, S.Cells(tag, 7, off, log2, n, b"")),
        (S.s_fetch(tag, 9, off, log2, n, want), S.S_FETCH, S.Cells(tag, 9, off, log2, n, want)),
        (S.s_bitmap(tag, 1, want), S.S_BITMAP, S.Bitmap(tag, 1, want)),
        (S.s_done(tag, 0, n), S.S_DONE, S.Done(tag, 0, n)),
        (S.s_ping(tag), S.S_PING, S.Ping(tag)),
    ):
        (ev,) = Deframer().feed(bytes([END]) + wire)
        assert ev.type == typ and S.parse(ev.type, ev.body) == expect
    flags = [S.bit(want, i) for i in range(n)]
    assert S.bits_of(flags) == bytes(b & ((1 << (n - 8 * k)) - 1 if n - 8 * k < 8 else 0xFF) for k, b in enumerate(want))


@pytest.mark.parametrize("typ, body", [(S.S_DATA, b"\1\0\0\0\0"), (S.S_ZERO, b"\1\0\0\0\0\0\0"), (S.S_QUERY, b"\0" * 7 + b"\4\0"),
                                       (S.S_QUERY, b"\0" * 7 + b"\4\x41"), (S.S_FETCH, b"\0" * 7 + b"\4\2"), (S.S_DONE, b"\0"), (0x4F, b"\0\0")])
def test_malformed_short_fields_are_refused(typ, body):
    with pytest.raises(S.ShortError):
        S.parse(typ, body)


# ---------------------------------------------------------------- the board's side (in process)
class Wire(_Wire):
    """The in-process host stub of test_fpga.py, plus short-frame bursts."""

    def short(self, *wires):
        return self.raw(bytes([END]) + b"".join(wires))


def _open(w: Wire, msg: bytes):
    (r,) = w.raw(encode_frame(P.HELLO, 0, 0, 0, P.pack_hello(1)))
    w.nonce = r.nonce
    (r,) = w.req(P.MSG_BEGIN, P.pack_msg_begin(P.WRITE_MEM, len(msg), crc32(msg), msg[:8]))
    assert r.type == P.FRAG_ACK
    return S.tag_of(crc32(msg))


def _bitmap(w, tag, off, log2, n):
    (ev,) = w.short(S.s_query(tag, 5, off, log2, n))
    b = S.parse(ev.type, ev.body)
    assert ev.type == S.S_BITMAP and b.qid == 5
    return b.status, ([S.bit(b.bits, i) for i in range(n)] if b.status == S.ST_OK else b.bits)


def test_board_takes_short_data_answers_bitmaps_and_never_replies_to_data():
    msg = P.pack_write_mem(7, 0, np.arange(1, 41, dtype="<u2").tobytes())  # 8 + 80 bytes
    w = Wire()
    tag = _open(w, msg)
    # cells of 16 bytes: [0,16) has 8 held; send [8,16) and [32,48); data frames get no reply
    assert w.short(S.s_data(tag, 8, msg[8:16]), S.s_data(tag, 32, msg[32:48])) == []
    assert _bitmap(w, tag, 0, 4, 6) == (S.ST_OK, [True, False, True, False, False, False])
    # another tag, an overlap, one that would complete the message: dropped, state unchanged
    before = w.b.counters["short_dropped"]
    rest = [S.s_data(tag ^ 1, 16, msg[16:32]), S.s_data(tag, 30, msg[30:34]), S.s_data(tag, 16, msg[16:32] + b"x" * 0)]
    w.short(*rest[:2])
    assert w.b.counters["short_dropped"] == before + 2
    w.short(rest[2], S.s_data(tag, 48, msg[48:80]))
    assert _bitmap(w, tag, 0, 4, 6) == (S.ST_OK, [True, True, True, True, True, False])
    assert w.short(S.s_data(tag, 80, msg[80:])) == [] and w.b.reasm.open  # completing by a short frame: refused
    # the completing fragment goes as MSG_DATA and gets the inner reply
    (r,) = w.req(P.MSG_DATA, P.pack_msg_data(80, msg[80:]))
    assert r.type == P.ACK
    assert w.b.backend.read(7, 0, 40).tolist() == list(range(1, 41))
    assert _bitmap(w, tag, 0, 4, 6) == (S.ST_GONE, b"")  # no message open any more


def test_board_streams_reply_cells_and_sends_no_nak_while_streaming():
    w = Wire()
    _open(w, b"x" * 100)
    data = np.arange(300, dtype="<u2").tobytes()  # 600 bytes
    w.b.backend.write(3, 0, np.frombuffer(data, "<u2"))
    w.seq += 1
    (head,) = w.raw(encode_frame(P.READ_MEM, P.F_SPLIT_REPLY, w.seq, w.nonce, P.pack_read_mem(3, 0, 300)))
    rtype, total, crc = P.unpack_reply_head(head.payload)
    assert (rtype, total, crc) == (P.MEM_DATA, 600, crc32(data))
    tag = S.tag_of(crc)
    want = S.bits_of([i in (0, 3, 9) for i in range(10)])  # cells of 64 bytes: 0, 3 and the last (9: 24 bytes)
    evs = w.short(S.s_fetch(tag, 11, 0, 6, 10, want), S.s_fetch(tag, 11, 0, 6, 10, want), S.s_ping(12))
    got = [(e.type, S.parse(e.type, e.body)) for e in evs]
    assert [t for t, _ in got] == [S.S_REPLY] * 3 + [S.S_DONE, S.S_DONE, S.S_PONG]
    assert [(x.offset, x.data) for _, x in got[:3]] == [(0, data[:64]), (192, data[192:256]), (576, data[576:])]
    assert got[3][1] == S.Done(11, S.ST_OK, 3) and got[4][1] == S.Done(11, S.ST_OK, 0)  # the copy: S_DONE only
    (e,) = w.short(S.s_fetch(tag ^ 1, 13, 0, 6, 1, b"\1"))
    assert S.parse(e.type, e.body).status == S.ST_GONE
    # a damaged run after a short frame: no NAK; after a regular frame: NAK
    assert w.raw(bytes([END, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47, END])) == []
    w.req(P.STATUS)
    (nak,) = w.raw(bytes([END, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47, END]))
    assert nak.type == P.NAK


def test_short_frames_need_a_session():
    w = Wire()
    assert w.short(S.s_ping(1), S.s_query(0, 2, 0, 4, 1)) == []
    assert w.b.counters["short_dropped"] == 2


# ---------------------------------------------------------------- streams end to end (pty, byte faults)
@pytest.mark.slow
@pytest.mark.parametrize("faults", ["byte_flip=0.01,byte_drop=0.01,byte_dup=0.01,seed=3", "byte_flip=0.02,dir=tx,seed=4", "byte_drop=0.02,dir=rx,seed=5"])
def test_load_and_read_back_bit_exactly_through_byte_faults(faults):
    prog = synthetic_program(96 << 10, "fpga-small", seed=2)
    with FpgaTarget(device="fpga-small", faults=faults, progress=False) as t:
        t.load(prog)
        for img in prog.bank_images:
            for ch, bank in ((0, 0), (1, 7)):
                np.testing.assert_array_equal(t.read_row(ch, bank, img.row), img.data[ch, bank])
        link = t.link
        up, down = "dir=tx" not in faults, "dir=rx" not in faults  # which directions the emulator damages
        if up:  # uploads went as short-frame streams of adapted cells
            assert link["cells_up"] > 0 and 16 <= link["cell_up"] <= 4096
        if down:  # replies were damaged and read back as streamed cells
            assert link["crc_errors"] + link["framing_errors"] > 0 and link["cells_down"] > 0 and 16 <= link["cell_down"] <= 4096
        assert t.status()["state"] == "loaded"


def test_cell_size_follows_the_measured_byte_survival_hand_computed():
    """k q^(k + h) (data per frame sent) peaks at k = -1/ln q: 1% / 1% / 1% bytes damaged -> q ~ 0.97 -> k ~ 33 -> 32."""
    import math

    t = FpgaTarget(port="loop://", progress=False)  # not opened: only the estimator is used
    assert t.session.bulk.cell("up") == 1 << 15  # no estimate yet: the budget (64 KiB), capped at 32 KiB cells
    t.session.bulk.lnq["up"] = math.log(0.97)
    assert t.session.bulk.cell("up") == 32
    t.session.bulk.lnq["up"] = math.log(0.999)  # 0.1% damaged: ~1 KiB frames
    assert t.session.bulk.cell("up") == 1024
    t.session.bulk.lnq["up"] = None
    t.session.bulk.learn("up", delivered=0, sent=10, wire_bytes=1000 + S.SHORT_OVERHEAD)  # nothing of 10 frames of 1000 B got through
    assert t.session.bulk.cell("up") <= 512
    t.session.bulk.lnq["down"] = None
    t.session.bulk.learn("down", delivered=int(1000 * math.exp(-1)), sent=1000, wire_bytes=44)  # 37% of 44-byte frames: ln q = -1/44
    assert t.session.bulk.cell("down") == 32 and t.link["cell_down"] == 32


@pytest.mark.slow
def test_a_board_reset_during_a_noisy_load_is_a_link_failure_naming_the_reset():
    prog = synthetic_program(256 << 10, "fpga-small", seed=3)
    with FpgaTarget(device="fpga-small", faults="byte_flip=0.01,byte_drop=0.005,reset_after=4000,seed=6", progress=False) as t:
        from nhil.errors import LinkError

        with pytest.raises(LinkError, match="board reset detected"):
            t.load(prog)
        with pytest.raises(LinkError, match="board reset detected"):  # and the session stays refused
            t.status()


@pytest.mark.nightly
@pytest.mark.real
def test_real_llama_verify_passes_bit_identically_over_a_byte_corrupting_line(tmp_path):
    """Issue 4's acceptance run: SmolLM2 (268 MB of weights) through 1% corrupted + 1% dropped + 1% duplicated
    wire bytes in both directions still matches the golden, bit-identical to the simulator at every SYNC; the
    weights cross the line once (warm reloads for the later runs). Measured 25 min on 2 cores (nightly)."""
    from nhil.verify import VerifyOptions, verify

    faults = "byte_flip=0.01,byte_drop=0.01,byte_dup=0.01,seed=1"
    rep = verify(VerifyOptions(model="llama", target="fpga", tokens=16, runs_dir=tmp_path / "r", target_options={"faults": faults}))
    assert rep["outcome"] == "PASS", rep.get("error")
    ts = rep["target_stats"]
    assert ts["lockstep"]["first_mismatch"] is None and ts["lockstep"]["syncs_compared"] > 1000
    assert ts["load"]["reloads"]["full"] == 1 and ts["load"]["reloads"]["warm"] == 2
    link = ts["link"]
    assert link["crc_errors"] > 1000 and link["retries"] > 1000 and link["cells_up"] > 0 and link["cells_down"] > 0


def test_messages_larger_than_the_fragment_cap_stream_on_a_clean_line():
    """A clean line with the fragment budget capped at 1 KiB: every 64 KiB WRITE_MEM goes as MSG_BEGIN + streamed
    1 KiB cells + the last byte, and a 64 KiB READ_MEM reply as streamed cells; all bit-exact.

    What the protocol guarantees on a clean line is asserted: the bytes arrive bit-exact, no
    byte is damaged (no CRC error), every cell respects the cap. The retry count is not: a
    reply that is late because the machine is loaded is retransmitted (that is correct
    behaviour, bounded by ``max_retries`` per frame, else the load would raise LinkError)."""
    prog = synthetic_program(128 << 10, "fpga-small", seed=4)
    with FpgaTarget(device="fpga-small", max_fragment=1024, progress=False) as t:
        t.load(prog)
        img = prog.bank_images[1]
        got = t.session.transact(P.READ_MEM, P.pack_read_mem(img.row, 0, img.data.size), P.MEM_DATA, reply_size=2 * img.data.size)
        assert got.payload == img.data.astype("<u2").tobytes()
        link = t.link
        assert link["cells_up"] >= 2 * 63 and link["cells_down"] >= 64 and link["crc_errors"] == 0
        assert link["cell_up"] == 1024 and link["cell_down"] == 1024
