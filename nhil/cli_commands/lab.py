"""``nhil boards``, ``nhil targets``: the lab's FPGA boards and the targets with their capabilities."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from nhil.cli_commands.common import _fail
from nhil.errors import NhilError


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
