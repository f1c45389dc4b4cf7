"""Manifest rows with link faults / a board: their own variant with its own expectation."""

import json
import sys

import pytest

from nhil import expectations
from nhil.errors import SetupError
from nhil.sweep import run_one


def _man(tmp_path, body):
    p = tmp_path / "exp.yaml"
    p.write_text("schema: 1\nexpectations:\n" + body)
    return p


def test_fault_row_is_its_own_variant_with_its_own_expectation(tmp_path, monkeypatch):
    man = _man(tmp_path, "  - {model: m, target: fpga, quant: bf16, expect: PASS}\n"
                         "  - {model: m, target: fpga, quant: bf16, expect: LINK_FAIL, faults: 'byte_flip=0.3,seed=1', reason: too noisy to finish}\n")
    rows = expectations.load(man)
    assert [expectations.row_variant(r) for r in rows] == ["", "faults=byte_flip=0.3,seed=1"]
    monkeypatch.delenv("FPGA_FAULTS", raising=False)
    assert expectations.lookup("m", "fpga", path=man)["expect"] == "PASS"
    assert expectations.lookup("m", "fpga", path=man, variant="faults=byte_flip=0.3,seed=1")["expect"] == "LINK_FAIL"
    monkeypatch.setenv("FPGA_FAULTS", "byte_flip=0.3,seed=1")  # `make verify ... FPGA_FAULTS=...` finds the fault row
    assert expectations.lookup("m", "fpga", path=man)["expect"] == "LINK_FAIL"
    r = {"model": "m", "target": "fpga", "quant": "bf16", "outcome": "PASS", "variant": "faults=byte_flip=0.3,seed=1"}
    expectations.apply_expectation(r, man)
    assert r["outcome"] == "XPASS" and "too noisy" in r["error"]
    expectations.update([dict(r, outcome="PASS", faults="byte_flip=0.3,seed=1")], man)
    again = expectations.load(man)
    assert [(x.get("faults"), x["expect"]) for x in again] == [(None, "PASS"), ("byte_flip=0.3,seed=1", "PASS")]


def test_bad_faults_in_the_manifest_are_refused_on_load(tmp_path):
    with pytest.raises(SetupError, match=r"entry 0 \(m/fpga\): bad faults 'byte_flop=0.1'"):
        expectations.load(_man(tmp_path, "  - {model: m, target: fpga, faults: 'byte_flop=0.1'}\n"))
    with pytest.raises(SetupError, match="faults apply to the fpga target's link only"):
        expectations.load(_man(tmp_path, "  - {model: m, target: sim, faults: 'byte_flip=0.1'}\n"))


def test_run_one_hands_the_row_faults_to_verify_and_keeps_them_off_plain_rows(tmp_path, monkeypatch):
    """A stand-in interpreter records the environment ``nhil verify`` would get."""
    spy = tmp_path / "spy.py"
    spy.write_text("import json, os, sys\nopen(os.environ['SPY_OUT'], 'a').write(json.dumps({k: os.environ.get(k) for k in ('FPGA_FAULTS', 'FPGA_BOARD')}) + '\\n')\nsys.exit(3)\n")
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {spy}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SPY_OUT", str(tmp_path / "env.jsonl"))
    monkeypatch.setenv("FPGA_FAULTS", "frame_drop=0.5")  # the caller's own setting must not leak into a plain row
    row = {"model": "llama-tiny", "target": "fpga", "quant": "bf16", "faults": "byte_flip=0.01,seed=2", "board": "b1"}
    r = run_one(row, 0, tmp_path / "a", timeout_s=30, python=str(fake))
    run_one({"model": "llama-tiny", "target": "fpga", "quant": "bf16"}, 0, tmp_path / "b", timeout_s=30, python=str(fake))
    seen = [json.loads(x) for x in (tmp_path / "env.jsonl").read_text().splitlines()]
    assert seen == [{"FPGA_FAULTS": "byte_flip=0.01,seed=2", "FPGA_BOARD": "b1"}, {"FPGA_FAULTS": None, "FPGA_BOARD": None}]
    assert r["outcome"] == "CRASH" and r["variant"] == "faults=byte_flip=0.01,seed=2;board=b1"
    assert r["reproducer"].endswith("FPGA_FAULTS=byte_flip=0.01,seed=2 FPGA_BOARD=b1")
