"""The FPGA host side in layers (transport / session / target, docs/link-protocol.md section 0), driven
over the in-memory transport pair: the board emulator answers inside the host's write, with no
pty, socket or thread. The reference is the functional simulator (bit for bit), the bytes the
host asked for, and the protocol's guarantees (delivered exactly once, bit-exact), never
retry counts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from nhil.errors import LinkError, RunError
from nhil.targets.fpga import FpgaTarget
from nhil.targets.fpga import errors as E
from nhil.targets.fpga import protocol as P
from nhil.targets.fpga.emulator import Board
from nhil.targets.fpga.frame import Deframer, Frame, encode_frame
from nhil.targets.fpga.session import Session
from nhil.targets.fpga.transport import Transport, memory_pair
from nhil.targets.sim import SimTarget

from fpga_programs import DEV, assert_identical, program, run  # tests/fpga_programs.py


def _board_behind(end, **kw) -> Board:
    board = Board(DEV, **kw)
    end.serve(board.on_bytes)
    return board


class Lossy(Transport):
    """A line that drops and corrupts bytes (each independently, seeded) in both directions."""

    def __init__(self, inner: Transport, drop: float, flip: float, seed: int) -> None:
        self.inner, self.drop, self.flip = inner, drop, flip
        self.url = "lossy+" + inner.url
        self.rng = np.random.default_rng(seed)
        self.damaged = 0

    def _damage(self, data: bytes) -> bytes:
        if not data:
            return data
        a = np.frombuffer(data, np.uint8).copy()
        flip = self.rng.random(a.size) < self.flip
        a[flip] ^= self.rng.integers(1, 256, int(flip.sum())).astype(np.uint8)
        keep = self.rng.random(a.size) >= self.drop
        self.damaged += int(flip.sum()) + int((~keep).sum())
        return a[keep].tobytes()

    def write(self, data: bytes) -> None:
        self.inner.write(self._damage(data))

    def read(self, timeout: float) -> bytes:
        return self._damage(self.inner.read(timeout))

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------- transport
def test_memory_pair_carries_bytes_both_ways_and_times_out_empty():
    a, b = memory_pair()
    payload = bytes(range(256)) * 5
    a.write(payload[:700])
    a.write(payload[700:])
    assert b.read(1.0) == payload and b.read(0) == b""
    b.write(b"\xc0ok\xc0")
    assert a.read(1.0) == b"\xc0ok\xc0"
    t0 = time.monotonic()
    assert a.read(0.05) == b""  # nothing sent: empty after the timeout, not before
    assert time.monotonic() - t0 >= 0.04
    b.close()
    with pytest.raises(E.TransportError, match="memory://host.*other end is closed"):
        a.write(b"x")


# ---------------------------------------------------------------- session + target over the pair
def test_a_program_over_the_in_memory_pair_is_bit_identical_to_the_simulator():
    """HELLO, INFO, LOAD (fragmented WRITE_MEMs), EXEC groups with readbacks, warm reloads, rows:
    every layer of the host side against the emulator, in one thread."""
    prog = program()
    ref = run(prog, SimTarget(device=DEV))
    assert len(ref[1]) > 0  # the trace compared has SYNC records
    host, dev = memory_pair()
    board = _board_behind(dev)
    with FpgaTarget(transport=host, progress=False) as t:
        assert t.capabilities().device == DEV and t.url == "memory://host"
        assert_identical(ref, run(prog, t, runs=2))  # the second run after a warm reload (RESET_KEEP_ROWS + MEM_CRC)
        assert t.reloads == {**t.reloads, "full": 1, "warm": 1, "mismatch": 0}
        sim = SimTarget(device=DEV)
        sim.load(prog)
        for img in prog.bank_images[:2]:
            assert t.read_row(1, 3, img.row).tobytes() == sim.read_row(1, 3, img.row).tobytes()
        stats = t.stats()
    assert stats["port"] == "memory://host" and "emulator" not in stats  # a given transport is not an emulator we started
    assert stats["link"]["frames_tx"] > 0 and stats["link"]["bytes_rx"] > 0
    assert host.closed  # close() let go of the given transport
    assert board.counters["frames_ok"] > 0


def test_a_line_that_drops_and_corrupts_bytes_delivers_every_byte_exactly_once():
    """0.3% of the bytes dropped and 0.3% corrupted, both ways: the session's ARQ (retransmission
    with the same seq, the board's reply window, CRC-checked messages) delivers the load exactly
    once (the board's LOAD_END check counts the WRITE_MEMs executed and their CRC) and the run and
    the rows bit-identical to the simulator's."""
    prog = program(seed=3)
    ref = run(prog, SimTarget(device=DEV))
    host, dev = memory_pair()
    board = _board_behind(dev)
    executed = []  # seq of every request the board executed (messages: once complete)
    dispatch = board._dispatch
    board._dispatch = lambda f, send: (executed.append(f.seq), dispatch(f, send))[1]
    line = Lossy(host, drop=0.003, flip=0.003, seed=11)
    rng = np.random.default_rng(5)
    rows = {r: rng.integers(0, 1 << 16, DEV.cols, dtype=np.uint16) for r in (DEV.rows - 3, DEV.rows - 2)}
    with FpgaTarget(transport=line, progress=False, frame_timeout=0.05) as t:
        got = run(prog, t)  # LOAD_END passed: the board executed as many WRITE_MEMs, with the same CRC, as the host sent
        for r, a in rows.items():
            t.write_row(1, 2, r, a)
        back = {r: t.read_row(1, 2, r) for r in rows}
    assert_identical(ref, got)
    for r, a in rows.items():
        assert back[r].tobytes() == a.tobytes()
    assert len(executed) == len(set(executed)) > 10  # no request executed twice, whatever was retransmitted
    assert line.damaged > 0  # the line did damage bytes (so the ARQ was exercised)


# ---------------------------------------------------------------- the link error hierarchy
def test_every_link_error_is_a_link_fail():
    for cls in (E.TransportError, E.LinkTimeout, E.RetriesExhausted, E.ProtocolViolation, E.VersionMismatch, E.BoardError, E.ReplayRefused, E.BoardReset):
        assert issubclass(cls, LinkError) and cls.outcome == "LINK_FAIL", cls
    assert issubclass(E.VersionMismatch, E.ProtocolViolation) and issubclass(E.ReplayRefused, E.BoardError)


def _session(**kw) -> Session:
    return Session(open_timeout=kw.pop("open_timeout", 2.0), frame_timeout=0.05, max_retries=kw.pop("max_retries", 4), **kw)


def test_a_silent_line_is_a_link_timeout_naming_the_port():
    host, _dev = memory_pair()  # nobody behind the other end
    with pytest.raises(E.LinkTimeout, match="no HELLO reply from memory://host within 0.3 s"):
        _session(open_timeout=0.3).open(host)


@pytest.mark.parametrize("answer", ["reply", "error"])
def test_a_board_of_another_protocol_version_is_a_version_mismatch(answer):
    """An older board answering HELLO with its own version, or refusing ours with E_VERSION."""
    host, dev = memory_pair()
    rx = Deframer()
    old = P.PROTOCOL_VERSION - 1

    def old_board(data, send):
        for f in rx.feed(data):
            if isinstance(f, Frame) and f.type == P.HELLO:
                send(encode_frame(P.HELLO_REPLY, 0, 0, 7, P._HELLO_R.pack(old, P.ISA_VERSION, 7, 4096, 4096)) if answer == "reply" else
                     encode_frame(P.ERROR, 0, 0, 7, P.pack_error(P.E_VERSION, f"board speaks protocol v{old}")))

    dev.serve(old_board)
    with pytest.raises(E.VersionMismatch, match=f"speaks link protocol v{old}" if answer == "reply" else f"E_VERSION: board speaks protocol v{old}"):
        _session().open(host)


def test_a_board_reset_ends_the_session_and_a_replayed_seq_is_refused_by_name():
    host, dev = memory_pair()
    board = _board_behind(dev)
    s = _session()
    s.open(host)
    s.transact(P.WRITE_MEM, P.pack_write_mem(5, 0, np.full(8, 3, "<u2").tobytes()), P.ACK)
    for _ in range(40):
        s.status()
    s.seq -= 40  # the next request reuses a seq executed 40 requests ago (older than the board's window)
    with pytest.raises(E.ReplayRefused, match="E_REPLAY.*refused as a replayed request") as e:
        s.status()
    assert e.value.code == P.E_REPLAY
    s.seq += 40
    with pytest.raises(RunError):  # a refusal that is the program's fault stays a RUN_FAIL, not a link error
        s.transact(P.WRITE_MEM, P.pack_write_mem(DEV.rows, 0, b"\0\0"), P.ACK)
    board.boot()  # power glitch: new session nonce, memory gone
    with pytest.raises(E.BoardReset, match="board reset detected"):
        s.status()
    with pytest.raises(E.BoardReset):  # and the session stays dead: never a retry
        s.status()


def test_a_message_the_board_drops_mid_transfer_is_a_board_error():
    """The board forgets the open message when the first short frame of its body arrives: the bitmap
    says GONE, the session checks the board is still the same (STATUS) and names the loss."""
    host, dev = memory_pair()
    board = _board_behind(dev)
    short = board.short

    def forgetful(f, send):
        board.reasm.clear()
        board.short = short
        short(f, send)

    board.short = forgetful
    s = _session(max_fragment=256)
    s.open(host)
    with pytest.raises(E.BoardError, match="WRITE_MEM: the board no longer holds the message") as e:
        s.transact(P.WRITE_MEM, P.pack_write_mem(3, 0, np.arange(2048, dtype="<u2").tobytes()), P.ACK)
    assert e.value.code is None
    s.transact(P.WRITE_MEM, P.pack_write_mem(3, 0, np.arange(2048, dtype="<u2").tobytes()), P.ACK)  # the session goes on
    assert board.backend.read(3, 0, 2048).tobytes() == np.arange(2048, dtype="<u2").tobytes()
