"""`nhil run`: a handed-off program runs as handed off (bundle: golden inputs in, outputs compared)
on sim, fpga and rtl; an edited program is a MISMATCH; bad input is a usage error or LOAD_FAIL."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from nhil.args import EXIT_USAGE, UsageError
from nhil.run_program import run_program


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """llama-tiny compiled for rtl-tiny (which sim, the FPGA emulator and the RTL all serve), 3 golden tokens."""
    from nhil.compile import compile_model, write_bundle

    folder = tmp_path_factory.mktemp("b") / "handoff"
    prog = compile_model("llama-tiny", "rtl-tiny", 16)
    write_bundle(folder, "llama-tiny", prog, None, 3)
    return folder


def _rtl_tools() -> str | None:
    try:
        from nhil.targets.rtl import build as rtl_build

        rtl_build.setup_tools("verilator")
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return f"RTL tools unavailable: {e}"
    return None


@pytest.mark.parametrize("target", ["sim", "fpga", "rtl"])
def test_a_bundle_runs_as_handed_off_and_passes(bundle, tmp_path, target):
    if target == "rtl" and (why := _rtl_tools()):
        pytest.skip(why)
    rep = run_program(bundle, target, runs_dir=tmp_path / "runs")
    assert rep["outcome"] == "PASS", (rep.get("error"), rep["checks"])
    names = {c["name"] for c in rep["checks"]}
    assert {"bundle_files_intact", "teacher_forced_top1", "logits_within_tolerance"} <= names
    if target != "sim":
        assert "bit_identical_to_sim" in names and rep["target_stats"]["lockstep"]["syncs_compared"] > 0
    man = json.loads((bundle / "BUNDLE.json").read_text())
    assert rep["golden_tokens"] == man["golden_tokens"] and len(rep["steps"]) == 3
    assert (tmp_path / "runs").glob("*/report.json")


def test_an_edited_program_is_a_mismatch(bundle, tmp_path):
    """Re-encode the bundle's program with one weight row changed (valid CRC, loads fine)."""
    import shutil

    from nhil.isa import Program

    edited = tmp_path / "edited"
    shutil.copytree(bundle, edited)
    prog = Program.load(edited / "program.pimb")
    img = next(i for i in prog.bank_images if i.data is not None)
    img.data = np.ascontiguousarray(img.data ^ np.uint16(0x4000))  # flips an exponent bit of every weight in the row
    prog.save(edited / "program.pimb")
    rep = run_program(edited, "sim", runs_dir=tmp_path / "runs")
    assert rep["outcome"] == "MISMATCH"
    failed = {c["name"] for c in rep["checks"] if not c["passed"]}
    assert "bundle_files_intact" in failed and "program.pimb" in next(c["detail"] for c in rep["checks"] if c["name"] == "bundle_files_intact")
    assert failed & {"logits_within_tolerance", "teacher_forced_top1"}  # the numbers moved too


def test_a_bare_program_needs_its_golden_and_a_corrupt_one_is_load_fail(bundle, tmp_path):
    with pytest.raises(UsageError, match="needs its golden"):
        run_program(bundle / "program.pimb", "sim", runs_dir=tmp_path / "runs")
    rep = run_program(bundle / "program.pimb", "sim", golden=bundle / "golden.safetensors", runs_dir=tmp_path / "runs")
    assert rep["outcome"] == "PASS", rep.get("error")
    bad = tmp_path / "bad.pimb"
    data = bytearray((bundle / "program.pimb").read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    rep = run_program(bad, "sim", golden=bundle / "golden.safetensors", runs_dir=tmp_path / "runs")
    assert rep["outcome"] == "LOAD_FAIL" and rep["stage"] == "load_program" and "CRC-32" in rep["error"]


def test_cli_run_as_written_in_the_bundle(bundle, tmp_path):
    man = json.loads((bundle / "BUNDLE.json").read_text())
    cmd = man["how_to_run"].split()
    assert cmd[:2] == ["nhil", "run"]
    r = subprocess.run([sys.executable, "-m", "nhil.cli", *cmd[1:], "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "nhil.cli", "run", str(bundle), "-t", "../x"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == EXIT_USAGE and "is not a target name" in r.stderr and "Traceback" not in r.stderr
