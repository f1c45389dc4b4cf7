"""FPGA target: frame codec properties, the device side's defences, and end-to-end runs over a pty.

The end-to-end tests start the board emulator as a subprocess on a pseudo-terminal
(``FpgaTarget(port=None)``), exactly as ``make verify TARGET=fpga`` does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import LinkError, RunError, SetupError
from nhil.isa.device import DEVICE_PRESETS
from nhil.isa.instr import ALL_CH, Instr, Op
from nhil.runtime.executor import Runner
from nhil.targets.base import ResolvedInstr
from nhil.targets.fpga import FpgaTarget, link_benchmark
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.emulator import Board
from nhil.targets.fpga.faults import FaultInjector, FaultSpec
from nhil.targets.fpga.frame import (BAD_OVERSIZE, END, SHORT_TYPES, Bad, Deframer, Frame, Short, crc32, decode_body, encode_body, encode_frame,
                                     escape, unescape)
from nhil.targets.sim import SimTarget

from fpga_programs import assert_identical, program, run  # tests/fpga_programs.py

pytestmark = pytest.mark.fpga

DEV = DEVICE_PRESETS["fpga-small"]  # 2 channels x 16 banks x 1024 rows x 1024 cols

regular_types = st.integers(0, 255).filter(lambda t: t not in SHORT_TYPES)  # 0x40-0x4F open a short frame instead
frames = st.tuples(regular_types, st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.binary(max_size=600))
# payloads rich in the two special bytes, to exercise escaping
special = st.lists(st.sampled_from([0xC0, 0xDB, 0xDC, 0xDD, 0x00, 0x41]), max_size=200).map(bytes)


# ---------------------------------------------------------------- frame codec
def test_crc_is_zlib_crc32():
    assert crc32(b"123456789") == 0xCBF43926


@settings(max_examples=300)
@given(frames, st.data())
def test_every_frame_round_trips_in_any_chunking(fr, data):
    t, fl, seq, nonce, payload = fr
    wire = encode_frame(t, fl, seq, nonce, payload)
    assert wire[0] == END and wire[-1] == END and END not in wire[1:-1]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    d = Deframer()
    evs = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)]):
        evs += d.feed(wire[a:b])
    assert evs == [Frame(t, fl, seq, nonce, payload)]


@given(special)
def test_escape_round_trips_special_bytes(body):
    assert unescape(escape(body)) == body
    assert END not in escape(body)


@given(st.binary(max_size=2000))
def test_garbage_never_crashes_and_is_never_accepted(garbage):
    d = Deframer(max_payload=512)
    evs = d.feed(garbage) + d.feed(bytes([END]))
    assert all(isinstance(e, Bad) for e in evs)


@given(st.binary(max_size=300), frames)
def test_decoder_resyncs_after_garbage(garbage, fr):
    d = Deframer()
    evs = d.feed(garbage) + d.feed(encode_frame(*fr))
    assert evs[-1] == Frame(*fr)
    assert sum(isinstance(e, Frame) for e in evs) == 1


@given(frames, st.data())
def test_truncated_frames_are_never_accepted(fr, data):
    wire = encode_frame(*fr)
    k = data.draw(st.integers(1, len(wire) - 2))  # at least one byte of the body (or its CRC) missing
    d = Deframer()
    evs = d.feed(wire[:k])
    evs += d.feed(bytes([END]))  # the line goes idle, a stray END arrives
    assert not any(isinstance(e, Frame) for e in evs)
    # and the next complete frame still decodes
    assert d.feed(encode_frame(1, 0, 7, 9, b"next"))[-1] == Frame(1, 0, 7, 9, b"next")


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(regular_types, st.integers(0, 0xFFFF), st.one_of(st.binary(max_size=48), special.map(lambda b: b[:48])))
def test_every_single_bit_error_is_detected(t, seq, payload):
    wire = encode_frame(t, 0, seq, 0x1234, payload)
    good = Frame(t, 0, seq, 0x1234, payload)
    primer = encode_frame(0x80, 0, 1, 1, b"")
    for bit in range(8 * len(wire)):
        bad = bytearray(wire)
        bad[bit // 8] ^= 1 << (bit % 8)
        for prime in (False, True):  # fresh decoder, and one that is mid-stream
            d = Deframer()
            evs = d.feed(primer) if prime else []
            evs = d.feed(bytes(bad)) + d.feed(bytes([END]))
            assert not any(isinstance(e, (Frame, Short)) for e in evs), (bit, prime)
    body = encode_body(t, 0, seq, 0x1234, payload)
    assert decode_body(body, 1 << 16) == good
    for bit in range(8 * len(body)):
        b = bytearray(body)
        b[bit // 8] ^= 1 << (bit % 8)
        assert isinstance(decode_body(bytes(b), 1 << 16), Bad)


def test_oversized_run_is_reported_once_and_decoder_recovers():
    d = Deframer(max_payload=100)
    evs = d.feed(bytes([END]) + b"\x41" * 1000)
    evs += d.feed(b"\x41" * 1000 + bytes([END]))
    assert [e.reason for e in evs] == [BAD_OVERSIZE]
    assert d.feed(encode_frame(2, 0, 3, 4, b"ok")) == [Frame(2, 0, 3, 4, b"ok")]
    big = encode_frame(2, 0, 3, 4, b"x" * 101)  # valid CRC, payload over the limit
    assert [e.reason for e in d.feed(big)] == [BAD_OVERSIZE]


@given(st.binary(max_size=400), st.integers(0, 2**32 - 1), st.sampled_from(["byte", "frame"]))
def test_fault_injector_is_seeded_and_total(data, seed, unit):
    spec = FaultSpec.parse(f"{unit}_flip=0.5,{unit}_drop=0.5,{unit}_dup=0.5,seed={seed % 1000}")
    a, b = FaultInjector(spec), FaultInjector(spec)
    assert a.tx(data) == b.tx(data)
    assert a.rx(data + bytes([END])) == b.rx(data + bytes([END]))


def test_fault_spec_rejects_bad_and_ambiguous_items():
    with pytest.raises(SetupError, match="probabilities"):
        FaultSpec.parse("byte_flip=2")
    with pytest.raises(SetupError, match="keys:"):
        FaultSpec.parse("flop=0.1")
    for old in ("flip=0.01", "drop=0.01", "dup=0.01", "unit=byte"):
        with pytest.raises(SetupError, match="ambiguous"):
            FaultSpec.parse(old)
    f = FaultSpec.parse("byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,frame_delay=0.001,reset_after=500,seed=1")
    assert (f.byte_flip, f.byte_drop, f.byte_dup, f.frame_delay, f.reset_after, f.seed) == (0.01, 0.002, 0.002, 0.001, 500, 1)
    assert f.per_byte and f.per_frame and FaultSpec.parse("").active is False


def test_byte_faults_hit_each_byte_at_the_given_rate():
    """Per-byte rates: counts over 200 kB fall in a 5-sigma binomial band; flipped bytes always change value."""
    n = 200_000
    data = bytes(range(256)) * (n // 256)
    inj = FaultInjector(FaultSpec.parse("byte_flip=0.01,seed=5"))
    out = np.frombuffer(inj.tx(data), np.uint8)
    changed = int((out != np.frombuffer(data, np.uint8)).sum())
    assert changed == inj.counts["byte_flip"]  # a flipped byte is never left unchanged
    sigma = (len(data) * 0.01 * 0.99) ** 0.5
    assert abs(changed - 0.01 * len(data)) < 5 * sigma
    inj = FaultInjector(FaultSpec.parse("byte_drop=0.01,byte_dup=0.02,seed=6,dir=tx"))
    out = inj.tx(data)
    assert len(out) == len(data) - inj.counts["byte_drop"] + inj.counts["byte_dup"]
    assert abs(inj.counts["byte_drop"] - 0.01 * len(data)) < 5 * sigma
    assert abs(inj.counts["byte_dup"] - 0.02 * 0.99 * len(data)) < 5 * (len(data) * 0.02) ** 0.5
    assert inj.rx(data) == data  # dir=tx leaves the receive direction alone


# ---------------------------------------------------------------- device side (in process)
class Wire:
    """Host stub talking to an in-process Board."""

    def __init__(self, device=DEV, max_payload=4096):
        self.b = Board(device, max_payload=max_payload)
        self.d = Deframer(1 << 20)
        self.seq = 0
        self.nonce = 0

    def raw(self, data: bytes) -> list:
        out = []
        self.b.on_bytes(data, lambda w: out.extend(self.d.feed(w)))
        return out

    def req(self, t, payload=b"", seq=None, nonce=None):
        if seq is None:
            self.seq += 1
            seq = self.seq
        evs = self.raw(encode_frame(t, 0, seq, self.nonce if nonce is None else nonce, payload))
        return [e for e in evs if not (isinstance(e, Frame) and e.type == P.ACCEPTED)]

    def hello(self):
        (r,) = self.req(P.HELLO, P.pack_hello(5), seq=0)
        assert r.type == P.HELLO_REPLY
        self.nonce = r.nonce
        return r


def _err(evs):
    (e,) = evs
    assert isinstance(e, Frame) and e.type == P.ERROR, e
    return P.unpack_error(e.payload)


def test_board_requires_hello_and_matching_nonce():
    w = Wire()
    assert _err(w.req(P.STATUS))[0] == P.E_SESSION
    w.hello()
    assert w.req(P.STATUS)[0].type == P.STATUS_REPLY
    code, msg = _err(w.req(P.STATUS, nonce=w.nonce ^ 1))
    assert code == P.E_SESSION and "HELLO needed" in msg
    code, msg = _err(w.req(P.HELLO, P.pack_hello(1)[:-1] + b"", seq=0))
    assert code == P.E_BAD_LENGTH


def test_board_rejects_bad_lengths_addresses_and_types_and_keeps_serving():
    w = Wire()
    w.hello()
    image = DEV.channels * DEV.banks * DEV.cols
    assert _err(w.req(P.WRITE_MEM, P.pack_write_mem(DEV.rows, 0, b"\1\0")))[0] == P.E_ADDRESS
    assert _err(w.req(P.WRITE_MEM, P.pack_write_mem(0, image - 1, b"\1\0\2\0")))[0] == P.E_ADDRESS
    assert _err(w.req(P.WRITE_MEM, P.pack_write_mem(0, 0xFFFFFFFF, b"\1\0")))[0] == P.E_ADDRESS
    assert _err(w.req(P.WRITE_MEM, P.pack_write_mem(0, 0, b"\1")))[0] == P.E_BAD_LENGTH
    assert _err(w.req(P.READ_MEM, P.pack_read_mem(0, 0, 0xFFFFFFFF)))[0] == P.E_ADDRESS
    assert _err(w.req(P.READ_MEM, P.pack_read_mem(0, 0, 4000)))[0] == P.E_OVERSIZE  # 8000 B > max payload
    assert _err(w.req(0x5A, b"?"))[0] == P.E_UNKNOWN_TYPE
    assert _err(w.req(P.ACK))[0] == P.E_UNKNOWN_TYPE
    assert _err(w.req(P.LOAD_END, P.pack_load_end(0, 0, 0)))[0] == P.E_STATE
    assert _err(w.req(P.LOAD_PROGRAM, P.pack_load_program(DEV.rows + 1)))[0] == P.E_ADDRESS
    # EXEC: bad opcode, HOST op, unresolved position flag, lying payload lengths, run error
    word = Instr(Op.NOP).encode()
    assert _err(w.req(P.EXEC, P.pack_exec([(0, b"\x77" + word[1:], b"")])))[0] == P.E_BAD_INSTR
    assert _err(w.req(P.EXEC, P.pack_exec([(0, Instr(Op.HOST).encode(), b"")])))[0] == P.E_BAD_INSTR
    assert _err(w.req(P.EXEC, P.pack_exec([(0, Instr(Op.WR_SBK, flags=2).encode(), b"\0" * 32)])))[0] == P.E_BAD_INSTR
    assert _err(w.req(P.EXEC, P.pack_exec([(0, word, b"xx")])))[0] == P.E_BAD_LENGTH
    assert _err(w.req(P.EXEC, b"\xff\xff\xff\xff" + word))[0] == P.E_BAD_LENGTH
    assert _err(w.req(P.EXEC, P.pack_exec([(0, word, b"")]) + b"junk"))[0] == P.E_BAD_LENGTH
    code, msg = _err(w.req(P.EXEC, P.pack_exec([(3, Instr(Op.MAC_AB, ALL_CH, row=DEV.rows, n=1).encode(), b"")])))
    assert code == P.E_RUN and "instruction 3 (MAC_AB)" in msg
    # a frame whose header length lies (CRC valid): ERROR with its seq
    body = bytearray(encode_body(P.STATUS, 0, 77, w.nonce, b"abcd"))
    body[8:12] = (2).to_bytes(4, "little")
    body[-4:] = crc32(bytes(body[:-4])).to_bytes(4, "little")
    (e,) = w.raw(bytes([END]) + escape(bytes(body)) + bytes([END]))
    assert e.type == P.ERROR and e.seq == 77 and P.unpack_error(e.payload)[0] == P.E_BAD_LENGTH
    # oversized and corrupted frames: NAK with the reason
    (e,) = w.raw(encode_frame(P.WRITE_MEM, 0, 99, w.nonce, b"\0" * 5000))
    assert e.type == P.NAK and P.unpack_error(e.payload)[0] == P.E_OVERSIZE
    bad = bytearray(encode_frame(P.STATUS, 0, 100, w.nonce))
    bad[5] ^= 0x10
    (e,) = w.raw(bytes(bad))
    assert e.type == P.NAK and P.unpack_error(e.payload)[0] == P.E_CRC
    (e,) = w.raw(bytes([END, 0xDB, 0x41, END]))
    assert e.type == P.NAK and P.unpack_error(e.payload)[0] == P.E_FRAMING
    # still serving, memory intact and writable
    assert w.req(P.WRITE_MEM, P.pack_write_mem(5, image - 2, b"\1\0\2\0"))[0].type == P.ACK
    (r,) = w.req(P.READ_MEM, P.pack_read_mem(5, image - 2, 2))
    assert r.type == P.MEM_DATA and r.payload == b"\1\0\2\0"
    st_ = P.unpack_status(w.req(P.STATUS)[0].payload)
    assert st_["frames_bad"] == 4 and st_["board_nonce"] == w.nonce


def test_board_answers_a_retransmitted_request_from_its_cache_without_reexecuting():
    w = Wire()
    w.hello()
    pl = P.pack_exec([(0, Instr(Op.WR_ACC, 0, k=0, col=0, n=1).encode(), np.float32([1.5]).tobytes()),
                      (1, Instr(Op.RD_ACC, 0, k=0, col=0, n=1).encode(), b"")])
    (r1,) = w.req(P.EXEC, pl, seq=40)
    (r2,) = w.req(P.EXEC, pl, seq=40)
    assert r1.payload == r2.payload and r2.flags & P.F_RETX
    assert w.b.backend.instructions() == 2
    assert P.unpack_readback(r2.payload)[0].tolist() == [1.5]


def test_load_end_checks_what_arrived():
    w = Wire()
    w.hello()
    assert w.req(P.LOAD_PROGRAM, P.pack_load_program(1))[0].type == P.ACK
    pl = P.pack_write_mem(0, 0, b"\1\0" * 8)
    assert w.req(P.WRITE_MEM, pl)[0].type == P.ACK
    code, msg = _err(w.req(P.LOAD_END, P.pack_load_end(len(pl), 2, 0)))
    assert code == P.E_LOAD_CHECK and "load check failed" in msg
    # the refused LOAD_END left the load in progress: the true counts and CRC still commit it
    import zlib

    assert w.req(P.LOAD_END, P.pack_load_end(len(pl), 1, zlib.crc32(pl)))[0].type == P.ACK and w.b.state == 2


# ---------------------------------------------------------------- end to end over a pty
@pytest.fixture(scope="module")
def sim_result():
    prog = program()
    return prog, run(prog, SimTarget())


def test_fpga_bit_identical_to_sim(sim_result):
    prog, ref = sim_result
    with FpgaTarget(device="fpga-small") as t:
        caps = t.capabilities()
        assert caps.device == DEV and caps.isa_version == 0
        got = run(prog, t)
        assert_identical(ref, got)
        sim = SimTarget()
        sim.load(prog)
        for img in prog.bank_images[:3]:
            np.testing.assert_array_equal(t.read_row(1, 15, img.row), sim.read_row(1, 15, img.row))
        t.write_row(0, 3, 1000, np.arange(DEV.cols, dtype=np.uint16))
        np.testing.assert_array_equal(t.read_row(0, 3, 1000), np.arange(DEV.cols, dtype=np.uint16))
        s = t.stats()
        assert s["link"]["frames_tx"] > 0 and s["link"]["crc_errors"] == 0  # retries depend on machine load (timeouts), not asserted
        assert t.status()["state"] == "loaded"


def test_run_error_on_board_matches_sim():
    bad = [ResolvedInstr(7, Instr(Op.MAC_AB, ALL_CH, row=DEV.rows + 1, n=1), None)]
    prog = ProgramBuilder(DEV).finish({"inputs": {}, "outputs": {}}, {})
    sim = SimTarget(device=DEV)
    sim.load(prog)
    with pytest.raises(RunError) as e_sim:
        sim.execute(bad)
    with FpgaTarget(device="fpga-small") as t:
        t.load(prog)
        with pytest.raises(RunError) as e_fpga:
            t.execute(bad)
        assert str(e_fpga.value) == str(e_sim.value)
        assert t.execute([ResolvedInstr(0, Instr(Op.SYNC), None)]) == []  # still serving


@pytest.mark.parametrize("faults", [
    "frame_flip=0.01,frame_drop=0.002,frame_dup=0.002,frame_delay=0.001,seed=1",
    "frame_flip=0.25,frame_drop=0.1,frame_dup=0.1,frame_delay=0.02,delay_ms=5,seed=7",
])
def test_fpga_bit_identical_under_faults(sim_result, faults):
    prog, ref = sim_result
    with FpgaTarget(device="fpga-small", faults=faults, frame_timeout=0.2) as t:
        got = run(prog, t)
        link = t.stats()["link"]
    assert_identical(ref, got)
    if "0.25" in faults:
        assert link["retries"] > 0 and link["crc_errors"] + link["framing_errors"] + link["naks"] > 0


def test_fpga_bit_identical_under_byte_rate_faults(sim_result):
    prog, ref = sim_result
    faults = "byte_flip=1e-4,byte_drop=2e-5,byte_dup=2e-5,seed=3"
    with FpgaTarget(device="fpga-small", faults=faults, chunk_bytes=2048, frame_timeout=0.2) as t:
        got = run(prog, t)
        link = t.stats()["link"]
    assert_identical(ref, got)
    assert link["retries"] > 0


@pytest.mark.parametrize("reset_after", [6, 20])  # during the load, during the steps
def test_board_reset_mid_run_is_link_fail(sim_result, reset_after):
    prog, _ = sim_result
    with FpgaTarget(device="fpga-small", faults=f"reset_after={reset_after}") as t:
        r = Runner(prog, t)
        results = []
        with pytest.raises(LinkError, match="board reset detected") as e:
            r.reset()
            for s in range(5):
                results.append(r.step(s, s))
        assert "nonce" in str(e.value) and e.value.outcome == "LINK_FAIL"
        assert len(results) < 5  # the step that saw the reset produced nothing
        with pytest.raises(LinkError, match="board reset detected"):  # and the session stays dead
            t.execute([ResolvedInstr(0, Instr(Op.SYNC), None)])


def test_emulator_keeps_serving_bad_frames_over_the_pty():
    with FpgaTarget(device="fpga-small") as t:
        t.session.transport.write(bytes([END]) + os.urandom(3000) + bytes([END]))
        t.session.transport.write(encode_frame(P.WRITE_MEM, 0, 500, t.session.board_nonce, b"\0" * (t.session.max_payload + 64)))
        t.session.transport.write(encode_frame(0x5A, 0, 501, t.session.board_nonce, b""))
        t.session.transport.write(encode_frame(P.WRITE_MEM, 0, 502, t.session.board_nonce, P.pack_write_mem(DEV.rows, 0, b"\0\0")))
        seen = {}
        deadline = time.monotonic() + 5
        while not (501 in seen and 502 in seen) and time.monotonic() < deadline:
            ev = t.session.recv(deadline)
            if isinstance(ev, Frame):
                code = P.unpack_error(ev.payload)[0] if ev.type in (P.ERROR, P.NAK) else None
                seen[ev.seq if ev.type == P.ERROR else ("nak", code)] = (ev.type, code)
        assert seen.get(501) == (P.ERROR, P.E_UNKNOWN_TYPE)
        assert seen.get(502) == (P.ERROR, P.E_ADDRESS)
        assert ("nak", P.E_OVERSIZE) in seen
        t.session.seq = 502  # seq 502 was executed (refused with E_ADDRESS): within a session seqs only move forward (section 3)
        with pytest.raises(RunError, match="row 1024 >= 1024"):
            t.write_row(0, 0, DEV.rows, np.zeros(DEV.cols, np.uint16))
        t.write_row(1, 2, 3, np.full(DEV.cols, 7, np.uint16))
        assert (t.read_row(1, 2, 3) == 7).all()


def test_loop_url_fails_clearly():
    t = FpgaTarget(port="loop://", open_timeout=0.5)
    with pytest.raises(LinkError, match="loopback"):
        t.open()


def test_faults_need_the_emulator():
    with pytest.raises(SetupError):
        FpgaTarget(port="/dev/ttyUSB9", faults="byte_flip=0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_mode_on_loopback_with_env_port(sim_result, monkeypatch):
    prog, ref = sim_result
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nhil.targets.fpga.cli", "--device", "fpga-small", "--tcp", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline().decode().strip()
        assert line == f"socket://127.0.0.1:{port}"
        monkeypatch.setenv("FPGA_PORT", line)
        with FpgaTarget() as t:
            assert t.url == line and t.proc is None
            assert_identical(ref, run(prog, t))
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.rtl
@pytest.mark.parametrize("device", ["rtl-tiny", "rtl-tiny2"])  # one channel; two (pim_device)
def test_rtl_backend_if_available(device):
    pytest.importorskip("nhil.targets.rtl.target")
    dev = DEVICE_PRESETS[device]
    b = ProgramBuilder(dev)
    rng = np.random.default_rng(1)
    b.buffer("x", 200)
    b.buffer("y", 40)
    b.host_image("x0", rng.normal(size=200).astype(np.float32))
    b.host("add", ["x0", "x0"], ["x"])
    b.gemv(b.place_matrix("w", rng.normal(size=(40, 200)).astype(np.float32)), "x", "y")
    prog = b.finish({"inputs": {}, "outputs": {"y": "y"}}, {})
    ref = run(prog, SimTarget(), steps=2)
    try:
        with FpgaTarget(device=device, rtl=True, run_timeout=600) as t:
            got = run(prog, t, steps=2)
    except (LinkError, SetupError) as e:
        pytest.skip(f"RTL backend not usable here: {e}")
    assert_identical(ref, got)


def test_link_benchmark_small():
    r = link_benchmark(4 << 20, device="fpga-small")
    assert r["verified"] and r["nbytes"] >= 4 << 20
    assert 0.95 < r["wire_efficiency"] <= 1 and r["link_MBps"] > 0 and r["raw_pty_MBps"] > 0


def test_a_stage_timeout_inside_a_serial_read_stays_a_timeout_not_a_link_failure():
    """verify's SIGALRM stage timeout can land inside pyserial's read: the transport must let it
    through (outcome TIMEOUT), while a real serial error still becomes a LinkError (TransportError)."""
    from nhil.errors import LinkError
    from nhil.targets.fpga.errors import TransportError
    from nhil.targets.fpga.session import Session
    from nhil.targets.fpga.transport import SerialTransport
    from nhil.verify import StageTimeout

    class Port:
        def __init__(self, exc):
            self.exc, self.in_waiting = exc, 0

        def read(self, n):
            raise self.exc

    s = Session(SerialTransport(Port(StageTimeout("stage load_target exceeded its timeout of 1800 s")), "loop://"))
    with pytest.raises(StageTimeout):
        s.recv(time.monotonic() + 5)
    s = Session(SerialTransport(Port(OSError(5, "Input/output error")), "loop://"))
    with pytest.raises(TransportError, match="read from loop:// failed") as e:
        s.recv(time.monotonic() + 5)
    assert isinstance(e.value, LinkError) and e.value.outcome == "LINK_FAIL"


# ---------------------------------------------------------------- warm reload (RESET_KEEP_ROWS + MEM_CRC)
def test_board_reset_keep_rows_and_mem_crc():
    import zlib

    w = Wire()
    w.hello()
    image = DEV.channels * DEV.banks * DEV.cols
    rng = np.random.default_rng(3)
    rows = {r: rng.integers(1, 0x7F00, image, dtype=np.uint16) for r in (2, 3, 9)}
    for r, a in rows.items():  # in pieces that fit the 4096-byte max payload
        for off in range(0, image, 1024):
            assert w.req(P.WRITE_MEM, P.pack_write_mem(r, off, a[off : off + 1024].astype("<u2").tobytes()))[0].type == P.ACK
    zero = np.zeros(image, np.uint16)

    def crc(rs):  # the CRC of the row images concatenated, computed here with zlib on numpy arrays
        c = 0
        for r in rs:
            c = zlib.crc32(rows.get(r, zero).astype("<u2").tobytes(), c)
        return c

    def mem_crc(row, count):
        (r,) = w.req(P.MEM_CRC, P.pack_mem_crc(row, count))
        assert r.type == P.MEM_CRC_REPLY
        return P.unpack_mem_crc_reply(r.payload)

    assert mem_crc(2, 2) == crc([2, 3]) and mem_crc(1, 9) == crc(range(1, 10))
    # out-of-range requests are refused and change nothing
    assert _err(w.req(P.MEM_CRC, P.pack_mem_crc(DEV.rows - 1, 2)))[0] == P.E_ADDRESS
    assert _err(w.req(P.MEM_CRC, P.pack_mem_crc(0, 0)))[0] == P.E_ADDRESS
    assert _err(w.req(P.RESET, P.pack_reset([(2, 2), (DEV.rows, 1)])))[0] == P.E_ADDRESS
    assert _err(w.req(P.RESET, P.pack_reset([(2, 0xFFFFFFFF)])))[0] == P.E_ADDRESS
    assert _err(w.req(P.RESET, P.pack_reset([(2, 2)]) + b"x"))[0] == P.E_BAD_LENGTH
    assert _err(w.req(P.RESET, (2).to_bytes(4, "little") + bytes(4)))[0] == P.E_BAD_LENGTH  # unknown flag
    assert mem_crc(9, 1) == crc([9])
    # GB/ACC state is cleared, rows 2 and 3 stay, row 9 reads as zero
    pl = P.pack_exec([(0, Instr(Op.WR_ACC, 0, k=0, col=0, n=1).encode(), np.float32([1.5]).tobytes())])
    assert w.req(P.EXEC, pl)[0].type == P.READBACK
    assert w.req(P.RESET, P.pack_reset([(2, 2)]))[0].type == P.ACK
    del rows[9]
    assert mem_crc(1, 9) == crc(range(1, 10)) and mem_crc(9, 1) == crc([9]) == zlib.crc32(zero.tobytes())
    (r,) = w.req(P.EXEC, P.pack_exec([(0, Instr(Op.RD_ACC, 0, k=0, col=0, n=1).encode(), b"")]))
    assert P.unpack_readback(r.payload)[0].tolist() == [0.0]
    (r,) = w.req(P.READ_MEM, P.pack_read_mem(3, 100, 4))
    assert r.payload == rows[3][100:104].astype("<u2").tobytes()




def test_runner_reloads_warm_and_stays_bit_identical(sim_result):
    prog, ref = sim_result
    kv_row = max(img.row for img in prog.bank_images) + 3
    with FpgaTarget(device="fpga-small") as t:
        r = Runner(prog, t)
        for run in range(2):
            r.reset()
            outs = [{k: v.copy() for k, v in r.step(s, s).items()} for s in range(3)]
            assert_identical(ref, (outs, t.trace()))
            # what a run leaves behind: a written KV row, accumulators; the reload must clear both
            t.write_row(1, 2, kv_row, np.arange(DEV.cols, dtype=np.uint16) + 1)
            t.execute([ResolvedInstr(0, Instr(Op.WR_ACC, 0, k=1, col=0, n=1), np.float32([7.0]))])
        assert t.reloads["full"] == 1 and t.reloads["warm"] == 1 and t.reloads["mismatch"] == 0
        r.reset()
        assert not t.read_row(1, 2, kv_row).any()
        assert t.execute([ResolvedInstr(0, Instr(Op.RD_ACC, 0, k=1, col=0, n=1), None)])[0].tolist() == [0.0]
        assert t.stats()["load"]["reloads"]["warm"] == 2


def test_warm_reload_falls_back_to_a_full_load_when_a_weight_row_changed(sim_result, capsys):
    prog, _ = sim_result
    img = prog.bank_images[1]
    with FpgaTarget(device="fpga-small") as t:
        t.load(prog)
        t.write_row(0, 5, img.row, np.full(DEV.cols, 0x3F80, np.uint16))  # a stray write into the weights
        t.reload(prog)
        assert t.reloads == {**t.reloads, "full": 2, "warm": 0, "mismatch": 1}
        np.testing.assert_array_equal(t.read_row(0, 5, img.row), img.data[0, 5])
        import re

        (lo, hi), = [tuple(map(int, m)) for m in re.findall(r"board rows \[(\d+), (\d+)\)", capsys.readouterr().err)]
        assert lo <= img.row < hi
        other = program(seed=5)  # another program: always a full load
        t.reload(other)
        assert t.reloads["full"] == 3
