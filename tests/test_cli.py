"""The README's `nhil` commands, as a user runs them (subprocess, llama-tiny)."""

import json
import subprocess
import sys

import pytest

NHIL = [sys.executable, "-m", "nhil.cli"]


def sh(*args, cwd=None):
    return subprocess.run([*NHIL, *args], capture_output=True, text=True, cwd=cwd)


def test_models_lists_the_registry():
    r = sh("models")
    assert r.returncode == 0
    names = [l.split()[0] for l in r.stdout.splitlines()]
    assert "llama" in names and "llama-tiny" in names


@pytest.mark.slow
def test_compile_disasm_asm_round_trip_and_bundle(tmp_path):
    prog = tmp_path / "prog.pimb"
    r = sh("compile", "-m", "llama-tiny", "-o", str(prog), "--bundle", str(tmp_path / "handoff"), "--tokens", "3")
    assert r.returncode == 0, r.stderr
    r = sh("disasm", str(prog))
    assert r.returncode == 0 and "MAC_AB ch=*" in r.stdout and "WR_SBK" in r.stdout and "@pos_slot" in r.stdout
    pims = tmp_path / "prog.pims"
    assert sh("disasm", "--full", str(prog), "-o", str(pims)).returncode == 0
    again = tmp_path / "again.pimb"
    r = sh("asm", str(pims), "-o", str(again))
    assert r.returncode == 0, r.stderr
    assert again.read_bytes() == prog.read_bytes()
    man = json.loads((tmp_path / "handoff" / "BUNDLE.json").read_text())
    assert set(man["files"]) == {"program.pimb", "program.pims", "golden.safetensors", "MANIFEST.json", *man["docs"]}
    assert "docs/program-format.md" in man["docs"] and (tmp_path / "handoff" / "docs" / "program-format.md").is_file()
    assert not list((tmp_path / "handoff").rglob("*.lock"))  # self-contained: no lock files
    assert man["how_to_run"] == f"nhil run {tmp_path / 'handoff'} --target sim"
    assert len(man["golden_tokens"]) == 3
    assert (tmp_path / "handoff" / "program.pimb").read_bytes() == prog.read_bytes()


def test_asm_of_a_listing_without_blob_says_how_to_fix(tmp_path):
    bad = tmp_path / "x.pims"
    bad.write_text('.pims 1 isa 0\n.meta {"bank_images":[{"row":0,"offset":0,"nbytes":2,"slots":1,"cols":1}],"buffers":{},"device":{},"host_images":[],"host_ops":[],"info":{},"io":{},"operands":[]}\n.code\n.end\n')
    r = sh("asm", str(bad), "-o", str(tmp_path / "y.pimb"))
    assert r.returncode == 2 and "--full" in r.stderr and "Traceback" not in r.stderr


def test_unknown_model_is_a_clear_error():
    r = sh("golden", "-m", "no-such-model")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr


def test_verify_with_opt_in_passes_runs_them_and_passes(tmp_path):
    """`nhil verify --passes default,<opt-in>` compiles with the opt-in passes (the saved program holds the in-device
    elementwise ops ew-swiglu / ew-residual emit; the default pipeline has none) and verifies against the golden."""
    from nhil.compiler.pipeline import DEFAULT_PASSES
    from nhil.isa.instr import Op
    from nhil.isa.program import Program

    r = sh("verify", "-m", "llama-tiny", "-t", "sim", "--tokens", "2", "--passes", "default,ew-swiglu,ew-residual,host-overlap", "--runs-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    (rep_path,) = tmp_path.glob("*/report.json")
    rep = json.loads(rep_path.read_text())
    assert rep["outcome"] == "PASS"
    assert rep["passes"] == [*DEFAULT_PASSES, "ew-swiglu", "ew-residual", "host-overlap"]
    assert "PASSES=" + ",".join(rep["passes"]) in rep["reproducer"]
    ops = {ins.op for ins in Program.load(rep_path.parent / "program.pimb").instrs}
    assert {Op.EWMUL, Op.EWADD, Op.AF} <= ops


def test_verify_unknown_pass_names_it_and_lists_the_valid_ones(tmp_path):
    r = sh("verify", "-m", "llama-tiny", "--passes", "default,no-such-pass", "--runs-dir", str(tmp_path))
    assert r.returncode == 64, r.stderr
    assert "'no-such-pass'" in r.stderr and "ew-swiglu" in r.stderr and "gemv-batch" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())  # refused before any work
    r = sh("verify", "-m", "llama-tiny", "--passes", " , ", "--runs-dir", str(tmp_path))
    assert r.returncode == 64 and "names no pass" in r.stderr
