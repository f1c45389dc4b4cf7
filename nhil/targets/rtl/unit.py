"""Run a cocotb test module against an RTL build and report.

``run_datapath_tests()`` uses the RtlTarget's build (``pim_sim_top`` holds the datapath
probe ``pim_dp_probe`` next to the channel) and runs the cocotb tests of
:mod:`nhil.targets.rtl.tb_datapath` (bf16 blocks) and :mod:`nhil.targets.rtl.tb_formats`
(quantized weight decode and MAC, every format) in a subprocess; returns a dict with
``tests``, ``failed``, ``log`` (text) and ``run_dir``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nhil.targets.rtl.build import REPO, BuildSpec, ensure_build, runs_root




DATAPATH_MODULES = ("nhil.targets.rtl.tb_datapath", "nhil.targets.rtl.tb_formats")


def run_cocotb(spec: BuildSpec, test_module: str | list[str], env: dict | None = None, timeout: float = 600) -> dict:
    bdir, info = ensure_build(spec)
    runs = runs_root()
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-") + spec.toplevel + "-", dir=runs))
    cfg = {
        "simulator": spec.simulator,
        "toplevel": spec.toplevel,
        "test_module": test_module,
        "build_dir": str(bdir),
        "run_dir": str(run_dir),
        "results_xml": str(run_dir / "results.xml"),
        "waves": False,
        "plusargs": [],
        "env": dict(env or {}),
    }
    (run_dir / "launch.json").write_text(json.dumps(cfg, indent=1))
    penv = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "COCOTB_TEST_FILTER", "WAVES")}
    penv.update(cfg["env"])
    penv["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in penv.get("PYTHONPATH", "").split(os.pathsep) if p])
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nhil.targets.rtl.launch", str(run_dir / "launch.json")], cwd=str(run_dir), env=penv,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
    log = proc.stdout.decode(errors="replace")
    (run_dir / "sim.log").write_text(log)
    from cocotb_tools.check_results import get_results

    try:
        tests, failed = get_results(run_dir / "results.xml")
    except (RuntimeError, OSError):
        tests, failed = 0, -1
    res = {"tests": tests, "failed": failed, "log": log, "run_dir": str(run_dir), "seconds": time.monotonic() - t0, "build": info, "rc": proc.returncode}
    if failed == 0 and tests > 0 and proc.returncode == 0:
        shutil.rmtree(run_dir, ignore_errors=True)  # keep the folder only when something failed
        res["run_dir"] = None
    return res


def run_datapath_tests(simulator: str = "verilator", vectors: int = 3000, seed: int = 1, inject_bug: bool | str | None = None,
                       modules: tuple[str, ...] = DATAPATH_MODULES) -> dict:
    """Run the datapath cocotb modules on the ``rtl-tiny`` build (``inject_bug``: see ``target.bug_name``)."""
    from nhil.isa.device import DEVICE_PRESETS
    from nhil.targets.rtl.target import channel_spec

    spec = channel_spec(DEVICE_PRESETS["rtl-tiny"], simulator, inject_bug=inject_bug)  # the same build as RtlTarget's
    return run_cocotb(spec, list(modules), {"NHIL_DP_VECTORS": str(vectors), "COCOTB_RANDOM_SEED": str(seed)})
