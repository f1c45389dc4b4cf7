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

from nhil.errors import LoadError, RunError, SetupError
from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, CFR_W_FMT, OPINFO, Instr, Op
from nhil.isa.program import Program
from nhil.numerics.formats import FORMATS
from nhil.numerics.mac import LANES
from nhil.isa.semantics import check_instr
from nhil.targets.base import DEVICE_OPS, Capabilities, ReadbackDigest, ResolvedInstr, SyncRecord, Target, check_program_fits
from nhil.targets.rtl import proto
from nhil.targets.rtl.build import REPO, RTL_DIR, SIM_SOURCES, SIM_TOP, BuildSpec, ensure_build, runs_root

RTL_OPS = DEVICE_OPS  # every non-reserved ISA v0 device opcode
# Weight formats the RTL's MAC lanes decode (rtl_stubs/pim_wdec.sv, pim_fp_pkg::wfmt_fetch): every
# device format of nhil.numerics.formats.FORMATS, on devices with 16 MAC lanes (the formats' burst); bf16 on others.
# The pre-quantized checkpoint formats (formats.PREQUANT: int4 fp32-scale groups, FP8 block, nvfp4-gs) are not decoded.
RTL_FORMATS = frozenset({"bf16", *FORMATS})
INJECTED_BUGS = {"rne": "INJECT_RNE_BUG", "decode": "INJECT_DECODE_BUG", "channel1": "INJECT_CHANNEL_BUG"}


MAX_CHANNELS = 8  # pim_device: every channel's banks are one Verilator model; more is a slow, large build


def rtl_formats(d: DeviceConfig) -> frozenset[str]:
    """Weight formats the RTL implements for device ``d`` (quantized formats need ``lanes == 16``)."""
    return RTL_FORMATS if d.lanes == LANES else frozenset({"bf16"})


def bug_name(v) -> str | None:
    """Normalise an ``inject_bug`` option: None (no bug), ``"rne"`` (True, "1", "rne"), ``"decode"`` or ``"channel1"``.

    Raises:
        SetupError: an unknown bug name.
    """
    if isinstance(v, str):
        key = v.strip().lower()
        if key in INJECTED_BUGS:
            return key
        if not _flag(key):
            return None
        if key in ("1", "true", "yes", "on"):
            return "rne"
        raise SetupError(f"rtl: unknown inject_bug {v!r}; use one of {', '.join(INJECTED_BUGS)} (or 1 = rne)")
    return "rne" if v else None


def channel_spec(d: DeviceConfig, simulator: str = "verilator", waves: bool = False, inject_bug: bool | str | None = None) -> BuildSpec:
    """BuildSpec of the simulation top (``pim_sim_top``: ``pim_device`` of ``d.channels`` ``pim_channel``
    instances + datapath probe) for device ``d`` (``inject_bug``: see :func:`bug_name`)."""
    params = (("CHANNELS", d.channels), ("BANKS", d.banks), ("ROWS", d.rows), ("COLS", d.cols), ("LANES", d.lanes), ("ACCS", d.accumulators), ("GB_ELEMS", d.gb_elems))
    bug = bug_name(inject_bug)
    defines = ((INJECTED_BUGS[bug], "1"),) if bug else ()
    # Verilator: trace support is always compiled in (FST, or VCD without lz4 headers) and
    # switched on per run, so WAVES=1 never needs another build. Icarus: waves are a build option.
    build_waves = True if simulator == "verilator" else waves
    return BuildSpec(SIM_TOP, tuple(str(RTL_DIR / s) for s in SIM_SOURCES), params, defines, simulator, build_waves)


def _flag(v) -> bool:
    """Boolean option; strings from ``-O key=value`` ("0", "false", "no", "off", "") are false."""
    if isinstance(v, str):
        return v.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(v)


def _check_device(d: DeviceConfig) -> None:
    problems = []
    if not 1 <= d.channels <= MAX_CHANNELS:
        problems.append(f"channels={d.channels} (pim_device builds 1 to {MAX_CHANNELS} channels)")
    if d.lanes & (d.lanes - 1) or d.lanes < 8:
        problems.append(f"lanes={d.lanes} (a power of two >= 8)")
    if d.cols % d.lanes or d.gb_elems % d.lanes:
        problems.append("cols and gb_elems must be multiples of lanes")
    if d.banks < 2 or d.accumulators < 2:
        problems.append("banks and accumulators must be >= 2")
    if problems:
        raise SetupError(f"device {d.name} cannot be built as RTL: {'; '.join(problems)}")


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
        """Bank images for the backdoor (``docs/rtl-interface.md``): binary ``.seg``/``.bin`` or ``.hex``."""
        d = self.d
        t0 = time.perf_counter()
        mem = self.run_dir / "mem"
        for f in mem.iterdir():
            f.unlink()
        rows = sorted((img for img in program.bank_images if img.data is not None), key=lambda img: img.row)
        for img in rows:
            shape = np.shape(img.data)
            if shape != (d.channels, d.banks, d.cols):
                raise LoadError(f"bank image of row {img.row} has shape {shape}, expected {(d.channels, d.banks, d.cols)}")
        # contiguous runs of rows -> (first row, number of rows)
        runs: list[list[int]] = []
        for img in rows:
            if runs and runs[-1][0] + runs[-1][1] == img.row:
                runs[-1][1] += 1
            else:
                runs.append([img.row, 1])
        nbytes = 0
        if self.image_format == "bin":
            seg = "".join(f"{r * self.bursts} {n * self.bursts}\n" for r, n in runs)
            chunk = 1024  # rows per conversion chunk (bounds the temporary memory)
            # bank files are named by slot (ch * banks + bank, pim_bank's BANK_ID)
            files = [open(mem / f"bank{b}.bin", "wb") for b in range(d.slots)]
            try:
                for i in range(0, len(rows), chunk):
                    block = np.stack([np.asarray(img.data, np.uint16).reshape(d.slots, d.cols) for img in rows[i : i + chunk]])  # (R, slots, cols)
                    # one burst = BW/8 bytes, most significant first: lane L-1 first, big-endian bf16
                    be = block.reshape(len(block), d.slots, self.bursts, self.L)[..., ::-1].astype(">u2")
                    for b in range(d.slots):
                        data = np.ascontiguousarray(be[:, b]).tobytes()
                        files[b].write(data)
                        nbytes += len(data)
            finally:
                for f in files:
                    f.close()
            for b in range(d.slots):
                (mem / f"bank{b}.seg").write_text(seg)
        else:
            w = 4 * self.L
            for b in range(d.slots):
                lines = ["// nhil bank image (one burst per line, lane 0 in the low 16 bits)"]
                for img in rows:
                    bursts = np.ascontiguousarray(np.asarray(img.data, np.uint16).reshape(d.slots, d.cols)[b].reshape(self.bursts, self.L)[:, ::-1]).astype(">u2")
                    hx = bursts.tobytes().hex()
                    lines.append(f"@{img.row * self.bursts:x}")
                    lines.extend(hx[i : i + w] for i in range(0, len(hx), w))
                text = "\n".join(lines) + "\n"
                nbytes += len(text)
                (mem / f"bank{b}.hex").write_text(text)
        self.load_info = {"rows": len(rows), "segments": len(runs), "format": self.image_format, "bytes": nbytes,
                          "write_s": round(time.perf_counter() - t0, 3)}

    # ------------------------------------------------------------------ execute
    def _err(self, idx: int, ins: Instr, msg: str) -> RunError:
        return RunError(f"instruction {idx} ({ins.op.name}): {msg}")

    def _check(self, idx: int, ins: Instr, payload) -> None:
        """The simulator's run-time checks: the device-semantics table (``nhil.isa.semantics``), then the payload."""
        d, op = self.d, ins.op
        if op not in RTL_OPS:
            raise self._err(idx, ins, "opcode not implemented by the RTL target (reserved in ISA v0)" if op is not Op.HOST else "HOST is not a device instruction")
        why = check_instr(ins, d)
        if why:
            raise self._err(idx, ins, why)
        if op is Op.SET_CFR and ins.k == CFR_W_FMT and ins.imm != 0 and d.lanes != LANES:  # the RTL decodes quantized rows on 16-lane devices only
            raise self._err(idx, ins, f"weight format code 0x{ins.imm:x}: quantized formats need {LANES} lanes on the RTL (device has {d.lanes})")
        self._check_cfr(idx, ins)
        need = {Op.WR_ACC: (ins.n, np.float32), Op.WR_GB: (ins.n * d.lanes, np.uint16), Op.WR_SBK: (d.lanes, np.uint16),
                Op.WR_ABK: (ins.n * d.lanes, np.uint16)}.get(op)
        if need is not None and (payload is None or payload.size != need[0] or payload.dtype != need[1]):
            got = "none" if payload is None else f"{payload.size} x {payload.dtype}"
            raise self._err(idx, ins, f"payload must be {need[0]} x {np.dtype(need[1])}, got {got}")

    def _check_cfr(self, idx: int, ins: Instr) -> None:
        """Track CFR per channel; refuse what the channels cannot agree on (each channel of ``pim_device``
        reads its own CFRs). MAC with W_FMT: the simulator's rule (every addressed channel the same
        format). RD_ACC of ALL_CH: the simulator rounds every slot by channel 0's ACC_RD_FMT, the
        device each channel by its own, so the addressed channels must agree."""
        op, cfr = ins.op, self._cfr
        chans = slice(None) if ins.flags & ALL_CH else slice(ins.ch, ins.ch + 1)
        if op is Op.SET_CFR:
            cfr[chans, ins.k] = ins.imm
        elif op in (Op.MAC_AB, Op.MAC_SB):
            wf = cfr[chans, CFR_W_FMT]
            if wf.any() and not (wf == wf[0]).all():
                raise self._err(idx, ins, "the addressed channels have different CFR W_FMT values")
        elif op is Op.RD_ACC and ins.flags & ALL_CH:
            first, last = ins.col // self.d.banks, (ins.col + ins.n - 1) // self.d.banks
            fmt = cfr[[0, *range(first, last + 1)], CFR_ACC_RD_FMT]
            if not (fmt == fmt[0]).all():
                raise self._err(idx, ins, f"ALL_CH RD_ACC of channels {first}..{last}: their CFR ACC_RD_FMT {fmt[1:].tolist()} differ from "
                                          f"channel 0's {fmt[0]} (the simulator rounds by channel 0's, each RTL channel by its own; "
                                          "set ACC_RD_FMT with ALL_CH)")

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
