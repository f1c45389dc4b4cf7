"""``make bench``: wall time and peak memory per stage, and ratios to baselines measured in the same run.

Rows per model: export (``torch.export`` of the decode step), compile (raise + lower +
encode), golden generation (PyTorch eager), simulator time per decoded token, and
PyTorch eager time per decoded token (the baseline). Memory is the peak resident set
size above the stage's starting RSS, sampled every 20 ms from ``/proc/self/statm``.
The table is printed and saved as JSON (for trend tracking).

Performance rows (``nhil.timing``, ``docs/timing-model.md``): for each real model and
each shape-only config (``nhil.compiler.shape_only.CONFIGS``): modelled cycles and
tokens/s per decode step, GEMV bandwidth achieved / timing-bound best / device peak, the
rooflines (PIM peak, external-bandwidth-bound, GPU-HBM-bound with ``--gpu-gbs``) and
the speed-ups, each before/after the program-stage scheduling passes, for a reordering
controller and an in-order sequencer; plus the simulator's time with the timing model on
vs off; ``verify`` of SmolLM2 cold vs warm with the warm run's stages (``nhil.verify.bench``); the host share of SmolLM2's step before/after the opt-in host passes
(``nhil.timing.host_share``: host-overlap, ew-swiglu, ew-residual). The pass ablation
(``nhil.timing.ablation``: naive baseline, each pass added, each removed; `llama` as the shape-only ``smollm2-135m`` config and ``llama3-8b``) and the
device-parameter study print as a second table.

Other targets add rows through :data:`ROW_PROVIDERS`: callables
``provider(result: dict) -> list[tuple[str, str, str, str, str]]`` (stage, value,
ratio, baseline, note) called once per model result; RTL/FPGA timing rows go there.

Nightly matrix rows (``nhil bench --matrix``, :func:`bench_matrix`): wall time of the
matrix (``tests/test_matrix.py`` as ``make nightly`` runs it, default: the non-nightly
rows) with 1 and with 2 pytest-xdist workers, and their ratio.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from nhil.targets.sim.bench import prefill_rows, reference_speed, sim_rows
from nhil.verify.bench import verify_rows
from nhil.bench_matrix import bench_matrix, matrix_table_rows
from nhil.timing.batch import batch_rich_table, bench_batch

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


ROW_PROVIDERS: list = []  # hooks: provider(result) -> rows (stage, value, ratio, baseline, note)


def _rtl_rows(r: dict) -> list:
    """RTL build (cold/cached), cycles/s, MACs/s and time per token vs the simulator, once (on llama-tiny)."""
    if r.get("model") != "llama-tiny" or "rtl" not in os.environ.get("NHIL_BENCH_TARGETS", "rtl,fpga"):
        return []
    from nhil.errors import NhilError
    from nhil.targets.rtl.bench import as_table_rows, rtl_bench_rows

    try:
        return [(st, val, ratio, f"{base} {note}".strip()) for st, val, ratio, base, note in as_table_rows(rtl_bench_rows())]
    except NhilError as e:
        return [("rtl", "unavailable", "", str(e)[:80])]


def _fpga_rows(r: dict) -> list:
    """Serial-link efficiency, throughput over a pty vs raw pty writes measured in the same call, and goodput under 1% byte faults, once."""
    if r.get("model") != "llama-tiny" or "fpga" not in os.environ.get("NHIL_BENCH_TARGETS", "rtl,fpga"):
        return []
    from nhil.targets.fpga.bench import bench_rows

    return bench_rows()


from nhil.targets.rtl.bench import format_rows_provider  # noqa: E402  (RTL rows per weight-format family)

ROW_PROVIDERS += [_rtl_rows, _fpga_rows, format_rows_provider, sim_rows, prefill_rows, verify_rows]
SHAPE_CONFIGS = ["llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "mamba2-1.3b"]  # mamba2: nhil.compiler.shape_recurrent


def _before_passes() -> tuple[str, ...]:
    from nhil.compiler.schedule import PASS_INFO, PIPELINE

    return tuple(n for n in PIPELINE if PASS_INFO[n].stage != "program")


def perf_rows(prog, gpu_gbs: float) -> dict:
    """Timing reports of ``prog`` (compiled without the program-stage passes, :func:`_before_passes`) before/after
    the program-stage scheduling passes (after = the default pipeline's program), reordering and in-order controller."""
    from nhil.compiler.pipeline import PassManager
    from nhil.timing.report import analyze

    after = PassManager().run(prog)
    out = {}
    for ctl, inorder in (("reordering", False), ("in-order", True)):
        t0 = time.perf_counter()
        out[ctl] = {"before": analyze(prog, gpu_gbs=gpu_gbs, inorder=inorder), "after": analyze(after, gpu_gbs=gpu_gbs, inorder=inorder)}
        out[ctl]["seconds"] = time.perf_counter() - t0
    return out


def bench_shape_only(name: str, gpu_gbs: float) -> dict:
    """Shape-only compile of a large config (``pipeline.compile_shapes``) + its timing report."""
    from nhil.compiler import pipeline

    r: dict = {"model": name, "shape_only": True}
    r["compile"] = {}
    with measure(r["compile"]):
        prog = pipeline.compile_shapes(name, passes=_before_passes(), max_cache_len=128)
    r["device"] = prog.device.name
    r["perf"] = perf_rows(prog, gpu_gbs)
    return r


def bench_model(name: str, tokens: int, gpu_gbs: float = 3350.0) -> dict:
    """Measure one model (see the module docstring); returns a dict of stage -> measurements."""
    import torch

    from nhil.compiler import pipeline
    from nhil.golden.generate import generate_golden
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
    stages: dict = {}
    c = pipeline.compile(b, "aim-like", passes=_before_passes(), max_cache_len=L, model_name=name,
                         stage=lambda st: measure(stages.setdefault(st, {})))
    before = c.program
    r["export"] = stages["export"]
    enc: dict = {}
    with measure(enc):
        prog = pipeline.PassManager().run(before)  # the default pipeline's program (what verify runs)
        blob = prog.encode()
    parts = [stages["raise"], stages["lower"], enc]
    r["compile"] = {"seconds": sum(p["seconds"] for p in parts), "peak_rss_mb": max(p["peak_rss_mb"] for p in parts)}
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
    runner.reset()  # the same greedy run again: binding plans and GEMV-run tables built, kernels loaded
    r["simulate_warm"] = {}
    with measure(r["simulate_warm"]):
        run_greedy(runner, ids, tokens)
    r["sim_warm_s_per_token"] = r["simulate_warm"]["seconds"] / positions
    r["kernel_threads"] = threads = getattr(runner.t.state, "kernel_threads", 1)
    if threads > 1:  # the same warm run with the GEMV kernel on one thread (the bits are the same)
        runner.t.state.kernel_threads = 1  # (reset restores the bank state in place: the count stays)
        t0 = time.perf_counter()
        run_greedy(runner, ids, tokens)
        r["sim_warm_1thread_s_per_token"] = (time.perf_counter() - t0) / positions
        runner.t.state.kernel_threads = threads
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
    r["sim_reference"] = reference_speed(prog, ids, tokens)  # the pre-#17 per-instruction path, same run (nhil.targets.sim.bench)
    r["compile_vs_export"] = r["compile"]["seconds"] / r["export"]["seconds"]
    # the same run with the timing model on (off by default)
    from nhil.targets.sim.timing import TimedSimTarget

    tr = Runner(prog, TimedSimTarget())
    tr.reset()
    r["simulate_timed"] = {}
    with measure(r["simulate_timed"]):
        run_greedy(tr, ids, tokens)
    tm = tr.t.stats()["timing"]
    # the cost is the time spent inside the timing model (wall-clock differences between
    # two simulator runs are dominated by machine noise here)
    r["timing_overhead"] = tm["engine_seconds"] / r["simulate"]["seconds"]
    r["timing_overhead_wall"] = r["simulate_timed"]["seconds"] / r["simulate"]["seconds"] - 1.0
    r["sim_timing"] = {k: tm[k] for k in ("step_cycles", "timed_steps", "engine_seconds")}
    r["perf"] = perf_rows(before, gpu_gbs)
    return r


def _perf_table_rows(t, r) -> None:
    for ctl, pr in r["perf"].items():
        b, a = pr["before"], pr["after"]
        g0, g1 = b["gemv"], a["gemv"]
        rf = a["roofline"]
        tag = f"({ctl})"
        t.add_row("", f"{tag} cycles / token (passes: before -> after)", f"{b['cycles_per_token']:,} -> {a['cycles_per_token']:,}", f"{b['cycles_per_token'] / a['cycles_per_token']:.3f}", "x speed-up of the passes")
        t.add_row("", f"{tag} modelled decode tokens/s", f"{b['tokens_per_s']:,.0f} -> {a['tokens_per_s']:,.0f}", f"{a['tokens_per_s'] / rf['pim_row_bound_tokens_per_s']:.2f}", f"of table-bound {rf['pim_row_bound_tokens_per_s']:,.0f} tok/s")
        t.add_row("", f"{tag} GEMV bandwidth achieved GB/s", f"{g0['achieved_gbs']:,.0f} -> {g1['achieved_gbs']:,.0f}", f"{g1['achieved_of_best']:.3f}", f"of best {g1['best_gbs']:,.0f} (= {g1['best_of_peak']:.3f} of peak {g1['peak_gbs']:,.0f})")
        t.add_row("", f"{tag} GEMV achieved / device peak", f"{g0['achieved_of_peak']:.3f} -> {g1['achieved_of_peak']:.3f}", "", "peak internal bandwidth")
        t.add_row("", f"{tag} host + SYNC share of the step", f"{b['host_and_sync_fraction']:.3f} -> {a['host_and_sync_fraction']:.3f}", "", "")
    a = r["perf"]["reordering"]["after"]
    rf = a["roofline"]
    t.add_row("", "roofline: PIM peak internal", f"{rf['pim_peak_tokens_per_s']:,.0f} tok/s", "", f"{a['step_bytes'] / 1e9:.3f} GB read per token")
    t.add_row("", "baseline: external-bandwidth-bound", f"{rf['external_bound_tokens_per_s']:,.1f} tok/s", f"{rf['speedup_vs_external']:.1f}", f"x PIM speed-up ({rf['external_gbs']:,.0f} GB/s pins)")
    t.add_row("", "baseline: GPU HBM-bound", f"{rf['gpu_bound_tokens_per_s']:,.1f} tok/s", f"{rf['speedup_vs_gpu']:.2f}", f"x PIM speed-up ({rf['gpu_hbm_gbs']:,.0f} GB/s HBM)")


def _ablation_table(ab: list[dict], study: dict | None):
    """The pass-ablation table (baseline, passes added cumulatively, each removed) and the device-parameter study."""
    from rich.table import Table

    t = Table(title="scheduling passes: modelled decode step per variant (shape-only, aim-like, docs/timing-model.md); GEMV bandwidths side by side")
    for col in ("config", "variant", "cycles/token", "tokens/s", "achieved GB/s", "peak GB/s", "best GB/s", "of peak", "of best", "host+SYNC"):
        t.add_column(col)
    for a in ab:
        for i, r in enumerate(a["rows"]):
            how = "" if r.get("how", "measured") == "measured" else f" - {r['how']}"
            t.add_row(a["config"] if i == 0 else "", r["variant"] + how, f"{r['cycles_per_token']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['achieved_gbs']:,.0f}", f"{r['peak_gbs']:,.0f}",
                      f"{r['best_gbs']:,.0f}", f"{r['achieved_of_peak']:.3f}", f"{r['achieved_of_best']:.3f}", f"{r['host_and_sync_fraction']:.3f}")
        if a.get("extrapolation_error") is not None:
            t.add_row("", "(check: full pipeline extrapolated from 1, 2 layers vs measured)", f"{a['extrapolation_error']:+.4%}", "", "", "", "", "", "", "")
    if study:
        for i, r in enumerate(study["rows"]):
            t.add_row(f"{study['config']} device" if i == 0 else "", f"{r['variant']} - {r['how']}", f"{r['cycles_per_token']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['achieved_gbs']:,.0f}", f"{r['peak_gbs']:,.0f}",
                      f"{r['best_gbs']:,.0f}", f"bound {r['row_bound']:.3f}", f"{r['achieved_of_best']:.3f}", f"x{r['gain']:.2f} tok/s")
    return t


def run_bench(models: list[str], tokens: int, output: Path, gpu_gbs: float = 3350.0, configs: list[str] | None = None, ablation: list[str] | None = None,
              matrix: dict | None = None) -> list[dict]:
    """Benchmark ``models``, shape-only ``configs`` and the pass ``ablation`` configs; print the tables, save JSON to ``output`` (atomically).

    ``ablation`` defaults to :data:`nhil.timing.ablation.ABLATION_CONFIGS`; when it holds
    ``llama3-8b`` the device-parameter study runs too. JSON: one entry per model/config,
    then ``{"ablation": ...}`` entries and a ``{"device_study": ...}`` entry.
    ``matrix``: keyword arguments of :func:`bench_matrix` to also time the nightly matrix
    with 1 and 2 workers (its result is the JSON entry with ``"model": "nightly-matrix"``);
    None skips it.
    """
    from rich.console import Console
    from rich.table import Table

    from nhil.timing.ablation import ABLATION_CONFIGS, device_study
    from nhil.timing.ablation import ablation as run_ablation
    from nhil.util import atomic_write_text

    configs = SHAPE_CONFIGS if configs is None else configs
    ablation = list(ABLATION_CONFIGS) if ablation is None else ablation
    rows = []
    for m in models:
        print(f"[bench] {m} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(m, tokens, gpu_gbs))
    for c in configs:
        print(f"[bench] {c} (shape-only) ...", file=sys.stderr, flush=True)
        rows.append(bench_shape_only(c, gpu_gbs))
    ab = []
    for c in ablation:
        print(f"[bench] {c} pass ablation (shape-only) ...", file=sys.stderr, flush=True)
        ab.append(run_ablation(c, gpu_gbs=gpu_gbs))
    study = None
    if "llama3-8b" in ablation:
        print("[bench] llama3-8b device-parameter study ...", file=sys.stderr, flush=True)
        study = device_study("llama3-8b", gpu_gbs=gpu_gbs)
    print("[bench] batched decode (timing model) ...", file=sys.stderr, flush=True)
    batch = bench_batch(gpu_gbs=gpu_gbs)  # issue 17 item 5: nhil.timing.batch
    print("[bench] modelled prefill (timing model) ...", file=sys.stderr, flush=True)
    from nhil.timing.prefill import bench_prefill, prefill_rich_table

    prefill = bench_prefill(gpu_gbs=gpu_gbs)  # issue 17 item 2
    print("[bench] smollm2-135m host share, before/after the opt-in host passes ...", file=sys.stderr, flush=True)
    from nhil.timing.host_share import BENCH_CACHE_LENS, host_share_study, host_share_table_rows

    hshare = [host_share_study(max_cache_len=L, gpu_gbs=gpu_gbs, breakdown=L == BENCH_CACHE_LENS[0]) for L in BENCH_CACHE_LENS]  # issue 17 item 4
    from nhil.compiler.schedule import PIPELINE

    t = Table(title=f"nhil bench ({tokens} decoded tokens; every figure beside its baseline from this run; passes: {', '.join(PIPELINE)})")
    for col in ("model", "stage", "value", "ratio", "baseline / note"):
        t.add_column(col)
    for r in rows:
        if r.get("shape_only"):
            t.add_row(r["model"], f"shape-only compile ({r['device']})", f"{r['compile']['seconds']:.2f} s", "", f"+{r['compile']['peak_rss_mb']:.0f} MB RSS")
        else:
            t.add_row(r["model"], "golden (eager fp32)", f"{r['golden']['seconds']:.2f} s", "", "")
            t.add_row("", "torch.export decode", f"{r['export']['seconds']:.2f} s", "1.00", "export")
            t.add_row("", "compile (raise+lower+encode)", f"{r['compile']['seconds']:.2f} s", f"{r['compile_vs_export']:.2f}", "x export")
            t.add_row("", "sim load (bank images)", f"{r['sim_load']['seconds']:.2f} s", "", f"+{r['sim_load']['peak_rss_mb']:.0f} MB RSS")
            t.add_row("", "simulate per token", f"{r['sim_s_per_token']:.3f} s", f"{r['sim_vs_eager']:.1f}", f"x eager per token ({r['eager_s_per_token']:.4f} s); first greedy run of a new runner")
            t.add_row("", "simulate per token, warm", f"{r['sim_warm_s_per_token']:.3f} s", f"{r['sim_warm_s_per_token'] / r['eager_s_per_token']:.1f}",
                      f"x eager per token (goal <= 2.0); the same greedy run again after a reset (plans built); GEMV kernel on {r['kernel_threads']} thread(s)")
            if "sim_warm_1thread_s_per_token" in r:
                t.add_row("", "simulate per token, warm, 1 kernel thread", f"{r['sim_warm_1thread_s_per_token']:.3f} s",
                          f"{r['sim_warm_1thread_s_per_token'] / r['eager_s_per_token']:.1f}", "x eager per token; NHIL_SIM_THREADS=1 (what a pytest-xdist worker runs)")
            t.add_row("", "timing model on: time in the model", f"{r['sim_timing']['engine_seconds']:.2f} s", f"{r['timing_overhead']:.1%}", f"of simulate, timing off ({r['simulate']['seconds']:.2f} s; wall diff {r['timing_overhead_wall']:+.0%})")
        _perf_table_rows(t, r)
        for prov in ROW_PROVIDERS:
            for row in prov(r):
                t.add_row("", *row)
    for hs in hshare:
        t.add_row(f"{hs['config']} (shape-only)", "", "", "", "")
        for row in host_share_table_rows(hs):
            t.add_row("", *row)
    if matrix is not None:
        matrix = dict(matrix)
        engine = matrix.pop("engine", "xdist")  # xdist | ray | both (nhil/cluster/bench.py)
        if engine in ("xdist", "both"):
            m = bench_matrix(**matrix)
            t.add_row("nightly-matrix", "", "", "", "")
            matrix_table_rows(t, m)
            rows.append({"model": "nightly-matrix", "matrix": m})
        if engine in ("ray", "both"):
            from nhil.cluster.bench import ray_matrix_bench

            rm = ray_matrix_bench(matrix.get("workers", (1, 2)), matrix.get("rows", "default"), matrix.get("sweep_root"))
            t.add_row("ray-matrix", "", "", "", "")
            matrix_table_rows(t, rm)
            rows.append({"model": "ray-matrix", "matrix": rm})
    Console(width=160).print(t)
    if ab or study:
        Console(width=180).print(_ablation_table(ab, study))
    Console(width=180).print(batch_rich_table(batch))
    Console(width=180).print(prefill_rich_table(prefill))
    out = rows + [{"ablation": a} for a in ab] + ([{"device_study": study}] if study else []) + [{"batch": batch}, {"prefill": prefill}, {"host_share": hshare}]
    atomic_write_text(output, json.dumps(out, indent=2, default=float))
    print(f"[bench] saved {output}", file=sys.stderr)
    return rows
