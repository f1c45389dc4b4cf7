"""Sweeps over models x targets x quant schemes (``nhil sweep``, ``make nightly``): rows, seeds, the aggregated folder.

Each combination runs ``nhil verify`` in its own process with a timeout, so a crash or
a hang costs one row, not the sweep: a run that exceeds the timeout is TIMEOUT, one that
dies without a final report is CRASH (or its last stage's INCOMPLETE report). Rows are
appended to ``results.jsonl`` (flushed and fsynced) as soon as each is known, and the
aggregated reports (``matrix.md``, ``junit.xml``, the self-contained ``report.html`` with
the colour-coded models x targets x quant matrix, and ``summary.json`` with the wall
time and worker count) are rewritten atomically after every row.

``nhil sweep`` runs rows one after another (:func:`sweep`); ``make nightly`` runs them
as pytest-xdist cases (``tests/test_matrix.py``) that share one folder
(:func:`shared_sweep_dir`) and log each row under a file lock (:func:`record_row`).
``nhil sweep --ray auto|ADDRESS`` (``make nightly RAY=...``) runs them as Ray tasks
(:mod:`nhil.cluster.ray_sweep`) into ``<stamp>-ray/``. All write to
``runs/sweeps/<stamp>[-nightly-<id>|-ray]/`` and point ``runs/sweeps/latest`` at it; the
staged checklist (:mod:`nhil.report.checklist`) reads every folder's ``results.jsonl``.

A manifest row with ``faults`` or ``board`` is its own variant (:func:`row_id`,
:func:`nhil.expectations.row_variant`); its ``nhil verify`` gets them as ``FPGA_FAULTS`` /
``FPGA_BOARD`` (:func:`row_env`), and a plain row never inherits the caller's.

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

from nhil.expectations import apply_expectation, row_variant


def row_seed(model: str, target: str, quant: str, run_seed: int) -> int:
    """Per-row seed (see the module docstring)."""
    return (zlib.crc32(f"{model}/{target}/{quant}".encode()) ^ int(run_seed)) & 0x7FFFFFFF


def reproducer(row: dict, run_seed: int) -> str:
    """The one-line ``make verify`` command that reruns this row alone (with its seed)."""
    model, target, quant = row["model"], row["target"], row.get("quant", "bf16")
    seed = row_seed(model, target, quant, run_seed)
    cmd = f"make verify MODEL={model} TARGET={target} TOKENS={int(row.get('tokens', 16))} SEED={seed}"
    if row.get("device"):
        cmd += f" DEVICE={row['device']}"
    cmd += f" QUANT={quant}" if quant != "bf16" else ""
    for key, var in (("faults", "FPGA_FAULTS"), ("board", "FPGA_BOARD")):
        if row.get(key):
            cmd += f" {var}={row[key]}"
    return cmd


def row_id(row: dict) -> str:
    """``model-target-quant`` plus the variant's key=value parts (faults, board) for variant rows."""
    rid = f"{row['model']}-{row['target']}-{row.get('quant') or 'bf16'}"
    v = row.get("variant") if "variant" in row else row_variant(row)
    return rid + ("" if not v else "-" + "".join(c if c.isalnum() or c in "._=" else "_" for c in v))


def row_env(row: dict) -> dict:
    """Environment additions of a row's ``nhil verify``: ``FPGA_FAULTS`` and ``FPGA_BOARD``
    from its ``faults`` / ``board`` fields (``nhil/expectations.py``)."""
    env = {}
    if row.get("faults"):
        env["FPGA_FAULTS"] = str(row["faults"])
    if row.get("board"):
        env["FPGA_BOARD"] = str(row["board"])
    return env


def select_rows(rows: list[dict], spec: str) -> list[dict]:
    """``default`` (rows without ``nightly: true``), ``all``, or comma-separated row ids
    (:func:`nhil.sweep.row_id`), like ``NHIL_MATRIX_ROWS``.

    Raises:
        ValueError: an id names no manifest row (lists the known ones).
    """
    if spec == "all":
        return rows
    if spec == "default":
        return [r for r in rows if not r.get("nightly")]
    want = [s.strip() for s in spec.split(",") if s.strip()]
    known = {row_id(r): r for r in rows}
    bad = [w for w in want if w not in known]
    if bad:
        raise ValueError(f"unknown row id(s) {', '.join(bad)}; known: {', '.join(known)}")
    return [known[w] for w in want]


def pending_row(row: dict, run_seed: int) -> dict:
    """The INCOMPLETE record a shared sweep logs when a row starts (replaced when it ends)."""
    quant = row.get("quant", "bf16")
    return {"model": row["model"], "target": row["target"], "quant": quant, "variant": row_variant(row), "seed": row_seed(row["model"], row["target"], quant, run_seed),
            "outcome": "INCOMPLETE", "expected": row.get("expect", "PASS"), "as_expected": False, "reproducer": reproducer(row, run_seed),
            "error": f"row started {_now().isoformat(timespec='seconds')} (pid {os.getpid()}) and has not finished: still running, or its worker died"}


def _die_with_parent() -> None:
    """Linux: SIGKILL this (child) process when its parent dies (``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def run_one(row: dict, run_seed: int, out_dir: Path, timeout_s: float = 3600, python: str = sys.executable, cwd: Path | None = None,
            kill_with_parent: bool = False) -> dict:
    """Run one combination in a subprocess; return its final report dict (never raises for run failures).

    ``cwd``: the checkout the subprocess runs in (its ``goldens/``; default: this process's).
    ``kill_with_parent``: the verify process dies with this one (a Ray worker killed with
    its node must not leave its row running as an orphan).
    A row's ``faults`` / ``board`` reach verify as ``FPGA_FAULTS`` / ``FPGA_BOARD``."""
    model, target, quant = row["model"], row["target"], row.get("quant", "bf16")
    seed = row_seed(model, target, quant, run_seed)
    tokens = int(row.get("tokens", 16))
    from nhil.args import safe_component

    variant = row_variant(row)
    runs_dir = Path(out_dir) / safe_component(row_id(dict(row, variant=variant)), limit=160)  # a name is never a path
    cmd = [python, "-m", "nhil.cli", "verify", "-m", model, "-t", target, "--tokens", str(tokens), "--seed", str(seed), "--runs-dir", str(runs_dir)]
    if quant != "bf16":
        cmd += ["--quant", quant]
    if row.get("device"):
        cmd += ["--device", str(row["device"])]
    t0 = time.perf_counter()
    timed_out = False
    try:
        env = dict(os.environ, **row_env(row))
        for var, key in (("FPGA_FAULTS", "faults"), ("FPGA_BOARD", "board")):
            if not row.get(key):
                env.pop(var, None)  # a plain row never inherits the caller's faults or board
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd, preexec_fn=_die_with_parent if kill_with_parent else None)
        tail = (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired as e:
        timed_out = True
        tail = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))[-2000:]
    from nhil.args import EXIT_USAGE

    reports = sorted(runs_dir.glob("*/report.json"))
    rep = json.loads(reports[-1].read_text()) if reports else {}
    if timed_out:
        rep.update(outcome="TIMEOUT", error=f"no result after {timeout_s:.0f} s (last stage: {rep.get('stage', 'start')})")
    elif not rep and proc.returncode == EXIT_USAGE:
        rep = {"outcome": "USAGE_ERROR", "error": tail.strip().splitlines()[-1] if tail.strip() else "usage error"}
    elif not rep:
        rep = {"outcome": "CRASH", "error": f"verify died without a report: {tail[-500:]}"}
    elif rep.get("outcome") == "INCOMPLETE":
        rep.update(outcome="CRASH", error=f"verify died in stage {rep.get('stage')}: {tail[-500:]}")
    rep.setdefault("model", model)
    rep.setdefault("target", target)
    rep["quant"] = quant
    rep["variant"] = variant
    rep.update({k: row[k] for k in ("faults", "board") if row.get(k)})
    rep["seed"] = seed
    rep.setdefault("reproducer", reproducer(row, run_seed))
    rep["wall_s"] = round(time.perf_counter() - t0, 2)
    apply_expectation(rep)
    return rep


def matrix_markdown(results: list[dict], meta: dict | None = None) -> str:
    """Markdown matrix: rows = model/quant, columns = targets, cells = outcome (✓ as expected).

    ``meta`` (see :func:`render_sweep_html`): when given, a first line with the wall time,
    worker count and rows done/total."""
    lines = []
    if meta:
        lines += [f"wall time {meta.get('wall_s', '?')} s (first row start to last row end) with {meta.get('workers', '?')} worker(s); "
                  f"{meta.get('rows_done', len(results))}/{meta.get('rows_total', '?')} rows; run seed {meta.get('run_seed', '?')}; started {meta.get('started', '?')}; "
                  f"commit {meta.get('git_commit', '?')}", ""]
    targets = sorted({r["target"] for r in results})
    keys = sorted({(r["model"], r.get("quant") or "bf16") for r in results})
    cell = {(r["model"], r.get("quant") or "bf16", r["target"]): r for r in results}
    lines += ["| model | quant | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
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


LOG_FIELDS = ("model", "target", "quant", "variant", "faults", "board", "seed", "outcome", "expected", "as_expected", "error", "reproducer", "wall_s", "run_dir", "stage",
              "node", "git_commit", "finished")


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


def read_log(out: Path) -> list[dict]:
    """Rows of ``<out>/results.jsonl``, the last record per model/target/quant winning (a
    row is logged INCOMPLETE when it starts and again when it ends), in first-seen order."""
    path = Path(out) / "results.jsonl"
    if not path.exists():
        return []
    rows: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a half-written last line of a killed writer
            continue
        rows[(r.get("model"), r.get("target"), r.get("quant") or "bf16", r.get("variant") or "")] = r
    return list(rows.values())


def write_aggregate(out: Path, results: list[dict], meta: dict, title: str = "nhil sweep") -> None:
    """Rewrite the aggregated reports of a sweep folder from ``results`` (dicts with
    :data:`LOG_FIELDS`) and ``meta``: ``matrix.md``, ``junit.xml``, ``report.html`` (self-
    contained, :mod:`nhil.report.html`) and ``summary.json`` (``meta`` plus per-outcome
    counts), each atomically."""
    from nhil.report.html import write_sweep_html
    from nhil.report.junit import write_junit
    from nhil.util import atomic_write_text

    out = Path(out)
    counts: dict[str, int] = {}
    for r in results:
        counts[str(r.get("outcome"))] = counts.get(str(r.get("outcome")), 0) + 1
    summary = dict(meta, outcomes=counts, as_expected=sum(1 for r in results if r.get("as_expected")))
    shown = [dict(r, quant=f"{r.get('quant') or 'bf16'} [{r['variant']}]") if r.get("variant") else r for r in results]  # a variant row gets its own cell
    atomic_write_text(out / "matrix.md", matrix_markdown(shown, meta))
    write_junit(out / "junit.xml", shown, suite="nhil-sweep")
    write_sweep_html(out / "report.html", shown, meta, title=title)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")


def _append(log_path: Path, rep: dict) -> None:
    if rep.get("outcome") != "INCOMPLETE":
        rep.setdefault("finished", _now().isoformat(timespec="seconds"))
    rep.setdefault("git_commit", _GIT_COMMIT or git_commit())
    with open(log_path, "a") as log:
        log.write(json.dumps({k: rep.get(k) for k in LOG_FIELDS}, default=str) + "\n")
        log.flush()
        os.fsync(log.fileno())


def _point_latest(out: Path) -> None:
    latest = out.parent / "latest"
    try:
        tmp = out.parent / f".latest.{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(out.name)
        os.replace(tmp, latest)  # atomic: readers see the old or the new link
    except OSError:
        pass


def sweep(rows: list[dict], run_seed: int = 0, out_root: Path = Path("runs/sweeps"), timeout_s: float = 3600) -> tuple[Path, list[dict]]:
    """Run every row in order; returns the sweep folder and the results (see the module docstring)."""
    stamp = _now().strftime("%Y%m%dT%H%M%S")
    out = Path(out_root) / stamp
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    t0 = time.time()
    meta = {"kind": "sweep", "started": _iso(t0), "workers": 1, "rows_total": len(rows), "rows_done": 0, "run_seed": run_seed, "wall_s": 0.0, "git_commit": git_commit()}
    _point_latest(out)
    for i, row in enumerate(rows, 1):
        print(f"[sweep] {i}/{len(rows)} {row['model']} x {row['target']} x {row.get('quant', 'bf16')} ...", file=sys.stderr, flush=True)
        rep = run_one(row, run_seed, out, timeout_s)
        results.append(rep)
        _append(out / "results.jsonl", rep)
        t1 = time.time()
        meta.update(rows_done=i, finished=_iso(t1), wall_s=round(t1 - t0, 2))
        write_aggregate(out, read_log(out), meta)
        print(f"[sweep]   -> {rep['outcome']} ({rep.get('wall_s')} s)", file=sys.stderr, flush=True)
    return out, results


def shared_sweep_dir(out_root: Path, run_id: str, rows_total: int, workers: int, run_seed: int = 0, kind: str = "nightly") -> Path:
    """The sweep folder shared by every worker of one pytest-xdist run (``make nightly``).

    The first worker to ask creates ``<out_root>/<UTC stamp>-<kind>-<run_id[:8]>`` with a
    ``summary.json`` (start time, ``workers``, ``rows_total``, ``run_seed``); the others
    find it by ``run_id`` (xdist's ``PYTEST_XDIST_TESTRUNUID``, the same in every worker).
    Serialised with a file lock (``filelock``) in ``out_root``; ``out_root/latest`` points
    to the folder.
    """
    from filelock import FileLock

    from nhil.util import atomic_write_text

    root = Path(out_root)
    root.mkdir(parents=True, exist_ok=True)
    tag = "".join(c for c in str(run_id) if c.isalnum())[:8] or "local"
    with FileLock(str(root / ".sweeps.lock")):
        found = sorted(root.glob(f"*-{kind}-{tag}"))
        if found:
            return found[-1]
        t0 = time.time()
        out = root / f"{_now().strftime('%Y%m%dT%H%M%S')}-{kind}-{tag}"
        out.mkdir()
        meta = {"kind": kind, "run_id": str(run_id), "started": _iso(t0), "started_epoch": t0, "workers": int(workers), "rows_total": int(rows_total),
                "rows_done": 0, "run_seed": run_seed, "wall_s": 0.0, "git_commit": git_commit()}
        atomic_write_text(out / "summary.json", json.dumps(meta, indent=2) + "\n")
        _point_latest(out)
        return out


def record_row(out: Path, rep: dict, title: str = "nhil nightly") -> dict:
    """Log one row of a shared sweep (several processes) and rewrite its aggregated reports.

    Appends ``rep`` (its :data:`LOG_FIELDS`) to ``results.jsonl`` and rewrites the reports of
    :func:`write_aggregate` under a file lock in ``out``. Log a row as ``INCOMPLETE`` when it
    starts and again with its outcome when it ends, so a worker killed mid-row still leaves
    its row. ``wall_s`` in ``summary.json`` is the time from the folder's creation (the
    first row's start) to the latest finished row. Returns the updated summary.
    """
    from filelock import FileLock

    out = Path(out)
    with FileLock(str(out / ".lock")):
        _append(out / "results.jsonl", rep)
        meta = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {"started_epoch": time.time()}
        for k in ("outcomes", "as_expected"):
            meta.pop(k, None)
        results = read_log(out)
        done = [r for r in results if r.get("outcome") != "INCOMPLETE"]
        if rep.get("outcome") != "INCOMPLETE":
            t1 = time.time()
            meta.update(finished=_iso(t1), wall_s=round(t1 - float(meta.get("started_epoch", t1)), 2))
        meta["rows_done"] = len(done)
        write_aggregate(out, results, meta, title=title)
        return meta


_GIT_COMMIT: str | None = None


def git_commit() -> str:
    """``git describe --always --dirty`` of the working directory ("unknown" outside a git checkout)."""
    global _GIT_COMMIT
    try:
        _GIT_COMMIT = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        _GIT_COMMIT = "unknown"
    return _GIT_COMMIT


def __getattr__(name):
    """The per-row checklist moved to :mod:`nhil.report.row_checklist` (kept importable here)."""
    if name in ("CHECKLIST_STEPS", "checklist_markdown", "latest_results", "latest_summary"):
        from nhil.report import row_checklist

        return getattr(row_checklist, name)
    raise AttributeError(name)
