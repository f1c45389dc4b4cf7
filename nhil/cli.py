"""The ``nhil`` command line (typer). ``nhil --help`` lists the commands.

Every user-facing failure prints one clear line (no traceback) and exits non-zero;
``verify`` exits 0 only when every check passes and prints a one-line reproducer otherwise.

The commands live in ``nhil.cli_commands`` (one module a group); this module makes the app and
registers them in the order ``nhil --help`` lists them.
"""

from __future__ import annotations

import typer

from nhil.cli_commands.build import asm, compile_cmd, disasm, models
from nhil.cli_commands.lab import boards_cmd, targets
from nhil.cli_commands.measure import bench, landscape, quant_report
from nhil.cli_commands.sweep import checklist, evidence, sweep_cmd
from nhil.cli_commands.verify import golden, run_cmd, verify

app = typer.Typer(add_completion=False, no_args_is_help=True, help="nhil: compile LLMs to PIM programs and verify them on sim / rtl / fpga targets.")

#: (command name, or None for the function's own name; function), in help order
COMMANDS = (
    (None, models), ("compile", compile_cmd), (None, disasm), (None, asm),
    (None, verify), ("run", run_cmd), (None, golden),
    ("sweep", sweep_cmd), (None, checklist), (None, evidence),
    ("boards", boards_cmd), (None, targets),
    (None, bench), ("quant-report", quant_report), (None, landscape),
)
for _name, _fn in COMMANDS:
    app.command(_name)(_fn)


def _register_optional() -> None:
    try:
        from nhil.targets.fpga.cli import fpga_emu

        app.command("fpga-emu", help="Serve the FPGA board side of the link protocol on a pseudo-terminal (board emulator).")(fpga_emu)
    except ImportError:
        pass


_register_optional()

if __name__ == "__main__":
    app()
