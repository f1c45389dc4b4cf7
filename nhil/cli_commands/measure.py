"""``nhil bench``, ``nhil quant-report``, ``nhil landscape``: benchmarks, quantization accuracy, architecture landscape."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from nhil.cli_commands.common import _fail
from nhil.errors import NhilError


def bench(models_: str = typer.Option("llama-tiny,llama", "--models"), tokens: int = typer.Option(8), output: Path = typer.Option(Path("runs/bench.json")),
          configs: str = typer.Option("llama3-8b,mixtral-8x7b,qwen3-30b-a3b", "--configs", help="shape-only configs timed on the device model"),
          gpu_gbs: float = typer.Option(3350.0, "--gpu-gbs", help="GPU HBM bandwidth of the roofline baseline, GB/s"),
          ablation: str = typer.Option("smollm2-135m,llama3-8b", "--ablation", help="shape-only configs for the scheduling-pass ablation (llama3-8b adds the device-parameter study)"),
          matrix: bool = typer.Option(False, "--matrix", help="also time the nightly matrix with 1 and 2 pytest-xdist workers (minutes)"),
          matrix_rows: str = typer.Option("default", "--matrix-rows", help="NHIL_MATRIX_ROWS: default (non-nightly rows), all, or row ids"),
          matrix_workers: str = typer.Option("1,2", "--matrix-workers", help="worker counts to time, in order"),
          matrix_engine: str = typer.Option("xdist", "--matrix-engine", help="xdist (pytest-xdist, as make nightly), ray (local Ray instance per count) or both")) -> None:
    """Benchmark table: wall time vs export/eager, modelled tokens/s and bandwidth vs peak and rooflines, pass ablation."""
    try:
        from nhil.bench import run_bench

        mx = {"rows": matrix_rows, "workers": tuple(int(w) for w in matrix_workers.split(",") if w.strip()), "engine": matrix_engine} if matrix else None
        run_bench([m.strip() for m in models_.split(",") if m.strip()], tokens, output, gpu_gbs=gpu_gbs, configs=[c.strip() for c in configs.split(",") if c.strip()],
                  ablation=[c.strip() for c in ablation.split(",") if c.strip()], matrix=mx)
    except NhilError as e:
        _fail(e)


def quant_report(
    model: str = typer.Option("llama", "--model", "-m"),
    recipes: str = typer.Option("", help="comma-separated recipes (default: all of nhil.compiler.quantize.RECIPES)"),
    tokens: int = typer.Option(16, help="greedy tokens per prompt"),
    output: Path = typer.Option(Path("docs/quant-report"), "--output", "-o", help="writes <output>.md and <output>.json"),
    sim: bool = typer.Option(True, "--sim/--no-sim", help="run the simulator (--no-sim: refresh only the reference columns of an existing report)"),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="also measure the format-only (fake-quant) PyTorch reference"),
) -> None:
    """Accuracy and footprint of every quantization recipe against the fp32 golden (slow on the real llama)."""
    try:
        from nhil.quant_report import run_quant_report

        run_quant_report(model, [r for r in recipes.split(",") if r] or None, tokens, output, sim=sim, reference=reference)
    except NhilError as e:
        _fail(e)


def landscape(
    only: Optional[str] = typer.Option(None, "--only", help="comma-separated model types (default: every causal-LM architecture)"),
    jobs: int = typer.Option(1, "--jobs", "-j", help="architectures in parallel (one process each)"),
    timeout: float = typer.Option(600.0, help="seconds per architecture before it is TIMEOUT"),
    workdir: Path = typer.Option(Path("runs/landscape"), help="per-architecture folders (resume reuses their row.json)"),
    output: Path = typer.Option(Path("docs/landscape"), "--output", "-o", help="writes <output>.md and <output>.json"),
    rerun: bool = typer.Option(False, help="measure architectures that already have a result"),
) -> None:
    """Tiny seeded model of every causal-LM architecture through verify --target sim: buckets, totals, ranked blockers."""
    try:
        from nhil.landscape import run_landscape

        s = run_landscape([a.strip() for a in only.split(",") if a.strip()] if only else None, jobs, timeout, workdir, output, rerun,
                          progress=lambda line: typer.echo(line, err=True))
        typer.echo(" ".join(f"{k}={v}" for k, v in s["totals"].items()))
        typer.echo(f"report: {output.with_suffix('.md')}")
    except NhilError as e:
        _fail(e)
