"""The per-row bring-up table of the latest sweep (``nhil checklist --rows``): one line per
manifest row, one mark per bring-up step. The staged gates are :mod:`nhil.report.checklist`."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from nhil.sweep import read_log


CHECKLIST_STEPS = [
    ("program", "Program compiles and round-trips (.pimb encode/decode, disasm/asm)", lambda r: any(c["name"] == "program_round_trip" and c["passed"] for c in r.get("checks", []))),
    ("load", "Target accepts the program (capabilities, device size)", lambda r: r.get("outcome") not in ("LOAD_FAIL", "COMPILE_FAIL") and "load_target" in (r.get("timings") or {})),
    ("link", "Link / simulator session stays up for the whole run", lambda r: r.get("outcome") not in ("LINK_FAIL", "TIMEOUT", "CRASH")),
    ("bitexact", "Bit-identical to the simulator at every SYNC", lambda r: r.get("target") == "sim" or any(c["name"] == "bit_identical_to_sim" and c["passed"] for c in r.get("checks", []))),
    ("tokens", "Tokens equal the golden (teacher-forced and free-running)", lambda r: all(c["passed"] for c in r.get("checks", []) if c["name"] in ("teacher_forced_top1", "free_running_tokens")) and bool(r.get("checks"))),
    ("accuracy", "Logits and hidden states within tolerance", lambda r: all(c["passed"] for c in r.get("checks", []) if c["name"] in ("logits_within_tolerance", "hidden_states_within_tolerance")) and bool(r.get("checks"))),
]


def _evidence(r: dict) -> str:
    """Run folder and its UTC date (from the folder's ``<YYYYmmddTHHMMSS>-`` prefix) of a result."""
    rd = r.get("run_dir")
    if not rd:
        return "-"
    name = Path(rd).name
    try:
        when = _dt.datetime.strptime(name[:15], "%Y%m%dT%H%M%S").strftime("%Y-%m-%d %H:%M")
    except ValueError:
        when = "?"
    return f"`{rd}/report.html` ({when} UTC)"


def checklist_markdown(manifest: list[dict], results: list[dict], meta: dict | None = None) -> str:
    """Silicon bring-up checklist: per manifest row, each bring-up step checked from the latest result.

    Columns: the row, its expected and latest outcome, one mark per :data:`CHECKLIST_STEPS`
    step, the evidence (the run's report and date) and the row's ``owner`` (manifest field,
    ``-`` if unset). ``meta`` is the sweep's ``summary.json`` (folder, start, wall time,
    workers, git commit) shown in the header."""
    by = {(r["model"], r["target"], r.get("quant", "bf16")): r for r in results}
    lines = ["# Bring-up checklist", "", f"Generated {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} from `expectations.yaml` and the latest sweep."]
    if meta:
        lines += ["", f"Sweep `{meta.get('dir', '?')}`: started {meta.get('started', '?')}, {meta.get('rows_done', '?')}/{meta.get('rows_total', '?')} rows, "
                  f"wall time {meta.get('wall_s', '?')} s with {meta.get('workers', '?')} worker(s), commit `{meta.get('git_commit', '?')}`, run seed {meta.get('run_seed', '?')}."]
    lines.append("")
    lines += ["| model | target | quant | expected | latest | " + " | ".join(s[0] for s in CHECKLIST_STEPS) + " | evidence | owner |",
              "|---|---|---|---|---|" + "---|" * len(CHECKLIST_STEPS) + "---|---|"]
    for row in manifest:
        key = (row["model"], row["target"], row.get("quant", "bf16"))
        r = by.get(key)
        pending = r is None or r.get("outcome") == "INCOMPLETE"  # not run, still running, or its worker died: no evidence either way
        marks = ["[ ]" if pending else ("[x]" if fn(r) else "[ ] **no**") for _, _, fn in CHECKLIST_STEPS]
        latest = "not run" if r is None else r["outcome"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {row.get('expect', 'PASS')} | {latest} | " + " | ".join(marks)
                     + f" | {'-' if r is None else _evidence(r)} | {row.get('owner', '-')} |")
    lines += ["", "Steps:", ""] + [f"- **{k}**: {desc}" for k, desc, _ in CHECKLIST_STEPS]
    return "\n".join(lines) + "\n"


def latest_summary(out_root: Path = Path("runs/sweeps")) -> dict:
    """``summary.json`` of the most recent sweep plus its folder as ``dir`` ({} if none)."""
    latest = Path(out_root) / "latest"
    p = latest / "summary.json"
    if not p.exists():
        return {}
    return dict(json.loads(p.read_text()), dir=str(Path(out_root) / latest.resolve().name))


def latest_results(out_root: Path = Path("runs/sweeps")) -> list[dict]:
    """Rows of the most recent sweep's results.jsonl ([] if none)."""
    rows = read_log(Path(out_root) / "latest")
    out = []
    for r in rows:
        rep = r
        rd = r.get("run_dir")
        if rd and Path(rd, "report.json").exists():
            rep = json.loads(Path(rd, "report.json").read_text())
            rep.update({k: r[k] for k in ("outcome", "quant") if r.get(k)})
        out.append(rep)
    return out
