"""The ``nhil`` command line (typer). ``nhil --help`` lists the commands.

Every user-facing failure prints one clear line (no traceback) and exits non-zero;
``verify`` exits 0 only when every check passes and prints a one-line reproducer otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from nhil.errors import NhilError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="nhil: compile LLMs to PIM programs and verify them on sim / rtl / fpga targets.")


def _fail(e: NhilError) -> None:
    typer.secho(f"{e.outcome}: {e}", fg="red", err=True)
    raise typer.Exit(2)


def _checked(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a ``nhil.args.UsageError`` prints one line and exits with ``EXIT_USAGE`` (64)."""
    from nhil.args import EXIT_USAGE, UsageError

    try:
        return fn(*args, **kwargs)
    except UsageError as e:
        typer.secho(f"{e.outcome}: {e}", fg="red", err=True)
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def models(
    coverage: bool = typer.Option(False, help="measure and print the per-architecture coverage table (export/raise/lower/verify; minutes)"),
    targets: str = typer.Option("sim", help="with --coverage: comma-separated targets to verify on (sim,rtl,fpga)"),
    quant: str = typer.Option("", help="with --coverage: comma-separated quant recipes the MoE families' rtl/fpga columns are verified with too"),
) -> None:
    """List registered models."""
    if coverage:
        from nhil.coverage import DEFAULT_MODELS, coverage_table, format_rows

        typer.echo(format_rows(coverage_table(DEFAULT_MODELS, tuple(t for t in targets.split(",") if t), quants=tuple(q for q in quant.split(",") if q))))
        return
    from nhil.models import list_models

    for name, desc in list_models().items():
        typer.echo(f"{name:14s} {desc}")


@app.command("compile")
def compile_cmd(
    model: str = typer.Option("llama", "--model", "-m"),
    output: Path = typer.Option(Path("prog.pimb"), "--output", "-o", help="program file (.pimb)"),
    device: str = typer.Option("aim-like", help="device preset"),
    max_cache_len: int = typer.Option(64, help="KV cache positions compiled in"),
    bundle: Optional[Path] = typer.Option(None, help="also write a handoff bundle folder: program, text form, golden inputs/outputs, manifest"),
    prompt: Optional[str] = typer.Option(None, help="prompt for the bundle's golden"),
    tokens: int = typer.Option(4, help="decoded tokens in the bundle's golden"),
    quant: str = typer.Option("bf16", help="weight quantization recipe (as verify's QUANT)"),
    passes: Optional[str] = typer.Option(None, help="comma-separated scheduling passes (default: every pass; '' = the naive baseline)"),
) -> None:
    """Compile MODEL's decode step to a PIM program (``nhil.compiler.pipeline``)."""
    try:
        from nhil.compile import compile_model, write_bundle

        names = None if passes is None else [p.strip() for p in passes.split(",") if p.strip()]
        prog = compile_model(model, device, max_cache_len, quant=quant, passes=names)
        n = prog.save(output)
        typer.echo(f"wrote {output} ({n} bytes, {len(prog.instrs)} instructions, {len(prog.bank_images)} bank rows; "
                   f"passes: {', '.join(prog.info.get('passes', [])) or 'none'})")
        if bundle:
            write_bundle(bundle, model, prog, prompt, tokens)
            typer.echo(f"wrote handoff bundle {bundle}/")
    except NhilError as e:
        _fail(e)


@app.command()
def disasm(program: Path, full: bool = typer.Option(False, help="include the image blob so `nhil asm` re-assembles it"), output: Optional[Path] = typer.Option(None, "-o")) -> None:
    """Print a .pimb program as .pims assembly text."""
    try:
        from nhil.isa import Program
        from nhil.isa.asm import disassemble

        text = disassemble(Program.load(program), full=full)
        if output:
            from nhil.util import atomic_write_text

            atomic_write_text(output, text)
        else:
            sys.stdout.write(text)
    except NhilError as e:
        _fail(e)


@app.command()
def asm(source: Path, output: Path = typer.Option(..., "-o")) -> None:
    """Assemble .pims text (from `nhil disasm --full`) back into a .pimb program."""
    try:
        from nhil.errors import ProgramFormatError
        from nhil.isa.asm import assemble

        try:
            text = source.read_text()
        except OSError as e:
            raise ProgramFormatError(f"cannot read {source}: {e.strerror}") from None
        n = assemble(text, str(source)).save(output)
        typer.echo(f"wrote {output} ({n} bytes)")
    except NhilError as e:
        _fail(e)


@app.command()
def verify(
    model: str = typer.Option("llama", "--model", "-m", help="registered name (`nhil models`), or a path: Hugging Face folder, .gguf file, config.json (seeded weights)"),
    target: str = typer.Option("sim", "--target", "-t"),
    prompt: Optional[str] = typer.Option(None),
    tokens: int = typer.Option(16),
    seed: int = typer.Option(0),
    device: Optional[str] = typer.Option(None, help="device preset (default: the target's)"),
    regen: bool = typer.Option(False, help="regenerate the golden"),
    option: list[str] = typer.Option([], "--option", "-O", help="target option key=value (repeatable)"),
    no_lockstep: bool = typer.Option(False, help="do not cross-check a non-sim target against the simulator"),
    repeat: int = typer.Option(1, help="repeat the teacher-forced run N times and check bit-identical logits"),
    runs_dir: Path = typer.Option(Path("runs"), help="folder for run folders"),
    quant: str = typer.Option("bf16", "--quant", "-q", help="weight quantization recipe: native|bf16|int8|int4-g128|fp8-e4m3|mxfp8|mxfp6|mxfp4|mxint8|nvfp4|q8_0|q4_0|q4_1 or a format name, with overrides like mxfp4:lm_head=bf16"),
    kv_cache: str = typer.Option("bf16", "--kv-cache", help="KV cache storage: bf16 or fp8 (E4M3, per-head scales; adds kv_cache=fp8 to the recipe)"),
    layers: Optional[int] = typer.Option(None, "--layers", help="with --model PATH: keep the first N decoder layers"),
    board: Optional[str] = typer.Option(None, help="fpga target: a board of the boards file (boards.yaml / $NHIL_BOARDS; `nhil boards`), sets FPGA_BOARD"),
) -> None:
    """Compile, run on TARGET, compare with the golden; exit 0 only if every check passes."""
    from nhil.report.writer import print_summary
    from nhil.verify import VerifyOptions, verify as run_verify

    if board:
        import os

        os.environ["FPGA_BOARD"] = board  # the fpga target and the reproducer read it
    opts = {}
    for kv in option:
        k, _, v = kv.partition("=")
        opts[k] = v
    o = VerifyOptions(model=model, target=target, prompt=prompt, tokens=tokens, seed=seed, device=device, regen=regen, target_options=opts, lockstep=not no_lockstep, repeat=repeat, runs_dir=runs_dir, quant=quant, layers=layers, kv_cache=kv_cache)
    rep = _checked(run_verify, o)
    print_summary(rep)
    typer.echo(f"report: {rep['run_dir']}/report.md", err=True)
    if rep["outcome"] != "PASS":
        if rep.get("error"):
            typer.secho(f"{rep['outcome']}: {rep['error']}", fg="red", err=True)
        typer.secho(f"reproduce: {rep['reproducer']}", err=True)
        raise typer.Exit(1)


@app.command("run")
def run_cmd(
    program: Path = typer.Argument(..., help="a .pimb program (with --golden) or a handoff bundle folder (`nhil compile --bundle`)"),
    target: str = typer.Option("sim", "--target", "-t"),
    golden: Optional[Path] = typer.Option(None, help="golden .safetensors whose prompt/tokens are fed and whose logits are compared (default: the bundle's)"),
    option: list[str] = typer.Option([], "--option", "-O", help="target option key=value (repeatable)"),
    no_lockstep: bool = typer.Option(False, help="do not cross-check a non-sim target against the simulator"),
    runs_dir: Path = typer.Option(Path("runs"), help="folder for run folders"),
) -> None:
    """Run a given program on TARGET with its golden's inputs and compare outputs; exit 0 only if every check passes."""
    from nhil.report.writer import print_summary
    from nhil.run_program import run_program

    opts = dict(kv.partition("=")[::2] for kv in option)
    rep = _checked(run_program, program, target, golden, runs_dir, opts, not no_lockstep)
    print_summary(rep)
    typer.echo(f"report: {rep['run_dir']}/report.md", err=True)
    if rep["outcome"] != "PASS":
        if rep.get("error"):
            typer.secho(f"{rep['outcome']}: {rep['error']}", fg="red", err=True)
        raise typer.Exit(1)


@app.command()
def golden(
    model: str = typer.Option("llama", "--model", "-m"),
    prompt: Optional[str] = typer.Option(None),
    tokens: int = typer.Option(16),
    seed: int = typer.Option(0),
    regen: bool = typer.Option(False, help="regenerate and show how much the new golden differs"),
    goldens_dir: Path = typer.Option(Path("goldens")),
) -> None:
    """Create (or with --regen, regenerate) the golden for MODEL/PROMPT/TOKENS."""
    try:
        from nhil.golden import metrics
        from nhil.golden.generate import generate_golden
        from nhil.golden.store import golden_key, golden_path, load_golden, write_golden
        from nhil.models import get_model

        b = get_model(model)
        ids = b.encode(prompt)
        path = golden_path(goldens_dir, model, golden_key(ids, tokens, b.weights_id, seed=seed))
        old = None
        from nhil.golden.schema import golden_shapes, why_not_comparable

        if path.exists():
            if not regen:
                load_golden(path, shapes=golden_shapes(b.model))
                typer.echo(f"{path} exists and is intact (use --regen to rebuild it)")
                return
            try:
                old, _ = load_golden(path)
            except NhilError as e:
                typer.echo(f"old golden unreadable ({e}); replacing it")
        t, meta = generate_golden(b, ids, tokens, seed=seed, prompt_text=prompt)
        sha = write_golden(path, t, meta)
        typer.echo(f"wrote {path} sha256={sha[:16]}")
        why = why_not_comparable(old, t) if old is not None else None
        if why:
            typer.echo(f"new vs old logits: not compared ({why})")
        elif old is not None:
            m = metrics.compare_tensors(old["logits"], t["logits"])
            typer.echo(f"new vs old logits: max_abs={m['max_abs']} sqnr_db={m['sqnr_db']} tokens_equal={old['tokens'].tolist() == t['tokens'].tolist()}")
    except NhilError as e:
        _fail(e)


@app.command("sweep")
def sweep_cmd(
    models_: Optional[str] = typer.Option(None, "--models", help="comma-separated; default: every manifest row"),
    targets_: Optional[str] = typer.Option(None, "--targets"),
    quants: Optional[str] = typer.Option(None, "--quants"),
    nightly: bool = typer.Option(False, help="include rows marked nightly"),
    seed: int = typer.Option(0, help="run seed (combined with each row's id)"),
    timeout: float = typer.Option(3600, help="seconds per row before it is TIMEOUT"),
    update_manifest: bool = typer.Option(False, "--update-manifest", help="record this sweep's outcomes as the new expectations"),
    row_ids: Optional[str] = typer.Option(None, "--rows", help="comma-separated row ids (model-target-quant[-variant], as in the checklist); with --nightly any row"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run the rows as Ray tasks: auto (start a local Ray instance, stop it at the end) or a cluster ADDRESS"),
    ray_cpus: Optional[int] = typer.Option(None, "--ray-cpus", help="with --ray auto: CPUs of the local instance (default: all)"),
) -> None:
    """Run models x targets x quants (rows of expectations.yaml, filtered); matrix + JUnit in runs/sweeps/<time>/."""
    try:
        from nhil import expectations
        from nhil.sweep import sweep

        from nhil.args import check_sweep_names

        _checked(check_sweep_names, models_, targets_, quants)
        rows = expectations.load()
        if not nightly:
            rows = [r for r in rows if not r.get("nightly")]
        for opt, key in ((models_, "model"), (targets_, "target"), (quants, "quant")):
            if opt:
                allowed = {x.strip() for x in opt.split(",")}
                rows = [r for r in rows if r[key] in allowed]
        if row_ids:
            from nhil.sweep import select_rows

            try:
                rows = select_rows(rows, row_ids)
            except ValueError as e:
                from nhil.errors import SetupError

                raise SetupError(f"--rows: {e}") from None
        if models_ and targets_:
            have = {(r["model"], r["target"], r["quant"]) for r in rows}
            for m in models_.split(","):
                for t in targets_.split(","):
                    for q in (quants or "bf16").split(","):
                        if (m.strip(), t.strip(), q.strip()) not in have:
                            rows.append({"model": m.strip(), "target": t.strip(), "quant": q.strip(), "expect": "PASS"})
        if ray:
            from nhil.cluster.ray_sweep import ray_sweep

            out, results = ray_sweep(rows, seed, timeout_s=timeout, address=ray, local_cpus=ray_cpus)
        else:
            out, results = sweep(rows, seed, timeout_s=timeout)
        typer.echo((out / "matrix.md").read_text())
        typer.echo(f"report: {out / 'report.html'}")
        if update_manifest:
            expectations.update(results)
            typer.echo("expectations.yaml updated")
        if any(not r.get("as_expected") for r in results) and not update_manifest:
            raise typer.Exit(1)
    except NhilError as e:
        _fail(e)


@app.command()
def checklist(output: Optional[Path] = typer.Option(None, "-o", help="write OUTPUT.md, OUTPUT.html and OUTPUT.json (default: Markdown to stdout)"),
              rows: bool = typer.Option(False, "--rows", help="the older per-row table of the latest sweep instead of the gates")) -> None:
    """Render the staged bring-up checklist: gates in order, each passed only by evidence from this commit."""
    try:
        from nhil import expectations

        if rows:
            from nhil.report.row_checklist import checklist_markdown, latest_results, latest_summary

            sys.stdout.write(checklist_markdown(expectations.load(), latest_results(), latest_summary()))
            return
        from nhil.report.checklist import build_checklist, render_markdown, write_checklist

        data = build_checklist(expectations.load())
        if output:
            for p in write_checklist(data, output):
                typer.echo(f"wrote {p}")
        else:
            sys.stdout.write(render_markdown(data))
    except NhilError as e:
        _fail(e)


@app.command()
def evidence(output: Path = typer.Option(Path("runs/evidence/tests.json"), "-o")) -> None:
    """Run the unit and single-program tests behind checklist gates 1-2 and record their outcomes with the commit."""
    from nhil.report.checklist import run_evidence

    ev = run_evidence(output)
    bad = [n for n, c in ev["cases"].items() if c["outcome"] not in ("passed",)]
    typer.echo(f"wrote {output}: {len(ev['cases'])} cases, {len(bad)} not passed, commit {ev['git_commit']}")


@app.command("boards")
def boards_cmd(probe: bool = typer.Option(True, "--probe/--no-probe", help="HELLO + INFO each board for its claimed capabilities"),
               file: Optional[Path] = typer.Option(None, "--file", help="boards file (default: $NHIL_BOARDS or boards.yaml)"),
               timeout: float = typer.Option(3.0, help="seconds per board for the HELLO handshake")) -> None:
    """List the lab's FPGA boards (boards file) and probe each one; exit 1 if one does not answer."""
    try:
        from nhil.boards import boards_path, load_boards
        from nhil.targets.fpga.probe import probe as probe_board

        boards = load_boards(file)
        if not boards:
            typer.echo(f"no boards: {file or boards_path()} does not exist or lists none (format: nhil/boards.py)")
            return
        dead = 0
        for b in boards.values():
            line = f"{b.name:16s} {b.url:32s} baud {b.baud:<8d} device {b.device:12s} node {b.node or '-'}"
            if probe:
                r = probe_board(b, open_timeout=timeout)
                if r["ok"]:
                    c = r["capabilities"]
                    dev = c.get("device", {}) if isinstance(c.get("device"), dict) else {}
                    line += (f"  OK ({r['seconds']} s): ISA v{c.get('isa_version')}, {len(c.get('ops', []))} ops, formats {','.join(sorted(c.get('formats', [])))}, "
                             f"{dev.get('channels', '?')} ch x {dev.get('banks', dev.get('banks_per_channel', '?'))} banks" + (f"; WARNING {r['warning']}" if r.get("warning") else ""))
                else:
                    dead += 1
                    line += f"  {r['outcome']}: {r['error']}"
            typer.echo(line)
        if dead:
            raise typer.Exit(1)
    except NhilError as e:
        _fail(e)


@app.command()
def targets() -> None:
    """List targets and their capabilities."""
    from nhil.targets import available_targets, get_target

    for name in available_targets():
        t = None
        try:
            t = get_target(name)
            caps = t.capabilities().to_json()  # the fpga target opens its link (an emulator) to ask the board
            typer.echo(f"{name}: {json.dumps(caps)}")
        except NhilError as e:
            typer.echo(f"{name}: unavailable: {e}")
        finally:
            if t is not None:
                t.close()


@app.command()
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


@app.command("quant-report")
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


@app.command()
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


def _register_optional() -> None:
    try:
        from nhil.targets.fpga.cli import fpga_emu

        app.command("fpga-emu", help="Serve the FPGA board side of the link protocol on a pseudo-terminal (board emulator).")(fpga_emu)
    except ImportError:
        pass


_register_optional()

if __name__ == "__main__":
    app()
