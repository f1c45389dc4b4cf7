"""cocotb testbench that serves RtlTarget requests (runs inside the simulator).

The single cocotb test ``serve`` starts the clock, resets the DUT (``pim_channel``),
connects to the host's Unix socket (env ``NHIL_RTL_SOCK``) and then executes requests
(``nhil.targets.rtl.proto``) until ``close``. Two ways to drive a block of command beats:

* ``driver="sv"`` (default): the harness's file-driven stream driver
  (``rtl_stubs/pim_stream_drv.sv``): the beats go to ``cmd.bin`` in the stream folder
  (plusarg ``+NHIL_STREAMDIR``), the driver plays them into the command port with the
  valid/ready handshake and writes every readback beat to ``rd.hex``; Python only starts it
  and waits for ``drv_done``, so the simulator runs at full speed.
* ``driver="cocotb"``: this module drives the command stream and collects the readback
  stream cycle by cycle at falling clock edges: a beat presented at a falling edge while
  ``cmd_ready`` is high transfers at the next rising edge; ``rd_ready`` is held high, so a
  readback beat seen at a falling edge is consumed at the next rising edge (slow, but every
  beat is visible in Python).
"""

from __future__ import annotations

import os
import socket

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, RisingEdge
from cocotb.utils import get_sim_time

from nhil.targets.rtl import proto

PERIOD_NS = 10
MAX_IDLE_CYCLES = 1_000_000  # a block that keeps the device busy this long is a hang


class Driver:
    def __init__(self, dut) -> None:
        self.dut = dut
        self.dw = len(dut.cmd_data)
        self.beat_bytes = self.dw // 8
        self.fe = FallingEdge(dut.clk)
        self.stream_dir = os.environ.get("NHIL_STREAMDIR", ".")
        self.has_sv_driver = hasattr(dut, "drv_start")

    async def run_sv(self, blob: bytes) -> tuple[list[bytes], int]:
        """Play the beats through ``pim_stream_drv`` (see the module docstring)."""
        d = self.dut
        bb = self.beat_bytes
        n = len(blob) // bb
        # host beats are little-endian; the driver's $fread wants the most significant byte first
        with open(os.path.join(self.stream_dir, "cmd.bin"), "wb") as f:
            f.write(np.frombuffer(blob, np.uint8).reshape(n, bb)[:, ::-1].tobytes())
        await self.fe
        d.drv_nbeats.value = n
        d.drv_start.value = 1
        if not d.drv_done.value:
            await RisingEdge(d.drv_done)
        await self.fe
        status = int(d.drv_status.value)
        nrd = int(d.drv_nrd.value)
        d.drv_start.value = 0
        await self.fe  # done drops at the next rising edge
        if status == 1:
            raise RuntimeError("device waits for payload beats the host did not send (beat count mismatch)")
        if status == 2:
            raise RuntimeError("device busy for too long (hang)")
        if status == 3:
            raise RuntimeError(f"stream driver could not read {self.stream_dir}/cmd.bin or write rd.hex")
        with open(os.path.join(self.stream_dir, "rd.hex")) as f:
            lines = f.read().split()
        if len(lines) != nrd:
            raise RuntimeError(f"stream driver recorded {nrd} readback beats but rd.hex has {len(lines)}")
        out = [bytes.fromhex(h)[::-1] for h in lines]
        return out, int(bool(d.err_o.value))

    def cycles(self) -> int:
        return int(get_sim_time("ns")) // PERIOD_NS

    async def reset(self, load: bool) -> None:
        d = self.dut
        await self.fe
        d.cmd_valid.value = 0
        d.rst_n.value = 0
        d.bd_clear.value = 1
        await self.fe
        d.bd_clear.value = 0
        d.bd_load.value = 1 if load else 0
        await self.fe
        d.bd_load.value = 0
        d.rst_n.value = 1
        await self.fe

    async def run(self, blob: bytes) -> tuple[list[bytes], int]:
        """Push beats through the command port; returns (readback beats, err flag)."""
        d = self.dut
        bb = self.beat_bytes
        beats = [int.from_bytes(blob[i : i + bb], "little") for i in range(0, len(blob), bb)]
        out: list[bytes] = []
        nb, i = len(beats), 0
        valid = False
        fe = self.fe
        rd_valid, rd_data, cmd_ready, busy = d.rd_valid, d.rd_data, d.cmd_ready, d.busy_o
        await fe
        stall = 0
        while True:
            rv = bool(rd_valid.value)
            if rv:
                out.append(rd_data.value.to_unsigned().to_bytes(bb, "little"))
            rdy = bool(cmd_ready.value)
            if i < nb and rdy:
                d.cmd_data.value = beats[i]
                if not valid:
                    d.cmd_valid.value = 1
                    valid = True
                i += 1
                stall = 0
            else:
                if valid:
                    d.cmd_valid.value = 0
                    valid = False
                if i >= nb and not bool(busy.value):
                    break
                if rdy and i >= nb:
                    raise RuntimeError("device waits for payload beats the host did not send (beat count mismatch)")
                if not rv and not rdy:
                    # executing (MAC/COPY): nothing to do until the device takes commands again
                    await RisingEdge(cmd_ready)
                stall += 1
                if stall > MAX_IDLE_CYCLES:
                    raise RuntimeError("device busy for too long (hang)")
            await fe
        return out, int(bool(d.err_o.value))


@cocotb.test()
async def serve(dut):
    """Serve host requests until ``close``."""
    Clock(dut.clk, PERIOD_NS, unit="ns", impl="gpi").start()  # the C clock: no Python per cycle
    dut.cmd_valid.value = 0
    dut.cmd_data.value = 0
    dut.rd_ready.value = 1
    dut.bd_clear.value = 0
    dut.bd_load.value = 0
    dut.rst_n.value = 0
    drv = Driver(dut)
    if drv.has_sv_driver:
        dut.drv_start.value = 0
        dut.drv_nbeats.value = 0
    await drv.reset(load=False)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["NHIL_RTL_SOCK"])
    proto.send(sock, {"ok": True, "hello": "nhil-rtl", "beat_bytes": drv.beat_bytes, "cycles": drv.cycles()})
    try:
        while True:
            hdr, blob = proto.recv(sock)
            cmd = hdr.get("cmd")
            try:
                if cmd == "reset":
                    await drv.reset(bool(hdr.get("load")))
                    proto.send(sock, {"ok": True, "cycles": drv.cycles()})
                elif cmd == "exec":
                    if hdr.get("driver", "sv") == "sv" and drv.has_sv_driver:
                        out, err = await drv.run_sv(blob)
                    else:
                        out, err = await drv.run(blob)
                    proto.send(sock, {"ok": True, "beats": len(out), "err": err, "cycles": drv.cycles()}, b"".join(out))
                elif cmd == "close":
                    proto.send(sock, {"ok": True, "cycles": drv.cycles()})
                    break
                else:
                    proto.send(sock, {"ok": False, "error": f"unknown request {cmd!r}"})
            except RuntimeError as e:
                proto.send(sock, {"ok": False, "error": str(e), "cycles": drv.cycles()})
    finally:
        sock.close()
