"""Outcomes, expectations (XPASS), JUnit, sweep rows for crashes and hangs, stage timeouts."""

import json
import sys
import xml.etree.ElementTree as ET

import pytest

from nhil import expectations
from nhil.report.junit import junit_xml
from nhil.sweep import checklist_markdown, matrix_markdown, row_seed, run_one
from nhil.verify import STAGE_TIMEOUTS, VerifyOptions, verify


def _rep(outcome, **kw):
    r = {"model": "m", "target": "sim", "quant": "bf16", "seed": 7, "outcome": outcome, "reproducer": "make verify MODEL=m", "timings": {"run": 1.5}, "checks": []}
    r.update(kw)
    return r


def test_junit_maps_outcomes_and_carries_properties():
    xml = junit_xml([_rep("PASS"), _rep("MISMATCH", checks=[{"name": "tokens", "passed": False, "detail": "step 3"}]), _rep("LINK_FAIL", error="board reset"), _rep("XPASS")])
    root = ET.fromstring(xml.split("?>", 1)[1])
    assert root.get("tests") == "4" and root.get("failures") == "2" and root.get("errors") == "1"
    cases = root.findall("testcase")
    assert cases[0].find("failure") is None and cases[0].find("error") is None
    assert "tokens: step 3" in cases[1].find("failure").get("message")
    assert "board reset" in cases[2].find("error").get("message")
    props = {p.get("name"): p.get("value") for p in cases[0].find("properties")}
    assert props["seed"] == "7" and props["target"] == "sim" and props["time.run"] == "1.5"


def test_expected_failure_that_passes_is_xpass(tmp_path):
    man = tmp_path / "exp.yaml"
    man.write_text("schema: 1\nexpectations:\n  - {model: m, target: sim, quant: bf16, expect: MISMATCH, reason: known bug 12}\n")
    r = _rep("PASS")
    expectations.apply_expectation(r, man)
    assert r["outcome"] == "XPASS" and not r["as_expected"] and "known bug 12" in r["error"]
    r = _rep("MISMATCH")
    expectations.apply_expectation(r, man)
    assert r["outcome"] == "MISMATCH" and r["as_expected"]
    expectations.update([_rep("PASS")], man)
    assert expectations.lookup("m", "sim", path=man)["expect"] == "PASS"


def test_bad_manifest_is_a_clear_error(tmp_path):
    man = tmp_path / "exp.yaml"
    man.write_text("expectations:\n  - {target: sim}\n")
    with pytest.raises(Exception, match="needs at least model and target"):
        expectations.load(man)


def test_row_seed_is_stable_and_depends_on_the_row():
    assert row_seed("llama", "sim", "bf16", 0) == row_seed("llama", "sim", "bf16", 0)
    assert row_seed("llama", "sim", "bf16", 0) != row_seed("llama", "rtl", "bf16", 0)
    assert row_seed("llama", "sim", "bf16", 0) != row_seed("llama", "sim", "bf16", 1)


def test_sweep_row_that_hangs_is_timeout_and_one_that_dies_is_crash(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time; time.sleep(30)\n")
    die = tmp_path / "die.py"
    die.write_text("import sys; sys.stderr.write('segfault-ish'); sys.exit(139)\n")
    row = {"model": "llama-tiny", "target": "sim", "quant": "bf16"}
    # run_one calls `python -m nhil.cli ...`; a fake interpreter script stands in for a hung/crashed verify
    fake_hang = tmp_path / "py_hang"
    fake_hang.write_text(f"#!/bin/sh\nexec {sys.executable} {hang}\n")
    fake_hang.chmod(0o755)
    fake_die = tmp_path / "py_die"
    fake_die.write_text(f"#!/bin/sh\nexec {sys.executable} {die}\n")
    fake_die.chmod(0o755)
    r = run_one(row, 0, tmp_path / "a", timeout_s=1.0, python=str(fake_hang))
    assert r["outcome"] == "TIMEOUT" and "1 s" in r["error"]
    r = run_one(row, 0, tmp_path / "b", timeout_s=20, python=str(fake_die))
    assert r["outcome"] == "CRASH" and "segfault-ish" in r["error"]
    md = matrix_markdown([r])
    assert "CRASH" in md and "reproduce" in md


def test_stage_timeout_gives_timeout_outcome_and_keeps_a_report(tmp_path, monkeypatch):
    monkeypatch.setitem(STAGE_TIMEOUTS, "export", 0.05)
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=2, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "TIMEOUT" and rep["stage"] == "export"
    saved = json.loads(next((tmp_path / "r").glob("*/report.json")).read_text())
    assert saved["outcome"] == "TIMEOUT"
    assert (next((tmp_path / "r").glob("*/junit.xml"))).exists()


def test_repeat_checks_determinism(tmp_path):
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=3, repeat=2, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS"
    det = next(c for c in rep["checks"] if c["name"] == "deterministic")
    assert det["passed"] and "2/2" in det["detail"]


def test_checklist_marks_steps_from_results():
    man = [{"model": "m", "target": "rtl", "quant": "bf16", "expect": "PASS"}, {"model": "m", "target": "fpga", "quant": "bf16"}]
    res = [_rep("LINK_FAIL", target="rtl", checks=[{"name": "program_round_trip", "passed": True, "detail": ""}])]
    md = checklist_markdown(man, res)
    line = next(l for l in md.splitlines() if l.startswith("| m | rtl"))
    assert "LINK_FAIL" in line and "[x]" in line and "**no**" in line
    assert "not run" in next(l for l in md.splitlines() if l.startswith("| m | fpga"))
