"""``rtl`` target: the SystemVerilog PIM device in ``rtl_stubs/`` under cocotb + Verilator.

``open()`` builds the channel (cached, see :mod:`nhil.targets.rtl.build`), creates a run
folder, and starts the simulator as a persistent subprocess whose cocotb test
(:mod:`nhil.targets.rtl.tb_server`) serves this object's requests over a Unix socket, so
the many ``execute(block)`` calls of a decode step reuse one simulation. Instructions and
payloads go through the DUT's command port; readbacks come from its readback port; bank
images are loaded through the documented backdoor ($readmemh, ``docs/rtl-interface.md``).

Options (keyword; unknown ones are ignored): ``device`` (DeviceConfig or preset name,
default ``rtl-tiny``; ``channels`` instances of ``pim_channel`` in ``pim_device``), ``simulator`` (``verilator`` | ``icarus``), ``waves``
(FST/VCD of the whole run, also forced by env ``WAVES=1``), ``inject_bug`` (build with
``INJECT_RNE_BUG``: ties round away from zero in the fp32 adder; ``"decode"``: ``INJECT_DECODE_BUG``,
lane 5 of the weight decoder reads the E2M1 code 0x1 as 1.0; ``"channel1"``: ``INJECT_CHANNEL_BUG``,
channel 1's MAC units add nothing of bank 3's row), ``keep_run`` (keep the
run folder after a clean close), ``timeout`` (seconds per request).

What the RTL implements and how it is built: :mod:`nhil.targets.rtl.spec`; the backdoor bank images:
:mod:`nhil.targets.rtl.images`; the run-time instruction checks: :mod:`nhil.targets.rtl.checks`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nhil.errors import RunError, SetupError
from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import ALL_CH, OPINFO, Instr, Op
from nhil.isa.program import Program
from nhil.targets.base import Capabilities, ReadbackDigest, ResolvedInstr, SyncRecord, Target, check_program_fits
from nhil.targets.rtl import proto
from nhil.targets.rtl.build import REPO, ensure_build, runs_root
from nhil.targets.rtl.checks import check_rtl_instr
from nhil.targets.rtl.images import write_bank_images
from nhil.targets.rtl.spec import (  # noqa: F401  (RTL_FORMATS, rtl_formats re-exported: the fpga emulator, tests)
    RTL_FORMATS,
    RTL_OPS,
    _check_device,
    _flag,
    bug_name,
    channel_spec,
    rtl_formats,
)


class RtlTarget(Target):
    """The RTL model of a PIM device (``d.channels`` channels) behind the Target interface (see the module docstring)."""

    name = "rtl"

    def __init__(self, device: DeviceConfig | str | None = None, *, waves: bool = False, simulator: str = "verilator", inject_bug: bool = False,
                 keep_run: bool = False, timeout: float = 600.0, start_timeout: float = 60.0, image_format: str = "bin", driver: str = "sv", **_ignored) -> None:
        device = device or os.environ.get("NHIL_RTL_DEVICE") or "rtl-tiny"
        if isinstance(device, str):
            if device not in DEVICE_PRESETS:
                raise SetupError(f"rtl: unknown device preset {device!r}; presets: {', '.join(DEVICE_PRESETS)}")
            device = DEVICE_PRESETS[device]
        self.d = device
        _check_device(self.d)
        self.waves = _flag(waves) or _flag(os.environ.get("WAVES", ""))
        self.simulator = simulator
        self.inject_bug = bug_name(inject_bug)
        self.keep_run = _flag(keep_run)
        if image_format not in ("bin", "hex"):
            raise SetupError(f"rtl: image_format must be 'bin' or 'hex', not {image_format!r}")
        self.image_format = image_format
        if driver not in ("sv", "cocotb"):
            raise SetupError(f"rtl: driver must be 'sv' or 'cocotb', not {driver!r}")
        self.driver = driver
        self.load_info: dict = {}
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.L = self.d.lanes
        self.bursts = self.d.cols // self.L
        self.beat_bytes = self.L * 2
        self.apb = self.beat_bytes // 4  # fp32 accumulator values per beat
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._sockdir: str | None = None
        self.run_dir: Path | None = None
        self.build_info: dict = {}
        self._digest = ReadbackDigest()
        self._loaded = False
        self._failed = False
        self._cfr = np.zeros((self.d.channels, 2), np.int64)  # CFR[ch][0..1] as the program set them
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.counts: dict[str, int] = {}
        self.macs = 0
        self.cycles = 0
        self.blocks = 0
        self.beats = 0
        self.wall = 0.0

    # ------------------------------------------------------------------ lifecycle
    def capabilities(self) -> Capabilities:
        return Capabilities(0, RTL_OPS, rtl_formats(self.d), self.d)

    def open(self) -> None:
        if self._proc is not None:
            return
        spec = channel_spec(self.d, self.simulator, self.waves, self.inject_bug)
        bdir, self.build_info = ensure_build(spec)
        runs = runs_root()
        runs.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
        (self.run_dir / "mem").mkdir()
        self._sockdir = tempfile.mkdtemp(prefix="nhil-rtl-")
        sock_path = os.path.join(self._sockdir, "s")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(sock_path)
        srv.listen(1)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "COCOTB_TEST_FILTER", "COCOTB_TESTCASE")}
        env["WAVES"] = "1" if self.waves else "0"
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        cfg = {
            "simulator": self.simulator,
            "toplevel": spec.toplevel,
            "test_module": "nhil.targets.rtl.tb_server",
            "build_dir": str(bdir),
            "run_dir": str(self.run_dir),
            "results_xml": str(self.run_dir / "results.xml"),
            "waves": self.waves,
            "plusargs": [f"+NHIL_MEMDIR={self.run_dir / 'mem'}", f"+NHIL_STREAMDIR={self.run_dir}"],
            "env": {"NHIL_RTL_SOCK": sock_path, "NHIL_STREAMDIR": str(self.run_dir), "PYTHONPATH": env["PYTHONPATH"], "COCOTB_LOG_LEVEL": "WARNING"},
        }
        (self.run_dir / "launch.json").write_text(json.dumps(cfg, indent=1))
        log = open(self.run_dir / "sim.log", "wb")
        self._proc = subprocess.Popen([sys.executable, "-m", "nhil.targets.rtl.launch", str(self.run_dir / "launch.json")],
                                      cwd=str(self.run_dir), env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        log.close()
        srv.settimeout(0.5)
        t0 = time.monotonic()
        try:
            while True:
                try:
                    self._sock, _ = srv.accept()
                    break
                except socket.timeout:
                    if self._proc.poll() is not None or time.monotonic() - t0 > self.start_timeout:
                        self._fail_setup("the simulator did not start")
        finally:
            srv.close()
        self._sock.settimeout(self.timeout)
        hello = self._recv("start")
        if hello.get("beat_bytes") != self.beat_bytes:
            self._fail_setup(f"testbench reports {hello.get('beat_bytes')}-byte beats, expected {self.beat_bytes}")
        self.cycles0 = hello.get("cycles", 0)

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return (self.run_dir / "sim.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _fail_setup(self, why: str):
        self._failed = True
        self._kill()
        raise SetupError(f"rtl: {why}; run folder {self.run_dir}, log:\n{self._log_tail()}")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:  # the launcher and the simulator it spawned share a new session/process group
                os.killpg(self._proc.pid, signal.SIGKILL)
            except OSError:
                self._proc.kill()
            self._proc.wait()
        self._proc = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._sockdir:
            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = None

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            if self._sock is not None:
                proto.send(self._sock, {"cmd": "close"})
                proto.recv(self._sock)
            self._proc.wait(timeout=60)
        except (OSError, ConnectionError, subprocess.TimeoutExpired):
            self._failed = True
        finally:
            self._kill()
        if not (self._failed or self.waves or self.keep_run) and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self.run_dir is not None:
            shutil.rmtree(self.run_dir / "mem", ignore_errors=True)

    def __del__(self):  # a forgotten close() must not leave a simulator running
        try:
            self._kill()
        except Exception:
            pass

    # ------------------------------------------------------------------ transport
    def _recv(self, what: str) -> dict:
        try:
            hdr, blob = proto.recv(self._sock)
        except (OSError, ConnectionError) as e:
            self._failed = True
            self._kill()
            raise RunError(f"rtl: simulator connection lost during {what} ({e}); run folder {self.run_dir} kept "
                           f"(rerun with WAVES=1 for waves), log:\n{self._log_tail()}") from None
        if not hdr.get("ok"):
            self._failed = True
            raise RunError(f"rtl: testbench error during {what}: {hdr.get('error')}; run folder {self.run_dir}")
        hdr["_blob"] = blob
        return hdr

    def _request(self, header: dict, blob: bytes = b"", what: str = "") -> dict:
        if self._proc is None:
            self.open()
        try:
            proto.send(self._sock, header, blob)
        except OSError as e:
            self._failed = True
            self._kill()
            raise RunError(f"rtl: cannot reach the simulator ({e}); run folder {self.run_dir}, log:\n{self._log_tail()}") from None
        return self._recv(what or header["cmd"])

    # ------------------------------------------------------------------ load
    def load(self, program: Program) -> None:
        check_program_fits(program, self.capabilities(), self.name)
        if self._proc is None:
            self.open()
        self._write_images(program)
        t0 = time.perf_counter()
        r = self._request({"cmd": "reset", "load": True}, what="load")
        self.load_info["backdoor_s"] = round(time.perf_counter() - t0, 3)
        if not self.keep_run and not self.waves:  # the simulator has the images now
            for f in (self.run_dir / "mem").iterdir():
                f.unlink()
        self.cycles0 = r["cycles"]
        self._digest = ReadbackDigest()
        self._reset_counters()
        self._cfr[:] = 0
        self._loaded = True
    def _write_images(self, program: Program) -> None:
        """Bank images for the backdoor into the run folder's ``mem/`` (:func:`nhil.targets.rtl.images.write_bank_images`)."""
        self.load_info = write_bank_images(self.run_dir / "mem", program, self.d, self.image_format)

    # ------------------------------------------------------------------ execute
    def _check(self, idx: int, ins: Instr, payload) -> None:
        """The simulator's run-time checks (:func:`nhil.targets.rtl.checks.check_rtl_instr`), tracking this run's CFRs."""
        check_rtl_instr(idx, ins, payload, self.d, self._cfr)

    def _encode(self, block: list[ResolvedInstr]) -> tuple[bytes, list[tuple[int, Instr, int]]]:
        """Beats for the command port, and (index, instr, readback beats) per data-out instruction."""
        bb = self.beat_bytes
        pad = bytes(bb - 16)
        parts: list[bytes] = []
        outs = []
        for idx, ins, payload in block:
            self._check(idx, ins, payload)
            word = ins.encode()
            if ins.flags & ALL_CH and ins.op is Op.RD_SBK:  # allowed on one channel only: ALL_CH reads channel 0
                word = ins._replace(flags=ins.flags & ~ALL_CH).encode()
            parts.append(word + pad)
            op = ins.op
            if op in (Op.WR_GB, Op.WR_SBK, Op.WR_ABK):
                parts.append(np.ascontiguousarray(payload, dtype="<u2").tobytes())
            elif op is Op.WR_ACC:
                v = np.zeros(-(-ins.n // self.apb) * self.apb, dtype="<u4")
                v[: ins.n] = np.ascontiguousarray(payload, dtype=np.float32).view(np.uint32)
                parts.append(v.tobytes())
            elif op is Op.RD_ACC:
                outs.append((idx, ins, -(-ins.n // self.apb)))
            elif op is Op.RD_SBK:
                outs.append((idx, ins, ins.n))
            self.counts[op.name] = self.counts.get(op.name, 0) + 1
            if op is Op.MAC_AB:
                self.macs += (self.d.slots if ins.flags & ALL_CH else self.d.banks) * ins.n * self.L
            elif op is Op.MAC_SB:
                self.macs += ins.n * self.L
        return b"".join(parts), outs

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        if not self._loaded:
            raise RunError("rtl: load() a program first")
        t0 = time.perf_counter()
        blob, outs = self._encode(block)
        r = self._request({"cmd": "exec", "driver": self.driver}, blob, what=f"block of {len(block)} instructions starting at {block[0].index if block else '-'}")
        if r.get("err"):
            self._failed = True
            raise RunError(f"rtl: the device flagged a malformed instruction in the block starting at instruction {block[0].index} (err_o); run folder {self.run_dir}")
        data = r["_blob"]
        need = sum(n for _, _, n in outs)
        if r["beats"] != need or len(data) != need * self.beat_bytes:
            self._failed = True
            raise RunError(f"rtl: expected {need} readback beats for the block starting at instruction {block[0].index}, got {r['beats']}; run folder {self.run_dir}")
        res: list[np.ndarray] = []
        pos = 0
        it = iter(outs)
        for idx, ins, _ in block:
            if OPINFO[ins.op].data_out:
                _, _, nb = next(it)
                chunk = data[pos : pos + nb * self.beat_bytes]
                pos += nb * self.beat_bytes
                if ins.op is Op.RD_ACC:
                    arr = np.frombuffer(chunk, dtype="<u4")[: ins.n].astype(np.uint32).view(np.float32)
                else:
                    arr = np.frombuffer(chunk, dtype="<u2").astype(np.uint16)
                res.append(arr)
                self._digest.add(arr)
            elif ins.op is Op.SYNC:
                self._digest.sync(idx)
        self.cycles = r["cycles"] - self.cycles0
        self.blocks += 1
        self.beats += len(blob) // self.beat_bytes
        self.wall += time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ backdoor-ish row access (through the command port)
    def read_row(self, ch: int, bank: int, row: int) -> np.ndarray:
        ins = Instr(Op.RD_SBK, 0, ch, bank, row, 0, self.bursts)
        self._check(-1, ins, None)
        r = self._request({"cmd": "exec", "driver": self.driver}, ins.encode() + bytes(self.beat_bytes - 16), what="read_row")
        return np.frombuffer(r["_blob"], dtype="<u2").astype(np.uint16)

    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        data = np.asarray(data, dtype=np.uint16).reshape(self.bursts, self.L)
        parts = []
        for c in range(self.bursts):
            ins = Instr(Op.WR_SBK, 0, ch, bank, row, c, 0, imm=(1 << self.L) - 1 if self.L < 16 else 0xFFFF)
            self._check(-1, ins, data[c])
            parts.append(ins.encode() + bytes(self.beat_bytes - 16) + data[c].astype("<u2").tobytes())
        self._request({"cmd": "exec", "driver": self.driver}, b"".join(parts), what="write_row")

    def waves_file(self) -> Path | None:
        """The wave file of this run (``dump.fst``, or ``dump.vcd`` without lz4 headers), if any."""
        if self.run_dir is None:
            return None
        for name in ("dump.fst", "dump.vcd"):
            if (self.run_dir / name).exists():
                return self.run_dir / name
        return None

    def trace(self) -> list[SyncRecord]:
        return list(self._digest.records)

    def stats(self) -> dict:
        return {
            "instructions": dict(self.counts),
            "macs": self.macs,
            "blocks": self.blocks,
            "beats": self.beats,
            "cycles": self.cycles,
            "wall_s": round(self.wall, 4),
            "cycles_per_s": round(self.cycles / self.wall, 1) if self.wall else 0.0,
            "simulator": self.simulator,
            "driver": self.driver,
            "device": self.d.name,
            "load": dict(self.load_info),
            "inject_bug": self.inject_bug,
            "build": dict(self.build_info),
            "run_dir": str(self.run_dir) if self.run_dir else None,
        }
