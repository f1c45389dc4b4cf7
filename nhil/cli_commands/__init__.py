"""The commands of the ``nhil`` command line, one module a group; ``nhil.cli`` registers them on its typer app.

* ``build``: models, compile, disasm, asm;
* ``verify``: verify, run, golden;
* ``sweep``: sweep, checklist, evidence;
* ``lab``: boards, targets;
* ``measure``: bench, quant-report, landscape.

Each command is a plain function whose typer options are its defaults; ``common`` holds the error exits.
"""
