"""Staged bring-up checklist (nhil/report/checklist.py): gates passed only by fresh evidence."""

import json
import subprocess

import pytest

from nhil.report.checklist import GATES, build_checklist, render_html, render_markdown, write_checklist
from nhil.sweep import row_id


def _git(*a):
    return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def cut():
    return {"sha": _git("rev-parse", "HEAD"), "describe": _git("rev-parse", "--short", "HEAD")}


MANIFEST = [
    {"model": "llama-tiny", "target": "sim", "quant": "bf16", "expect": "PASS"},
    {"model": "llama-tiny", "target": "rtl", "quant": "bf16", "expect": "PASS"},
    {"model": "llama", "target": "sim", "quant": "bf16", "expect": "PASS"},
    {"model": "llama", "target": "sim", "quant": "int8", "expect": "PASS", "nightly": True},
    {"model": "llama-tiny", "target": "fpga", "quant": "bf16", "expect": "PASS", "faults": "byte_flip=0.01,seed=1"},
]


def _row(entry, outcome, commit, when="2026-12-02T03:00:00+00:00"):
    return {"model": entry["model"], "target": entry["target"], "quant": entry["quant"], "variant": "faults=" + entry["faults"] if entry.get("faults") else "",
            "outcome": outcome, "expected": entry["expect"], "git_commit": commit, "finished": when, "reproducer": "make verify ..."}


def _gate(data, gid):
    return next(g for g in data["gates"] if g["id"] == gid)


def test_gates_come_in_order_and_fresh_passing_rows_pass(cut):
    rows = {row_id(e): _row(e, "PASS", cut["describe"]) for e in MANIFEST[:2]}
    data = build_checklist(MANIFEST, rows=rows, tests={}, cut=cut)
    assert [g["id"] for g in data["gates"]] == [g[0] for g in GATES] == ["unit", "programs", "tiny", "real", "soak"]
    tiny = _gate(data, "tiny")
    assert tiny["status"] == "passed" and [r["row_id"] for r in tiny["requirements"]] == ["llama-tiny-sim-bf16", "llama-tiny-rtl-bf16"]
    ev = tiny["requirements"][0]["evidence"]
    assert (ev["row_id"], ev["commit"], ev["time"], ev["outcome"]) == ("llama-tiny-sim-bf16", cut["describe"], "2026-12-02T03:00:00+00:00", "PASS")


def test_a_failing_row_fails_its_gate(cut):
    rows = {row_id(e): _row(e, "PASS", cut["describe"]) for e in MANIFEST[:2]}
    rows["llama-tiny-rtl-bf16"]["outcome"] = "MISMATCH"
    tiny = _gate(build_checklist(MANIFEST, rows=rows, tests={}, cut=cut), "tiny")
    assert tiny["status"] == "failing" and "MISMATCH (expected PASS)" in tiny["requirements"][1]["detail"]


def test_stale_gate_names_the_old_commit_and_the_command(cut):
    old = _git("rev-parse", "--short", "HEAD~1")
    rows = {row_id(e): _row(e, "PASS", cut["describe"]) for e in MANIFEST[2:3]}
    rows[row_id(MANIFEST[3])] = _row(MANIFEST[3], "PASS", old)  # passed, but on the previous commit
    data = build_checklist(MANIFEST, rows=rows, tests={}, cut=cut)
    real = _gate(data, "real")
    assert real["status"] == "stale"
    st = {r["row_id"]: r for r in real["requirements"]}
    assert st["llama-sim-bf16"]["status"] == "passed"
    assert st["llama-sim-int8"]["status"] == "stale" and f"ran on {old}, older than the commit under test" in st["llama-sim-int8"]["detail"]
    assert real["command"] == "nhil sweep --nightly --rows llama-sim-int8"  # only the row that lacks fresh evidence
    md = render_markdown(data)
    assert "## 4. Real model per quant recipe on each target: STALE" in md and "Run `nhil sweep --nightly --rows llama-sim-int8`" in md
    # unknown commit is stale too, never a pass
    rows[row_id(MANIFEST[3])]["git_commit"] = None
    assert _gate(build_checklist(MANIFEST, rows=rows, tests={}, cut=cut), "real")["status"] == "stale"


def test_missing_gate_says_so_and_names_the_command(cut):
    data = build_checklist(MANIFEST, rows={}, tests={}, cut=cut)
    soak = _gate(data, "soak")
    assert soak["status"] == "missing" and soak["requirements"][0]["detail"] == "no sweep has run this row"
    assert soak["requirements"][0]["row_id"] == "llama-tiny-fpga-bf16-faults=byte_flip=0.01_seed=1"
    assert soak["command"] == "nhil sweep --nightly --rows llama-tiny-fpga-bf16-faults=byte_flip=0.01_seed=1"
    assert _gate(data, "unit")["status"] == "missing" and _gate(data, "unit")["command"] == "nhil evidence"
    html = render_html(data)
    assert 'id="status-soak">missing<' in html and "nhil sweep --nightly --rows llama-tiny-fpga-bf16-faults=byte_flip=0.01_seed=1" in html


def test_unit_gate_needs_a_passing_case_per_format(cut):
    from nhil.numerics.formats import FORMATS

    cases = {"tests/test_isa.py::test_word_layout_is_little_endian_as_documented": {"outcome": "passed"},
             "tests/test_rtl.py::test_datapath_blocks_match_the_numerics_contract": {"outcome": "passed"},
             "tests/test_numerics.py::test_bf16_rne_matches_torch_and_ml_dtypes": {"outcome": "passed"}}
    cases.update({f"tests/test_formats.py::test_error_bound_idempotence_and_packing[{f}]": {"outcome": "passed"} for f in FORMATS})
    tests = {"git_commit": cut["describe"], "finished": "2026-12-02T03:00:00+00:00", "cases": cases, "path": "runs/evidence/tests.json"}
    unit = _gate(build_checklist(MANIFEST, rows={}, tests=tests, cut=cut), "unit")
    assert unit["status"] == "passed", [(r["name"], r["status"]) for r in unit["requirements"] if r["status"] != "passed"]
    first = sorted(FORMATS)[0]
    cases[f"tests/test_formats.py::test_error_bound_idempotence_and_packing[{first}]"]["outcome"] = "failed"
    unit = _gate(build_checklist(MANIFEST, rows={}, tests=tests, cut=cut), "unit")
    bad = [r for r in unit["requirements"] if r["status"] != "passed"]
    assert unit["status"] == "failing" and [r["name"] for r in bad] == [f"format {first}"]
    del cases[f"tests/test_formats.py::test_error_bound_idempotence_and_packing[{first}]"]
    unit = _gate(build_checklist(MANIFEST, rows={}, tests=tests, cut=cut), "unit")
    assert unit["status"] == "missing" and [r["name"] for r in unit["requirements"] if r["status"] != "passed"] == [f"format {first}"]


def test_written_json_holds_the_same_data_as_the_markdown(tmp_path, cut):
    data = build_checklist(MANIFEST, rows={}, tests={}, cut=cut)
    md, html, js = write_checklist(data, tmp_path / "checklist.md")
    assert json.loads(js.read_text()) == json.loads(json.dumps(data))
    assert md.read_text() == render_markdown(data) and html.read_text().startswith("<!doctype html>")
