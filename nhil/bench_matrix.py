"""``nhil bench --matrix``: wall time of the nightly matrix with 1 and with 2 pytest-xdist workers, and their ratio.

:func:`bench_matrix` runs ``tests/test_matrix.py`` as ``make nightly`` does, once per worker
count; :func:`matrix_table_rows` renders a result (also the Ray sweep's,
``nhil.cluster.bench``) as rows of the bench table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def bench_matrix(workers: tuple[int, ...] = (1, 2), rows: str = "default", sweep_root: Path | None = None, python: str = sys.executable) -> dict:
    """Wall time of the nightly matrix (``tests/test_matrix.py``, as ``make nightly`` runs it)
    with each worker count of ``workers`` (pytest-xdist ``-n``), one after another.

    Args:
        workers: xdist worker counts to time, in order.
        rows: ``NHIL_MATRIX_ROWS`` (``default``: the non-nightly rows of expectations.yaml,
            the representative subset; ``all`` is the full nightly, 30+ min per count).
        sweep_root: ``NHIL_SWEEP_ROOT`` for the runs' aggregated reports (default
            ``runs/sweeps``; ``latest`` then points at the last run).
        python: interpreter with pytest and pytest-xdist.

    Returns:
        ``{"rows": rows, "runs": [{"workers", "wall_s" (first row start to last row end, from
        the run's summary.json), "process_s" (the whole pytest process, start-up and
        collection included), "rows_done", "outcomes", "dir", "returncode", "loadavg_1m_before",
        "loadavg_1m_after", "cpus" (a shared machine's load skews both)}], "speedup"
        (wall_s of the first count / wall_s of the last)}``. Caches count: goldens and RTL
        builds made by an earlier run are reused, so time after one warm-up sweep
        (``nhil sweep``) for a fair comparison.

    Raises:
        SetupError: pytest-xdist missing, or a run wrote no aggregated report.
    """
    import subprocess

    from nhil.errors import SetupError

    try:
        import xdist  # noqa: F401
    except ImportError:
        raise SetupError("bench --matrix needs pytest-xdist: pip install -e '.[test]'") from None
    root = Path(sweep_root or os.environ.get("NHIL_SWEEP_ROOT", "runs/sweeps"))
    test = Path(__file__).resolve().parent.parent / "tests" / "test_matrix.py"
    out: dict = {"rows": rows, "runs": []}
    for w in workers:
        print(f"[bench] nightly matrix ({rows} rows) with {w} worker(s) ...", file=sys.stderr, flush=True)
        env = dict(os.environ, NHIL_MATRIX_ROWS=rows, NHIL_SWEEP_ROOT=str(root))
        cmd = [python, "-m", "pytest", "-n", str(w), "-q", "-m", "nightly", "-o", "addopts=", "-p", "no:cacheprovider", str(test)]
        before = (root / "latest").resolve() if (root / "latest").exists() else None
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        process_s = time.perf_counter() - t0
        latest = (root / "latest").resolve() if (root / "latest").exists() else None
        if latest is None or latest == before or not (latest / "summary.json").exists():
            raise SetupError(f"nightly matrix with {w} worker(s) wrote no aggregated report under {root}: {(proc.stdout + proc.stderr)[-800:]}")
        summ = json.loads((latest / "summary.json").read_text())
        out["runs"].append({"workers": w, "wall_s": summ.get("wall_s"), "process_s": round(process_s, 2), "rows_done": summ.get("rows_done"),
                            "rows_total": summ.get("rows_total"), "outcomes": summ.get("outcomes"), "dir": str(latest), "returncode": proc.returncode,
                            "loadavg_1m_before": round(load0, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()})
    if len(out["runs"]) >= 2 and out["runs"][-1]["wall_s"]:
        out["speedup"] = out["runs"][0]["wall_s"] / out["runs"][-1]["wall_s"]
    return out


def matrix_table_rows(t, m: dict) -> None:
    """Add the rows of a :func:`bench_matrix` (or Ray sweep) result ``m`` to the rich table ``t``."""
    base = m["runs"][0]
    for r in m["runs"]:
        ratio = f"{r['wall_s'] / base['wall_s']:.2f}" if base.get("wall_s") else ""
        outs = ", ".join(f"{k} {v}" for k, v in (r.get("outcomes") or {}).items())
        name, proc = ("ray sweep", "driver process") if m.get("engine") == "ray" else ("nightly matrix", "pytest process")
        t.add_row("", f"{name} ({m['rows']} rows), {r['workers']} worker(s)", f"{r['wall_s']:.1f} s", ratio,
                  f"x {base['workers']} worker(s); {r['rows_done']}/{r['rows_total']} rows ({outs}); {proc} {r['process_s']:.1f} s; "
                  f"load {r['loadavg_1m_before']:.1f} on {r['cpus']} CPUs")
    if "speedup" in m:
        t.add_row("", ("ray sweep" if m.get("engine") == "ray" else "nightly matrix") + " speed-up", f"{m['speedup']:.2f}", "", f"{m['runs'][0]['workers']} vs {m['runs'][-1]['workers']} workers (wall time ratio)")
