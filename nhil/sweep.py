"""Sweeps over models x targets x quant schemes (``nhil sweep``, ``make nightly``) and the bring-up checklist.

Each combination runs ``nhil verify`` in its own process with a timeout, so a crash or
a hang costs one row, not the sweep: a run that exceeds the timeout is TIMEOUT, one that
dies without a final report is CRASH (or its last stage's INCOMPLETE report). Rows are
appended to ``results.jsonl`` (flushed and fsynced) as soon as each is known, and the
matrix (``matrix.md``) and ``junit.xml`` are rewritten atomically after every row.

Seeds: a row's seed is ``crc32("model/target/quant") XOR run_seed`` (masked to 31 bits)
so each combination is reproducible on its own and the run seed varies all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

from nhil.expectations import apply_expectation


def row_seed(model: str, target: str, quant: str, run_seed: int) -> int:
    """Per-row seed (see the module docstring)."""
    return (zlib.crc32(f"{model}/{target}/{quant}".encode()) ^ int(run_seed)) & 0x7FFFFFFF


def run_one(row: dict, run_seed: int, out_dir: Path, timeout_s: float = 3600, python: str = sys.executable) -> dict:
    """Run one combination in a subprocess; return its final report dict (never raises for run failures)."""
    model, target, quant = row["model"], row["target"], row.get("quant", "bf16")
    seed = row_seed(model, target, quant, run_seed)
    tokens = int(row.get("tokens", 16))
    runs_dir = Path(out_dir) / f"{model}-{target}-{quant}"
    cmd = [python, "-m", "nhil.cli", "verify", "-m", model, "-t", target, "--tokens", str(tokens), "--seed", str(seed), "--runs-dir", str(runs_dir)]
    if quant != "bf16":
        cmd += ["--quant", quant]
    if row.get("device"):
        cmd += ["--device", str(row["device"])]
    t0 = time.perf_counter()
    timed_out = False
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired as e:
        timed_out = True
        tail = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))[-2000:]
    reports = sorted(runs_dir.glob("*/report.json"))
    rep = json.loads(reports[-1].read_text()) if reports else {}
    if timed_out:
        rep.update(outcome="TIMEOUT", error=f"no result after {timeout_s:.0f} s (last stage: {rep.get('stage', 'start')})")
    elif not rep:
        rep = {"outcome": "CRASH", "error": f"verify died without a report: {tail[-500:]}"}
    elif rep.get("outcome") == "INCOMPLETE":
        rep.update(outcome="CRASH", error=f"verify died in stage {rep.get('stage')}: {tail[-500:]}")
    rep.setdefault("model", model)
    rep.setdefault("target", target)
    rep["quant"] = quant
    rep["seed"] = seed
    rep.setdefault("reproducer", f"make verify MODEL={model} TARGET={target} TOKENS={tokens} SEED={seed}" + (f" QUANT={quant}" if quant != "bf16" else ""))
    rep["wall_s"] = round(time.perf_counter() - t0, 2)
    apply_expectation(rep)
    return rep


def matrix_markdown(results: list[dict]) -> str:
    """Markdown matrix: rows = model/quant, columns = targets, cells = outcome (✓ as expected)."""
    targets = sorted({r["target"] for r in results})
    keys = sorted({(r["model"], r.get("quant", "bf16")) for r in results})
    cell = {(r["model"], r.get("quant", "bf16"), r["target"]): r for r in results}
    lines = ["| model | quant | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
    for m, q in keys:
        cells = []
        for t in targets:
            r = cell.get((m, q, t))
            if r is None:
                cells.append("–")
            else:
                mark = "" if r.get("as_expected") else " (expected " + str(r.get("expected")) + ")"
                cells.append(f"{r['outcome']}{mark}, {r.get('wall_s', '?')} s")
        lines.append(f"| {m} | {q} | " + " | ".join(cells) + " |")
    bad = [r for r in results if not r.get("as_expected")]
    lines += ["", f"{len(results) - len(bad)}/{len(results)} as expected."]
    for r in bad:
        lines.append(f"- {r['model']}/{r['target']}/{r.get('quant', 'bf16')}: {r['outcome']}: {r.get('error', '')} -- reproduce: `{r.get('reproducer')}`")
    return "\n".join(lines) + "\n"


def sweep(rows: list[dict], run_seed: int = 0, out_root: Path = Path("runs/sweeps"), timeout_s: float = 3600) -> tuple[Path, list[dict]]:
    """Run every row in order; returns the sweep folder and the results (see the module docstring)."""
    from nhil.report.junit import write_junit
    from nhil.util import atomic_write_text

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path(out_root) / stamp
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with open(out / "results.jsonl", "a") as log:
        for i, row in enumerate(rows, 1):
            print(f"[sweep] {i}/{len(rows)} {row['model']} x {row['target']} x {row.get('quant', 'bf16')} ...", file=sys.stderr, flush=True)
            rep = run_one(row, run_seed, out, timeout_s)
            results.append(rep)
            log.write(json.dumps({k: rep.get(k) for k in ("model", "target", "quant", "seed", "outcome", "expected", "as_expected", "error", "reproducer", "wall_s", "run_dir")}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            atomic_write_text(out / "matrix.md", matrix_markdown(results))
            write_junit(out / "junit.xml", results, suite="nhil-sweep")
            print(f"[sweep]   -> {rep['outcome']} ({rep.get('wall_s')} s)", file=sys.stderr, flush=True)
    latest = Path(out_root) / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name)
    except OSError:
        pass
    return out, results


CHECKLIST_STEPS = [
    ("program", "Program compiles and round-trips (.pimb encode/decode, disasm/asm)", lambda r: any(c["name"] == "program_round_trip" and c["passed"] for c in r.get("checks", []))),
    ("load", "Target accepts the program (capabilities, device size)", lambda r: r.get("outcome") not in ("LOAD_FAIL", "COMPILE_FAIL") and "load_target" in (r.get("timings") or {})),
    ("link", "Link / simulator session stays up for the whole run", lambda r: r.get("outcome") not in ("LINK_FAIL", "TIMEOUT", "CRASH")),
    ("bitexact", "Bit-identical to the simulator at every SYNC", lambda r: r.get("target") == "sim" or any(c["name"] == "bit_identical_to_sim" and c["passed"] for c in r.get("checks", []))),
    ("tokens", "Tokens equal the golden (teacher-forced and free-running)", lambda r: all(c["passed"] for c in r.get("checks", []) if c["name"] in ("teacher_forced_top1", "free_running_tokens")) and bool(r.get("checks"))),
    ("accuracy", "Logits and hidden states within tolerance", lambda r: all(c["passed"] for c in r.get("checks", []) if c["name"] in ("logits_within_tolerance", "hidden_states_within_tolerance")) and bool(r.get("checks"))),
]


def checklist_markdown(manifest: list[dict], results: list[dict]) -> str:
    """Silicon bring-up checklist: per manifest row, each bring-up step checked from the latest result."""
    by = {(r["model"], r["target"], r.get("quant", "bf16")): r for r in results}
    lines = ["# Bring-up checklist", "", f"Generated {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} from `expectations.yaml` and the latest sweep.", ""]
    lines += ["| model | target | quant | expected | latest | " + " | ".join(s[0] for s in CHECKLIST_STEPS) + " |", "|---|---|---|---|---|" + "---|" * len(CHECKLIST_STEPS)]
    for row in manifest:
        key = (row["model"], row["target"], row.get("quant", "bf16"))
        r = by.get(key)
        marks = ["[ ]" if r is None else ("[x]" if fn(r) else "[ ] **no**") for _, _, fn in CHECKLIST_STEPS]
        latest = "not run" if r is None else r["outcome"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {row.get('expect', 'PASS')} | {latest} | " + " | ".join(marks) + " |")
    lines += ["", "Steps:", ""] + [f"- **{k}**: {desc}" for k, desc, _ in CHECKLIST_STEPS]
    return "\n".join(lines) + "\n"


def latest_results(out_root: Path = Path("runs/sweeps")) -> list[dict]:
    """Rows of the most recent sweep's results.jsonl ([] if none)."""
    latest = Path(out_root) / "latest" / "results.jsonl"
    if not latest.exists():
        return []
    rows = [json.loads(line) for line in latest.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        rep = r
        rd = r.get("run_dir")
        if rd and Path(rd, "report.json").exists():
            rep = json.loads(Path(rd, "report.json").read_text())
            rep.update({k: r[k] for k in ("outcome", "quant") if r.get(k)})
        out.append(rep)
    return out
