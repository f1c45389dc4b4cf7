"""``make bench``: wall time and peak memory per stage, and ratios to baselines measured in the same run.

Rows per model: export (``torch.export`` of the decode step), compile (raise + lower +
encode), golden generation (PyTorch eager), simulator time per decoded token, and
PyTorch eager time per decoded token (the baseline). Memory is the peak resident set
size above the stage's starting RSS, sampled every 20 ms from ``/proc/self/statm``.
The table is printed and saved as JSON (for trend tracking).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@contextmanager
def measure(out: dict):
    """Record ``seconds`` and ``peak_rss_mb`` (above the starting RSS) of the block into ``out``."""
    start = _rss()
    peak = [start]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _rss())

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out["seconds"] = time.perf_counter() - t0
        stop.set()
        th.join()
        peak[0] = max(peak[0], _rss())
        out["peak_rss_mb"] = (peak[0] - start) / 2**20


def bench_model(name: str, tokens: int) -> dict:
    """Measure one model (see the module docstring); returns a dict of stage -> measurements."""
    import torch

    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.golden.generate import generate_golden
    from nhil.isa import DEVICE_PRESETS
    from nhil.models import get_model
    from nhil.runtime import Runner, run_greedy
    from nhil.targets.sim import SimTarget

    r: dict = {"model": name, "tokens": tokens}
    b = get_model(name)
    ids = b.encode(None)
    L = ((len(ids) + tokens + 15) // 16) * 16
    r["golden"] = {}
    with measure(r["golden"]):
        generate_golden(b, ids, tokens)
    r["export"] = {}
    with measure(r["export"]):
        ep, _ = export_decode(b.model, L)
    r["compile"] = {}
    with measure(r["compile"]):
        prog = lower_decode_graph(raise_graph(ep, "decode").gm, DEVICE_PRESETS["aim-like"], model_name=name)
        blob = prog.encode()
    r["program_bytes"] = len(blob)
    runner = Runner(prog, SimTarget())
    r["sim_load"] = {}
    with measure(r["sim_load"]):
        runner.reset()
    positions = len(ids) + tokens - 1
    r["simulate"] = {}
    with measure(r["simulate"]):
        run_greedy(runner, ids, tokens)
    r["sim_s_per_token"] = r["simulate"]["seconds"] / positions
    # baseline: PyTorch eager, one token per forward with a KV cache, same positions
    model = b.model
    with torch.no_grad():
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        seq = torch.tensor([ids])
        t0 = time.perf_counter()
        nxt = None
        for pos in range(positions):
            tok = seq[:, pos : pos + 1] if pos < len(ids) else nxt
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([pos]))
            nxt = out.logits[:, -1:].argmax(-1)
        r["eager_s_per_token"] = (time.perf_counter() - t0) / positions
    r["sim_vs_eager"] = r["sim_s_per_token"] / r["eager_s_per_token"]
    r["compile_vs_export"] = r["compile"]["seconds"] / r["export"]["seconds"]
    return r


def run_bench(models: list[str], tokens: int, output: Path) -> list[dict]:
    """Benchmark ``models``, print the table, save JSON to ``output`` (atomically)."""
    from rich.console import Console
    from rich.table import Table

    from nhil.util import atomic_write_text

    rows = []
    for m in models:
        print(f"[bench] {m} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(m, tokens))
    t = Table(title=f"nhil bench ({tokens} decoded tokens; ratios against baselines measured in this run)")
    for col in ("model", "stage", "wall s", "peak +RSS MB", "ratio", "baseline"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], "golden (eager fp32)", f"{r['golden']['seconds']:.2f}", f"{r['golden']['peak_rss_mb']:.0f}", "", "")
        t.add_row("", "torch.export decode", f"{r['export']['seconds']:.2f}", f"{r['export']['peak_rss_mb']:.0f}", "1.00", "export")
        t.add_row("", "compile (raise+lower+encode)", f"{r['compile']['seconds']:.2f}", f"{r['compile']['peak_rss_mb']:.0f}", f"{r['compile_vs_export']:.2f}", "x export")
        t.add_row("", "sim load (bank images)", f"{r['sim_load']['seconds']:.2f}", f"{r['sim_load']['peak_rss_mb']:.0f}", "", "")
        t.add_row("", "simulate per token", f"{r['sim_s_per_token']:.3f}", f"{r['simulate']['peak_rss_mb']:.0f}", f"{r['sim_vs_eager']:.1f}", "x eager per token")
        t.add_row("", "eager per token (baseline)", f"{r['eager_s_per_token']:.4f}", "", "1.00", "")
    Console(width=140).print(t)
    atomic_write_text(output, json.dumps(rows, indent=2))
    print(f"[bench] saved {output}", file=sys.stderr)
    return rows
