"""``nhil landscape``: every causal-LM architecture of the installed transformers, one process each.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (or the ``only`` subset)
the runner starts ``python -m nhil.landscape.row MODEL_TYPE WORKDIR/rows/MODEL_TYPE`` with a
timeout (a row past it is TIMEOUT and its process group is killed), ``jobs`` at a time,
printing one progress line per finished row. A row whose ``row.json`` already exists is
reused (resume); ``rerun=True`` measures it again. When all rows are in, the table, totals
and ranked blockers are written to ``<output>.md`` and ``<output>.json``
(:mod:`nhil.landscape.report`, temp file then rename).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from nhil.errors import SetupError
from nhil.util import atomic_write_text

__all__ = ["run_landscape", "DEFAULT_SUBSET", "SUBSET_PASS", "ROW_TIMEOUT_S"]

ROW_TIMEOUT_S = 600.0
# the default-test subset (tests/test_landscape.py): PASS rows of each kind (Llama, GPT-2, Gemma 2, MoE with sinks;
# raised by the attention anchors with host-ATen RoPE variants: GPT-J, Cohere, Phi; host-ATen activations and scalar
# multipliers: Arcee, Granite; MoE on host-ATen routing: GraniteMoE; positions handed in at export: OPT, and the
# BERT-family decoders; ALiBi through baddbmm: BLOOM) and one row per failure bucket as measured by
# the full run (docs/landscape.md)
DEFAULT_SUBSET = ("llama", "gpt2", "gemma2", "gpt_oss", "gptj", "cohere", "phi", "arcee", "granite", "granitemoe",
                  "opt", "bert", "bloom", "diffllama", "ctrl", "hrm_text", "dbrx")
SUBSET_PASS = ("llama", "gpt2", "gemma2", "gpt_oss", "gptj", "cohere", "phi", "arcee", "granite", "granitemoe", "opt", "bert", "bloom")


def _row(arch: str, rows_dir: Path, timeout_s: float, rerun: bool) -> dict:
    wd = rows_dir / arch
    out = wd / "row.json"
    if out.exists() and not rerun:
        try:
            row = json.loads(out.read_text())
            row["resumed"] = True
            return row
        except (OSError, json.JSONDecodeError):
            pass  # a torn file from an interrupted run: measure again
    wd.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(wd / "log.txt", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "nhil.landscape.row", arch, str(wd)], stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            row = {"arch": arch, "bucket": "TIMEOUT", "error": f"no verdict within {timeout_s:.0f} s (log: {wd / 'log.txt'})",
                   "seconds": round(time.perf_counter() - t0, 1)}
            atomic_write_text(out, json.dumps(row, indent=1))
            return row
    if not out.exists():
        tail = (wd / "log.txt").read_text(errors="replace")[-800:]
        row = {"arch": arch, "bucket": "CRASH", "error": f"row process exited with {p.returncode} and no row.json; log tail: {tail}",
               "seconds": round(time.perf_counter() - t0, 1)}
        atomic_write_text(out, json.dumps(row, indent=1))
        return row
    return json.loads(out.read_text())


def run_landscape(only: list[str] | None = None, jobs: int = 1, timeout_s: float = ROW_TIMEOUT_S, workdir: Path = Path("runs/landscape"),
                  output: Path | None = Path("docs/landscape"), rerun: bool = False, progress=print) -> dict:
    """Measure the landscape; returns the summary dict written to ``<output>.json``.

    Args:
        only: model types to run (default: every causal-LM architecture).
        jobs: rows in parallel (each its own process).
        timeout_s: seconds per row before it is TIMEOUT.
        workdir: per-row folders (``rows/<arch>/row.json``, ``log.txt``, run folders, goldens).
        output: ``<output>.md`` / ``.json`` paths stem; ``None`` writes nothing.
        rerun: measure rows that already have a ``row.json``.

    Raises:
        SetupError: ``only`` names a model type that has no causal-LM class, or jobs < 1.
    """
    from nhil.landscape.report import summarize, write_report
    from nhil.landscape.tiny_config import causal_lm_architectures

    archs = list(causal_lm_architectures())
    if only:
        unknown = [a for a in only if a not in archs]
        if unknown:
            raise SetupError(f"--only: {', '.join(unknown)} not causal-LM model types of the installed transformers "
                             f"(e.g. {', '.join(archs[:5])}; all: python -c 'from nhil.landscape.tiny_config import causal_lm_architectures as c; print(*c())')")
        archs = [a for a in archs if a in set(only)]
    if jobs < 1:
        raise SetupError(f"--jobs must be >= 1, got {jobs}")
    rows_dir = Path(workdir) / "rows"
    rows: list[dict] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(_row, a, rows_dir, timeout_s, rerun): a for a in archs}
        for i, f in enumerate(as_completed(futs), 1):
            row = f.result()
            rows.append(row)
            tag = " (resumed)" if row.get("resumed") else f" {row.get('seconds', 0):.0f} s"
            why = f": {row['error'][:110]}" if row.get("error") and row["bucket"] != "PASS" else ""
            progress(f"[{i}/{len(archs)}] {row['arch']:28s} {row['bucket']}{tag}{why}")
    rows.sort(key=lambda r: r["arch"])
    summary = summarize(rows, wall_s=time.perf_counter() - t0, subset=only)
    if output is not None:
        write_report(summary, Path(output))
    return summary
