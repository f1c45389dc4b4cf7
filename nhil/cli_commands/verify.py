"""``nhil verify``, ``nhil run``, ``nhil golden``: run a model or a given program on a target against its golden."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from nhil.cli_commands.common import _checked, _fail
from nhil.errors import NhilError


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
    passes: Optional[str] = typer.Option(None, "--passes", help="comma-separated scheduling passes; 'default' = the default pipeline, e.g. default,ew-swiglu,ew-residual,host-overlap (default: the default pipeline)"),
) -> None:
    """Compile, run on TARGET, compare with the golden; exit 0 only if every check passes."""
    from nhil.report.writer import print_summary
    from nhil.verify import VerifyOptions, verify as run_verify
    from nhil.verify.options import parse_passes

    if board:
        import os

        os.environ["FPGA_BOARD"] = board  # the fpga target and the reproducer read it
    opts = {}
    for kv in option:
        k, _, v = kv.partition("=")
        opts[k] = v
    names = _checked(parse_passes, passes)
    o = VerifyOptions(model=model, target=target, prompt=prompt, tokens=tokens, seed=seed, device=device, regen=regen, target_options=opts, lockstep=not no_lockstep, repeat=repeat, runs_dir=runs_dir, quant=quant, layers=layers, kv_cache=kv_cache, passes=names)
    rep = _checked(run_verify, o)
    print_summary(rep)
    typer.echo(f"report: {rep['run_dir']}/report.md", err=True)
    if rep["outcome"] != "PASS":
        if rep.get("error"):
            typer.secho(f"{rep['outcome']}: {rep['error']}", fg="red", err=True)
        typer.secho(f"reproduce: {rep['reproducer']}", err=True)
        raise typer.Exit(1)


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
