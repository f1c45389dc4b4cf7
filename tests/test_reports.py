"""Outcomes, expectations (XPASS), JUnit, sweep rows for crashes and hangs, stage timeouts."""

import json
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from nhil import expectations
from nhil.report.junit import junit_xml
from nhil.report.row_checklist import checklist_markdown
from nhil.sweep import matrix_markdown, row_seed, run_one
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
    monkeypatch.setenv("NHIL_CACHE", "0")  # the export stage must run (a cached program skips it)
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
    # evidence (run report and its date from the folder stamp), owner, and the sweep's commit
    res[0]["run_dir"] = "runs/sweeps/x/m-rtl-bf16/20261129T181649-m-rtl"
    man[0]["owner"] = "alice"
    md = checklist_markdown(man, res, {"dir": "runs/sweeps/x", "git_commit": "abc1234", "workers": 2, "wall_s": 12.5})
    line = next(l for l in md.splitlines() if l.startswith("| m | rtl"))
    assert line.endswith("| `runs/sweeps/x/m-rtl-bf16/20261129T181649-m-rtl/report.html` (2026-11-29 18:16 UTC) | alice |")
    assert next(l for l in md.splitlines() if l.startswith("| m | fpga")).endswith("| - | - |")
    assert "commit `abc1234`" in md and "wall time 12.5 s with 2 worker(s)" in md
    # a row still running (or whose worker died) is INCOMPLETE with no step ticked or refused
    md = checklist_markdown(man, [_rep("INCOMPLETE", target="rtl")])
    line = next(l for l in md.splitlines() if l.startswith("| m | rtl"))
    assert "INCOMPLETE" in line and "[x]" not in line and "**no**" not in line


# --- per-row tolerance overrides (expectations.yaml `tolerance:`) ---------------------------

from nhil.errors import SetupError  # noqa: E402
from nhil.golden import tolerances  # noqa: E402

BF16 = "bf16-act-fp32-acc"
_OK_LOGITS = {"cosine": 1.0, "sqnr_db": 22.0, "kl": 0.0, "top1_agree": True, "max_abs": 0.0}


def test_override_replaces_one_threshold_and_keeps_the_profile_value():
    # 22 dB is below the profile's 25 dB floor (a violation) and above an override of 20 dB
    assert [v.metric for v in tolerances.failing(tolerances.check(BF16, "logits", _OK_LOGITS))] == ["sqnr_db"]
    ov = {"logits.sqnr_db": {"min": 20, "reason": "known weak head on this row"}}
    assert tolerances.failing(tolerances.check(BF16, "logits", _OK_LOGITS, ov)) == []
    stricter = tolerances.failing(tolerances.check(BF16, "logits", dict(_OK_LOGITS, sqnr_db=30.0), {"logits.sqnr_db": {"min": 31, "reason": "r"}}))
    assert len(stricter) == 1 and stricter[0].threshold == 31.0 and stricter[0].overridden and "(override)" in str(stricter[0])
    table = tolerances.apply_overrides(BF16, ov)
    th = table["logits"]["sqnr_db"]
    assert th["min"] == 20.0 and th["reason"] == "known weak head on this row" and th["asserted"] is True
    assert th["override"]["profile_value"] == tolerances.PROFILES[BF16]["logits"]["sqnr_db"]["min"] == 25.0
    assert table["logits"]["kl"] == tolerances.PROFILES[BF16]["logits"]["kl"]  # the others untouched
    assert tolerances.PROFILES[BF16]["logits"]["sqnr_db"]["min"] == 25.0  # the profile itself is not modified
    # demoting to observe-only: still reported, no longer failing
    demoted = tolerances.check(BF16, "logits", dict(_OK_LOGITS, sqnr_db=10.0), {"logits.sqnr_db": {"min": 25, "asserted": False, "reason": "r"}})
    assert [v.metric for v in demoted] == ["sqnr_db"] and tolerances.failing(demoted) == []


@pytest.mark.parametrize("ov, msg", [
    ({"logits.sqnr_db": {"min": 20}}, "needs a reason"),
    ({"logits.sqnr_db": {"min": 20, "reason": "  "}}, "needs a reason"),
    ({"logits.snr": {"min": 20, "reason": "r"}}, "unknown metric 'snr'.*known: cosine, kl, max_abs, sqnr_db, top1_agree"),
    ({"logit.sqnr_db": {"min": 20, "reason": "r"}}, "unknown kind 'logit'"),
    ({"sqnr_db": {"min": 20, "reason": "r"}}, "must be named <kind>.<metric>"),
    ({"logits.kl": {"min": 0.1, "reason": "r"}}, "bounds this metric by max: use max"),
    ({"logits.kl": {"max": "small", "reason": "r"}}, "max must be a number"),
    ({"logits.kl": {"max": 0.1, "min": 0, "reason": "r"}}, "exactly one of min or max"),
    ({"logits.kl": {"max": 0.1, "reason": "r", "why": "x"}}, "unknown field"),
])
def test_bad_override_is_refused_naming_the_problem(ov, msg):
    with pytest.raises(ValueError, match=msg):
        tolerances.apply_overrides(BF16, ov)


def test_manifest_with_a_bad_override_is_refused_at_load(tmp_path):
    man = tmp_path / "exp.yaml"
    man.write_text("schema: 1\nexpectations:\n  - {model: m, target: sim, tolerance: {logits.sqnr_db: {min: 20}}}\n")
    with pytest.raises(SetupError, match=r"exp.yaml: entry 0 \(m/sim/bf16\): tolerance override 'logits.sqnr_db' needs a reason"):
        expectations.load(man)
    man.write_text("schema: 1\nexpectations:\n  - {model: m, target: sim, tolerance: {hidden.psnr: {min: 20, reason: r}}}\n")
    with pytest.raises(SetupError, match="unknown metric 'psnr'"):
        expectations.load(man)
    # run-level metrics of quantized profiles are known before any quant profile is registered
    man.write_text("schema: 1\nexpectations:\n  - {model: m, target: sim, quant: int4, tolerance: {run.top1_rate: {min: 0.8, reason: r}}}\n")
    assert expectations.tolerance_overrides("m", "sim", "int4", man) == {"run.top1_rate": {"min": 0.8, "reason": "r"}}


def test_update_manifest_keeps_overrides_reasons_and_header(tmp_path):
    man = tmp_path / "exp.yaml"
    man.write_text("# header comment\n# second line\nschema: 1\nexpectations:\n"
                   "  - {model: m, target: sim, quant: bf16, expect: MISMATCH, reason: bug 5, nightly: true,"
                   " tolerance: {logits.sqnr_db: {min: 20, reason: weak head}}}\n")
    expectations.update([_rep("PASS"), _rep("PASS", target="rtl")], man)
    text = man.read_text()
    assert text.startswith("# header comment\n# second line\n")
    e = expectations.lookup("m", "sim", path=man)
    assert e["expect"] == "PASS" and e["reason"] == "bug 5" and e["nightly"] is True
    assert e["tolerance"] == {"logits.sqnr_db": {"min": 20, "reason": "weak head"}}
    assert expectations.lookup("m", "rtl", path=man)["expect"] == "PASS"
    # a verify report's quant is a dict: it still finds the bf16 row
    r = _rep("PASS", quant={"recipe": "bf16"})
    expectations.apply_expectation(r, man)
    assert r["expected"] == "PASS" and r["as_expected"]


def _html_text(html):
    import re

    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "DATA", html)


def test_verify_applies_overrides_and_the_reports_show_them(tmp_path):
    """A real llama-tiny run with a manifest row that tightens two thresholds beyond what bf16 can reach."""
    import base64
    import re
    from pathlib import Path

    man = tmp_path / "exp.yaml"
    # any finite SQNR is < 1000 dB: every step fails; the embedding is a bf16 table lookup
    # (bit-exact, SQNR inf) so the first layer over the hidden override is model.layers.0
    man.write_text("schema: 1\nexpectations:\n  - model: llama-tiny\n    target: sim\n    expect: PASS\n    reason: tiny\n    tolerance:\n"
                   "      logits.sqnr_db: {min: 1000, reason: 'test: beyond bf16'}\n"
                   "      hidden.sqnr_db: {min: 1000, reason: 'test: hidden beyond bf16'}\n")
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=3, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r", manifest=man))
    assert rep["outcome"] == "MISMATCH" and rep["expected"] == "PASS" and not rep["as_expected"]
    assert rep["layers"][0]["layer"] == "model.embed_tokens" and rep["layers"][0]["sqnr_db"] == "inf"
    assert rep["first_divergent_layer"]["layer"] == "model.layers.0"
    logits_check = next(c for c in rep["checks"] if c["name"] == "logits_within_tolerance")
    assert not logits_check["passed"] and logits_check["detail"].count("needs >= 1000 (override): test: beyond bf16") == 3
    ovs = {o["metric"]: o for o in rep["tolerance_overrides"]}
    assert ovs["logits.sqnr_db"]["profile_value"] == 25.0 and ovs["hidden.sqnr_db"]["profile_value"] == 30.0
    assert rep["thresholds"]["logits"]["sqnr_db"]["min"] == 1000.0
    run_dir = Path(rep["run_dir"])
    md = (run_dir / "report.md").read_text()
    assert "## Tolerance overrides" in md and "| logits.sqnr_db | >= 1000 | test: beyond bf16 | >= 25 in bf16-act-fp32-acc |" in md
    assert ">= 1000 (override; profile >= 25)" in md

    html = (run_dir / "report.html").read_text()
    assert 'id="outcome">MISMATCH<' in html
    assert f'<pre id="reproducer">{rep["reproducer"]}</pre>' in html and "SEED=0" in rep["reproducer"]
    text = _html_text(html)
    assert "<b>model.layers.0</b>: hidden.sqnr_db" in text
    assert "<td>logits.sqnr_db</td><td>&gt;= 1000</td><td>test: beyond bf16</td><td>&gt;= 25 in bf16-act-fp32-acc</td>" in text
    for stage in rep["timings"]:
        assert f"<tr><td>{stage}</td>" in text
    # plots are embedded, not linked: each data URI decodes to the PNG written beside the report
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert sorted(base64.b64decode(u) for u in uris) == sorted((run_dir / p).read_bytes() for p in rep["plots"])
    assert "layers.png" in rep["plots"] and not re.search(r'(src|href)="(?!data:)', html)
    # cells over their (overridden) threshold are highlighted: 3 steps + 2 layers on sqnr_db
    assert text.count('class="viol"') == 5

    # the same override demoted to observe-only: the run passes, the violation is still shown
    man.write_text(man.read_text().replace("{min: 1000, reason: 'test: beyond bf16'}", "{min: 1000, asserted: false, reason: 'test: observe'}")
                   .replace("{min: 1000, reason: 'test: hidden beyond bf16'}", "{min: 1000, asserted: false, reason: 'test: observe'}"))
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=3, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r2", manifest=man))
    assert rep["outcome"] == "PASS", rep["checks"]
    html = (Path(rep["run_dir"]) / "report.html").read_text()
    assert 'id="outcome">PASS<' in html and _html_text(html).count('class="obs"') == 5


# --- aggregated sweep / nightly report ---------------------------------------------------------


def test_sweep_writes_a_self_contained_html_matrix(tmp_path):
    from pathlib import Path

    from nhil.report.html import render_sweep_html
    from nhil.sweep import read_log, sweep

    out, results = sweep([{"model": "llama-tiny", "target": "sim", "quant": "bf16", "tokens": 2}], run_seed=3, out_root=tmp_path)
    (r,) = results
    assert r["outcome"] == "PASS" and r["seed"] == row_seed("llama-tiny", "sim", "bf16", 3)
    assert (tmp_path / "latest").resolve() == out.resolve()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["rows_done"] == summary["rows_total"] == 1 and summary["outcomes"] == {"PASS": 1}
    assert r["wall_s"] <= summary["wall_s"]
    html = (out / "report.html").read_text()
    cell = re.search(r'<td class="([^"]*)" id="cell-llama-tiny-sim-bf16"[^>]*><a href="([^"]+)">PASS</a>', html)
    assert cell and cell.group(1) == "pass"
    assert (out / cell.group(2)).resolve() == (Path(r["run_dir"]) / "report.html").resolve()  # links to the row's own report
    assert f"<code>{r['reproducer']}</code>" in html and f"SEED={r['seed']}" in r["reproducer"]
    assert f'id="meta-wall_s">{summary["wall_s"]}<' in html and 'id="meta-workers">1<' in html
    assert "| llama-tiny | bf16 | PASS, " in (out / "matrix.md").read_text()
    # colour coding of the other outcome classes, from the same rows plus hand-made ones
    rows = read_log(out) + [dict(_rep("CRASH", target="rtl", error="died"), model="llama-tiny", as_expected=False, expected="PASS"),
                            dict(_rep("MISMATCH", target="fpga"), model="llama-tiny", as_expected=True, expected="MISMATCH"),
                            dict(_rep("LINK_FAIL", target="fpga"), model="m", as_expected=False, expected="PASS")]
    h = render_sweep_html(rows, {"workers": 2}, tmp_path)
    classes = {cid: cls for cls, cid in re.findall(r'<td class="([^"]*)" id="cell-([^"]+)"', h)}
    assert classes == {"llama-tiny-sim-bf16": "pass", "llama-tiny-rtl-bf16": "crash", "llama-tiny-fpga-bf16": "fail expected", "m-fpga-bf16": "stage"}
    assert "1/4 as expected" not in h and "2/4 as expected" in h


def test_shared_nightly_folder_keeps_a_row_whose_worker_died(tmp_path):
    from nhil.sweep import pending_row, read_log, record_row, shared_sweep_dir

    a = shared_sweep_dir(tmp_path, "run-abc123456", rows_total=2, workers=2, run_seed=1)
    assert shared_sweep_dir(tmp_path, "run-abc123456", rows_total=2, workers=2) == a  # the second worker finds the same folder
    assert shared_sweep_dir(tmp_path, "other-run", rows_total=2, workers=2) != a
    row1 = {"model": "m", "target": "sim", "quant": "bf16", "expect": "PASS"}
    row2 = {"model": "m", "target": "rtl", "quant": "bf16", "expect": "PASS"}
    record_row(a, pending_row(row1, 1))
    record_row(a, pending_row(row2, 1))  # this worker "dies": no final record for row2
    done = dict(pending_row(row1, 1), outcome="PASS", as_expected=True, error=None, wall_s=0.5)
    meta = record_row(a, done)
    assert meta["rows_done"] == 1 and meta["rows_total"] == 2 and meta["workers"] == 2 and meta["wall_s"] >= 0
    rows = {r["target"]: r for r in read_log(a)}
    assert rows["sim"]["outcome"] == "PASS" and rows["rtl"]["outcome"] == "INCOMPLETE"
    assert rows["rtl"]["reproducer"] == f"make verify MODEL=m TARGET=rtl TOKENS=16 SEED={row_seed('m', 'rtl', 'bf16', 1)}"
    html = (a / "report.html").read_text()
    assert re.search(r'<td class="crash" id="cell-m-rtl-bf16"', html) and 'id="meta-workers">2<' in html
    assert "INCOMPLETE" in (a / "matrix.md").read_text() and "with 2 worker(s)" in (a / "matrix.md").read_text()


@pytest.mark.slow
def test_bench_matrix_times_the_nightly_with_its_worker_count(tmp_path):
    """`nhil bench --matrix` runs tests/test_matrix.py under pytest-xdist and reads the run's own summary."""
    from nhil.bench import bench_matrix

    m = bench_matrix(workers=(1,), rows="llama-tiny-sim-bf16", sweep_root=tmp_path)
    (r,) = m["runs"]
    assert r["returncode"] == 0 and r["workers"] == 1 and r["rows_done"] == r["rows_total"] == 1 and r["outcomes"] == {"PASS": 1}
    summary = json.loads((tmp_path / "latest" / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["kind"] == "nightly" and r["wall_s"] == summary["wall_s"]
    assert 0 < r["wall_s"] < r["process_s"]  # the pytest process also starts up and collects
    assert "speedup" not in m  # one worker count: nothing to compare


def test_verify_html_shows_instruction_divergence_and_link_counters_and_escapes_text():
    from nhil.report.html import render_verify_html

    rep = _rep("MISMATCH", target="fpga", prompt="<script>alert(1)</script>", error="fpga differs from the simulator at instruction 17",
               cross_target_first_mismatch={"instruction": 17, "disasm": "MAC_AB b3 r12", "bank": 3, "target_value": 1.5, "sim_value": 1.25},
               target_stats={"link": {"retries": 2, "crc_errors": 1}, "lockstep": {"syncs_compared": 4, "readbacks_compared": 9, "first_mismatch": None}})
    html = render_verify_html(rep)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    row = re.search(r"<th>instruction \(vs simulator\)</th><td>(.*?)</td></tr>", html).group(1)
    assert "instruction = <code>17</code>" in row and "disasm = <code>MAC_AB b3 r12</code>" in row and "sim_value = <code>1.25</code>" in row
    assert "<tr><td>link.retries</td><td>2</td></tr>" in html and "<tr><td>link.crc_errors</td><td>1</td></tr>" in html
    assert f'<pre id="reproducer">{rep["reproducer"]}</pre>' in html and 'class="badge fail" id="outcome">MISMATCH<' in html
    # no divergence on a lockstep run: the compared counts are shown instead
    del rep["cross_target_first_mismatch"]
    row = re.search(r"<th>instruction \(vs simulator\)</th><td>(.*?)</td></tr>", render_verify_html(rep)).group(1)
    assert row == "none: 4 SYNCs / 9 readbacks bit-identical"
