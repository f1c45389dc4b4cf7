"""The staged silicon bring-up checklist (``nhil checklist``): gates in order, each passed
only by evidence.

Gates (:data:`GATES`), in the order a bring-up team signs them off:

1. ``unit``: ISA and datapath unit tests, per weight format;
2. ``programs``: single-instruction and single-layer programs on each target;
3. ``tiny``: the tiny models of each family on each target (manifest rows, zoo models);
4. ``real``: the real model per quant recipe on each target (manifest rows, ``llama``);
5. ``soak``: the link soak under faults (manifest rows with ``faults``).

Evidence is either a sweep row (the newest record of that row id in any
``runs/sweeps/*/results.jsonl``, with the commit it ran on and when it finished) or a test
case of the evidence run (``nhil evidence`` -> ``runs/evidence/tests.json``: pytest node id,
outcome, commit, time). Each requirement of a gate is

* ``passed``: its evidence ran on the commit under test and ended as expected;
* ``failing``: it ran on the commit under test and did not;
* ``stale``: its newest evidence ran on another commit (older than the commit under test,
  or not known);
* ``missing``: there is no evidence at all;

and a gate is ``passed`` only when every requirement is; otherwise it takes the worst
status (failing, missing, stale) and names the command that produces the evidence. The
commit under test is ``git rev-parse HEAD`` of the working directory. Output: Markdown
(:func:`render_markdown`), self-contained HTML (:func:`render_html`) and the same data as
JSON (:func:`build_checklist`).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import subprocess
from pathlib import Path

REAL_MODELS = frozenset({"llama"})
EVIDENCE_PATH = Path("runs/evidence/tests.json")
ORDER = {"failing": 0, "missing": 1, "stale": 2, "passed": 3}

# gate 1: node-id prefixes of the ISA suite and the RTL datapath probe; one requirement per format besides
UNIT_ISA = ("tests/test_isa.py::",)
UNIT_DATAPATH = ("tests/test_rtl.py::test_datapath_blocks_match_the_numerics_contract",)
UNIT_FORMAT_FILES = ("tests/test_formats.py", "tests/test_numerics.py")
# gate 2: per target, the tests that run single instructions and a single layer (GEMV) on it, bit-identical to the contract
PROGRAM_TESTS = {
    "sim": {"single instruction": ("tests/test_sim.py::test_wr_gb_and_copy_gb_bk_and_rd_sbk", "tests/test_sim.py::test_mac_sb_touches_one_bank_and_accumulates_on_top"),
            "single layer": ("tests/test_sim.py::test_builder_gemv_through_runner_equals_contract_multi_chunk_multi_group",)},
    "rtl": {"single instruction": ("tests/test_rtl.py::test_every_opcode_with_special_values_is_bit_identical_to_the_simulator",),
            "single layer": ("tests/test_rtl.py::test_builder_gemv_program_is_bit_identical_to_the_simulator",)},
    "fpga": {"single instruction": ("tests/test_fpga.py::test_run_error_on_board_matches_sim",),
             "single layer": ("tests/test_fpga.py::test_fpga_bit_identical_to_sim",)},
}


def evidence_node_ids() -> list[str]:
    """pytest node ids (files or tests) that ``nhil evidence`` runs for gates 1 and 2."""
    ids = list(UNIT_FORMAT_FILES) + [p.rstrip(":") for p in UNIT_ISA] + list(UNIT_DATAPATH)
    for reqs in PROGRAM_TESTS.values():
        for tests in reqs.values():
            ids += list(tests)
    return list(dict.fromkeys(ids))


GATES = [
    ("unit", "ISA and datapath unit tests, per format", "nhil evidence"),
    ("programs", "Single-instruction and single-layer programs on each target", "nhil evidence"),
    ("tiny", "Tiny models per family on each target", "nhil sweep --nightly --rows {rows}"),
    ("real", "Real model per quant recipe on each target", "nhil sweep --nightly --rows {rows}"),
    ("soak", "Link soak under faults", "nhil sweep --nightly --rows {rows}"),
]


# ------------------------------------------------------------------ evidence
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def resolve_commit(desc: str | None) -> str:
    """Full sha of a ``git describe --always --dirty`` string ("" if unknown)."""
    if not desc or desc == "unknown":
        return ""
    base = desc.removesuffix("-dirty")
    m = re.search(r"-g([0-9a-f]{7,40})$", base)  # tag-N-gSHA
    return _git("rev-parse", "--verify", "--quiet", (m.group(1) if m else base) + "^{commit}")


def commit_under_test() -> dict:
    """``{"sha", "describe"}`` of the working directory's HEAD."""
    return {"sha": _git("rev-parse", "HEAD"), "describe": _git("describe", "--always", "--dirty") or "unknown"}


def collect_rows(out_root: Path = Path("runs/sweeps")) -> dict[str, dict]:
    """Row id -> newest record over every sweep folder (folders in name = time order; a
    record without ``git_commit`` / ``finished`` takes its folder's ``summary.json`` values)."""
    from nhil.sweep import row_id

    rows: dict[str, dict] = {}
    root = Path(out_root)
    if not root.is_dir():
        return rows
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        log = d / "results.jsonl"
        if not log.exists():
            continue
        try:
            summary = json.loads((d / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        for line in log.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            r.setdefault("git_commit", summary.get("git_commit"))
            if not r.get("finished"):
                r["finished"] = summary.get("finished") or summary.get("started")
            r["sweep_dir"] = str(d)
            rows[row_id(r)] = r
    return rows


def load_test_evidence(path: Path = EVIDENCE_PATH) -> dict:
    """``runs/evidence/tests.json`` ({} if absent or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------ judging
def _freshness(commit_desc: str | None, cut: dict) -> tuple[bool, str]:
    sha = resolve_commit(commit_desc)
    if not sha:
        return False, f"ran on an unknown commit ({commit_desc or 'not recorded'})"
    if sha != cut["sha"]:
        older = subprocess.run(["git", "merge-base", "--is-ancestor", sha, cut["sha"]], capture_output=True).returncode == 0
        return False, f"ran on {commit_desc}, {'older than' if older else 'not'} the commit under test {cut['describe']}"
    return True, ""


def _row_requirement(entry: dict, rows: dict, cut: dict) -> dict:
    from nhil.sweep import row_id

    rid = row_id(entry)
    name = f"{entry['model']} on {entry['target']}, {entry.get('quant', 'bf16')}" + (f" [{'; '.join(x for x in [entry.get('faults') and 'faults ' + entry['faults'], entry.get('board') and 'board ' + entry['board']] if x)}]"
                                                                                     if entry.get("faults") or entry.get("board") else "")
    r = rows.get(rid)
    if r is None:
        return {"name": name, "row_id": rid, "status": "missing", "detail": "no sweep has run this row", "evidence": None}
    ev = {"source": "sweep", "row_id": rid, "outcome": r.get("outcome"), "expected": r.get("expected", entry.get("expect", "PASS")), "commit": r.get("git_commit"),
          "time": r.get("finished"), "run_dir": r.get("run_dir"), "sweep_dir": r.get("sweep_dir"), "reproducer": r.get("reproducer")}
    fresh, why = _freshness(r.get("git_commit"), cut)
    if not fresh:
        return {"name": name, "row_id": rid, "status": "stale", "detail": why, "evidence": ev}
    ok = r.get("outcome") == entry.get("expect", "PASS")
    detail = "" if ok else f"{r.get('outcome')} (expected {entry.get('expect', 'PASS')}): {r.get('error') or ''}".strip()
    return {"name": name, "row_id": rid, "status": "passed" if ok else "failing", "detail": detail, "evidence": ev}


def _tests_requirement(name: str, match, tests: dict, cut: dict) -> dict:
    cases = {nid: c for nid, c in (tests.get("cases") or {}).items() if match(nid)}
    if not cases:
        return {"name": name, "status": "missing", "detail": "no test case of the evidence run covers this" if tests else "no evidence run", "evidence": None}
    ev = {"source": "tests", "tests": sorted(cases), "commit": tests.get("git_commit"), "time": tests.get("finished"), "file": tests.get("path")}
    fresh, why = _freshness(tests.get("git_commit"), cut)
    if not fresh:
        return {"name": name, "status": "stale", "detail": why, "evidence": ev}
    bad = [nid for nid, c in cases.items() if c.get("outcome") not in ("passed",)]
    return {"name": name, "status": "failing" if bad else "passed", "detail": ("; ".join(f"{n}: {cases[n].get('outcome')}" for n in bad[:5])) if bad else f"{len(cases)} case(s) passed",
            "evidence": ev}


def _format_names() -> list[str]:
    from nhil.numerics.formats import FORMATS

    return ["bf16"] + sorted(FORMATS)


def _mentions(fmt: str):
    pat = re.compile(r"(?<![A-Za-z0-9-])" + re.escape(fmt.lower()) + r"(?![A-Za-z0-9-])")  # int4-g128 is not int4-g128-asym

    def match(nid: str) -> bool:
        file, _, rest = nid.partition("::")
        return file in UNIT_FORMAT_FILES and bool(pat.search(rest.lower()))

    return match


def build_checklist(manifest: list[dict], rows: dict | None = None, tests: dict | None = None, cut: dict | None = None,
                    out_root: Path = Path("runs/sweeps")) -> dict:
    """The checklist as data (what the Markdown, HTML and JSON show).

    Args:
        manifest: ``expectations.yaml`` rows (every row, nightly ones too).
        rows / tests / cut: evidence and commit under test (default: :func:`collect_rows`,
            :func:`load_test_evidence`, :func:`commit_under_test`); given in tests.

    Returns:
        ``{"generated", "commit_under_test", "gates": [{"id", "title", "status", "command",
        "requirements": [{"name", "status", "detail", "evidence"}]}]}``.
    """
    rows = collect_rows(out_root) if rows is None else rows
    tests = load_test_evidence() if tests is None else tests
    cut = commit_under_test() if cut is None else cut
    gates = []
    for gid, title, command in GATES:
        reqs: list[dict] = []
        entries: list[dict] = []
        if gid == "unit":
            reqs.append(_tests_requirement("ISA encode/decode, program container, asm/disasm", lambda n: n.startswith(UNIT_ISA), tests, cut))
            reqs.append(_tests_requirement("RTL datapath blocks vs the numerics contract", lambda n: n.startswith(UNIT_DATAPATH), tests, cut))
            reqs += [_tests_requirement(f"format {f}", _mentions(f), tests, cut) for f in _format_names()]
        elif gid == "programs":
            for target, kinds in PROGRAM_TESTS.items():
                for kind, ids in kinds.items():
                    reqs.append(_tests_requirement(f"{kind} on {target}", lambda n, ids=ids: any(n == i or n.startswith(i + "[") for i in ids), tests, cut))
        else:
            for e in manifest:
                kind = "soak" if e.get("faults") else "real" if e["model"] in REAL_MODELS else "tiny"
                if kind == gid:
                    entries.append(e)
            reqs = [_row_requirement(e, rows, cut) for e in entries]
        if not reqs:
            status = "missing"
            reqs = [{"name": "no manifest row belongs to this gate", "status": "missing", "detail": "add rows to expectations.yaml", "evidence": None}]
        else:
            status = min((r["status"] for r in reqs), key=ORDER.__getitem__)
        todo = [r["row_id"] for r in reqs if r.get("row_id") and r["status"] != "passed"] or [r["row_id"] for r in reqs if r.get("row_id")]
        cmd = command.format(rows=",".join(todo) or "ROW_ID")  # only the rows that still lack passing evidence
        gates.append({"id": gid, "title": title, "status": status, "command": cmd, "requirements": reqs})
    return {"generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit_under_test": cut, "gates": gates}


# ------------------------------------------------------------------ rendering
_MARK = {"passed": "[x]", "failing": "[ ] FAILING", "stale": "[ ] STALE", "missing": "[ ] MISSING"}


def _ev_text(ev: dict | None) -> str:
    if not ev:
        return "-"
    what = f"row `{ev['row_id']}` {ev.get('outcome')}" if ev.get("source") == "sweep" else f"{len(ev.get('tests', []))} test case(s) of `{ev.get('file') or EVIDENCE_PATH}`"
    return f"{what}, commit `{ev.get('commit') or '?'}`, {ev.get('time') or '?'}"


def render_markdown(data: dict) -> str:
    """Markdown of :func:`build_checklist`'s data: one section per gate in order."""
    cut = data["commit_under_test"]
    lines = ["# Bring-up checklist", "", f"Generated {data['generated']} for commit `{cut.get('describe')}` ({cut.get('sha', '')[:12]}). "
             "A gate passes only on evidence from this commit: sweep rows (`runs/sweeps/*/results.jsonl`) and the test evidence run (`nhil evidence`).", ""]
    lines += ["| # | gate | status | produce the evidence |", "|---|---|---|---|"]
    for i, g in enumerate(data["gates"], 1):
        lines.append(f"| {i} | {g['title']} | {_MARK[g['status']]} | `{g['command']}` |")
    for i, g in enumerate(data["gates"], 1):
        lines += ["", f"## {i}. {g['title']}: {g['status'].upper()}", ""]
        if g["status"] != "passed":
            lines += [f"Run `{g['command']}` to produce the evidence.", ""]
        lines += ["| requirement | status | evidence | detail |", "|---|---|---|---|"]
        for r in g["requirements"]:
            detail = (r.get("detail") or "").replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {r['name']} | {_MARK[r['status']]} | {_ev_text(r.get('evidence'))} | {detail} |")
    return "\n".join(lines) + "\n"


_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>nhil bring-up checklist</title><style>
body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
.passed{background:#c8f0c8}.failing{background:#f4b4b4}.stale{background:#f8e3a0}.missing{background:#ddd}code{font-size:90%}</style></head><body>
<h1>Bring-up checklist</h1><p>Generated {{ d.generated }} for commit <code>{{ d.commit_under_test.describe }}</code>.
A gate passes only on evidence from this commit.</p>
<table><tr><th>#</th><th>gate</th><th>status</th><th>produce the evidence</th></tr>
{% for g in d.gates %}<tr><td>{{ loop.index }}</td><td><a href="#gate-{{ g.id }}">{{ g.title }}</a></td><td class="{{ g.status }}" id="status-{{ g.id }}">{{ g.status }}</td><td><code>{{ g.command }}</code></td></tr>
{% endfor %}</table>
{% for g in d.gates %}<h2 id="gate-{{ g.id }}">{{ loop.index }}. {{ g.title }}: <span class="{{ g.status }}">{{ g.status }}</span></h2>
<table><tr><th>requirement</th><th>status</th><th>evidence</th><th>detail</th></tr>
{% for r in g.requirements %}<tr><td>{{ r.name }}</td><td class="{{ r.status }}">{{ r.status }}</td><td>{{ ev(r.evidence) }}</td><td>{{ r.detail }}</td></tr>
{% endfor %}</table>{% endfor %}</body></html>
"""


def render_html(data: dict) -> str:
    """Self-contained HTML of the same data (jinja2, autoescaped)."""
    import jinja2

    env = jinja2.Environment(autoescape=True)
    return env.from_string(_HTML).render(d=data, ev=lambda e: _ev_text(e).replace("`", ""))


def write_checklist(data: dict, output: Path) -> list[Path]:
    """Write ``<output>.md``, ``<output>.html`` and ``<output>.json`` atomically (``output``
    without suffix, or with ``.md``); returns the paths."""
    from nhil.util import atomic_write_text

    base = Path(output).with_suffix("") if Path(output).suffix in (".md", ".html", ".json") else Path(output)
    paths = [base.with_suffix(".md"), base.with_suffix(".html"), base.with_suffix(".json")]
    atomic_write_text(paths[0], render_markdown(data))
    atomic_write_text(paths[1], render_html(data))
    atomic_write_text(paths[2], json.dumps(data, indent=2, default=str) + "\n")
    return paths


def run_evidence(output: Path = EVIDENCE_PATH, python: str | None = None, extra: list[str] | None = None) -> dict:
    """``nhil evidence``: run the tests of gates 1 and 2 (:func:`evidence_node_ids`) with
    pytest and write their outcomes, the commit and the times to ``output`` (atomic).

    Returns:
        the evidence dict ``{"path", "git_commit", "started", "finished", "returncode",
        "cases": {node id: {"outcome", "seconds"}}}``.
    """
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    from nhil.sweep import git_commit
    from nhil.util import atomic_write_text

    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    commit = git_commit()
    with tempfile.TemporaryDirectory() as td:
        xml = Path(td) / "junit.xml"
        cmd = [python or sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", "addopts=", "-m", "not nightly", f"--junitxml={xml}", "-o", "junit_family=xunit1",
               *evidence_node_ids(), *(extra or [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        cases = {}
        if xml.exists():
            for tc in ET.parse(xml).getroot().iter("testcase"):
                file = tc.get("file") or (tc.get("classname", "").replace(".", "/") + ".py")
                nid = f"{file}::{tc.get('name')}"
                outcome = "failed" if tc.find("failure") is not None else "error" if tc.find("error") is not None else "skipped" if tc.find("skipped") is not None else "passed"
                cases[nid] = {"outcome": outcome, "seconds": float(tc.get("time") or 0)}
    ev = {"path": str(output), "git_commit": commit, "started": started, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
          "returncode": proc.returncode, "command": " ".join(cmd[:1] + ["-m", "pytest"] + evidence_node_ids()), "cases": cases, "tail": proc.stdout[-1500:]}
    atomic_write_text(output, json.dumps(ev, indent=2) + "\n")
    return ev
