"""cocotb testbench that serves RtlTarget requests (runs inside the simulator).

The single cocotb test ``serve`` starts the clock, resets the DUT (``pim_channel``),
connects to the host's Unix socket (env ``NHIL_RTL_SOCK``) and then executes requests
(``nhil.targets.rtl.proto``) until ``close``. It drives the command stream and collects
the readback stream cycle by cycle at falling clock edges: a beat presented at a falling
edge while ``cmd_ready`` is high transfers at the next rising edge; ``rd_ready`` is held
high, so a readback beat seen at a falling edge is consumed at the next rising edge.
"""

from __future__ import annotations

import os
import socket

import cocotb
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
    Clock(dut.clk, PERIOD_NS, unit="ns").start()
    dut.cmd_valid.value = 0
    dut.cmd_data.value = 0
    dut.rd_ready.value = 1
    dut.bd_clear.value = 0
    dut.bd_load.value = 0
    dut.rst_n.value = 0
    drv = Driver(dut)
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
