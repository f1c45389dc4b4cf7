"""Error exits shared by the ``nhil`` commands: a failure prints one line (no traceback) and exits non-zero."""

from __future__ import annotations

import typer

from nhil.errors import NhilError


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
