"""Bench rows of ``verify`` itself: wall time cold vs warm, and the warm run's stage breakdown (issue 17 item 3).

``verify_speed`` runs ``nhil verify`` twice as a user runs it (a fresh process each time,
``make verify``'s command line) against empty caches (``NHIL_CACHE_DIR`` set to a
temporary folder): the first run loads the GGUF and stores the loaded model
(``nhil.models.load_cache``), compiles and stores the program and its device-numerics
reference; the second finds all three in the cache and skips the GGUF parse, export, raise,
lower, encode and the reference. Wall time includes interpreter start-up and imports.
The stage seconds come from each run's ``report.json`` ``timings``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def verify_speed(model: str = "llama", target: str = "sim") -> dict:
    """Wall time of a cold and a warm ``nhil verify --model model --target target`` on a fresh program cache.

    Returns:
        ``{"model", "target", "cold": {"wall_s", "outcome", "timings"}, "warm": {...}}``; seconds.
    Raises:
        RuntimeError: a run did not write its report (names the run and its stderr tail).
    """
    out: dict = {"model": model, "target": target}
    with tempfile.TemporaryDirectory(prefix="nhil-bench-verify-") as tmp:
        env = dict(os.environ, NHIL_CACHE_DIR=str(Path(tmp) / "cache"), NHIL_CACHE="1")
        for run in ("cold", "warm"):
            runs = Path(tmp) / f"runs-{run}"
            cmd = [sys.executable, "-c", "import sys; from nhil.cli import app; sys.argv[0] = 'nhil'; sys.exit(app())",
                   "verify", "--model", model, "--target", target, "--runs-dir", str(runs)]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            reports = sorted(runs.glob("*/report.json"))
            if not reports:
                raise RuntimeError(f"bench verify ({run}) wrote no report; exit {p.returncode}; stderr: {p.stderr[-800:]}")
            rep = json.loads(reports[-1].read_text())
            out[run] = {"wall_s": wall, "outcome": rep.get("outcome"), "timings": rep.get("timings", {}),
                        "cache_hit": bool((rep.get("program_cache") or {}).get("hit")), "model_cache_hit": bool((rep.get("model_cache") or {}).get("hit"))}
    return out


def verify_rows(r: dict) -> list[tuple[str, str, str, str]]:
    """Bench rows of :func:`verify_speed`, once (on the ``llama`` model result); ``NHIL_BENCH_VERIFY=0`` skips them."""
    if r.get("model") != "llama" or os.environ.get("NHIL_BENCH_VERIFY", "1") == "0":
        return []
    v = r["verify"] = verify_speed("llama", "sim")
    cold, warm = v["cold"], v["warm"]
    stages = ", ".join(f"{k} {s:.1f}" for k, s in sorted(warm["timings"].items(), key=lambda kv: -kv[1]) if s >= 0.05)
    return [
        ("verify llama sim, cold (empty program cache)", f"{cold['wall_s']:.1f} s", "1.00", f"{cold['outcome']}; wall time of the process"),
        ("verify llama sim, warm (second run)", f"{warm['wall_s']:.1f} s", f"{warm['wall_s'] / cold['wall_s']:.2f}",
         f"x cold (goal <= 45 s); {warm['outcome']}; program cache hit: {warm['cache_hit']}, model cache hit: {warm['model_cache_hit']}; stages (s): {stages}"),
    ]
