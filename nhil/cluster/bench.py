"""Bench row: the manifest's rows as a Ray sweep with 1 and with 2 workers (``nhil bench
--matrix --matrix-engine ray``), beside the pytest-xdist matrix of :func:`nhil.bench_matrix.bench_matrix`.

Each count starts its own local Ray instance (``--ray auto`` with ``num_cpus`` = workers,
so at most that many rows run at once) and stops it; the wall time is the sweep folder's
``summary.json`` ``wall_s`` (first submission to last row end, Ray start-up excluded).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def ray_matrix_bench(workers: tuple[int, ...] = (1, 2), rows: str = "default", sweep_root: Path | None = None, timeout_s: float = 3600) -> dict:
    """Wall time of the selected manifest rows as a Ray sweep per worker count.

    Returns:
        the layout of :func:`nhil.bench_matrix.bench_matrix` (``rows``, ``runs`` with ``workers``,
        ``wall_s``, ``process_s``, ``rows_done``, ``rows_total``, ``outcomes``, ``dir``,
        load averages, ``cpus``; ``speedup`` = wall_s of the first count / of the last)
        plus ``"engine": "ray"``.

    Raises:
        SetupError: Ray is not installed.
    """
    import json

    from nhil import expectations
    from nhil.cluster.ray_sweep import ray_sweep
    from nhil.sweep import select_rows

    chosen = select_rows(expectations.load(), rows)
    root = Path(sweep_root or os.environ.get("NHIL_SWEEP_ROOT", "runs/sweeps"))
    out: dict = {"engine": "ray", "rows": rows, "runs": []}
    for w in workers:
        print(f"[bench] ray matrix ({rows} rows, {len(chosen)}) with {w} worker(s) ...", file=sys.stderr, flush=True)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        folder, results = ray_sweep(chosen, 0, root, timeout_s=timeout_s, address="auto", local_cpus=w)
        summ = json.loads((folder / "summary.json").read_text())
        out["runs"].append({"workers": w, "wall_s": summ.get("wall_s"), "process_s": round(time.perf_counter() - t0, 2), "rows_done": summ.get("rows_done"),
                            "rows_total": summ.get("rows_total"), "outcomes": summ.get("outcomes"), "dir": str(folder), "returncode": 0 if all(r.get("as_expected") for r in results) else 1,
                            "loadavg_1m_before": round(load0, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()})
    if len(out["runs"]) >= 2 and out["runs"][-1]["wall_s"]:
        out["speedup"] = out["runs"][0]["wall_s"] / out["runs"][-1]["wall_s"]
    return out
