"""``nhil models``, ``nhil compile``, ``nhil disasm``, ``nhil asm``: the registered models and a model's PIM program."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from nhil.cli_commands.common import _fail
from nhil.errors import NhilError


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
