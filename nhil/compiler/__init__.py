"""nhil compiler frontend: torch.export -> graph IR of ``torch.ops.nhil`` primitives.

``export_prefill`` / ``export_decode`` produce ATen ExportedPrograms; ``raise_graph``
pattern-matches them exactly into nhil primitives (``primitives.py``) and
``check_raised_exact`` proves the raised graph bit-identical on example inputs.

The names below are imported on first use (PEP 562 ``__getattr__``), so that torch-free
submodules (``nhil.compiler.quantize_recipe``, the recipe grammar read by ``nhil.args`` before any
work starts) do not pay for importing torch; ``raising`` imports ``primitives`` itself, which
registers ``torch.ops.nhil.*``.
"""

import importlib

_EXPORTS = {
    "check_raised_exact": "nhil.compiler.check",
    "export_decode": "nhil.compiler.export",
    "export_prefill": "nhil.compiler.export",
    "raise_graph": "nhil.compiler.raising",
    "RaisedGraph": "nhil.compiler.raising",
    "UnraisedOp": "nhil.compiler.raising",
}

__all__ = ["check_raised_exact", "export_decode", "export_prefill", "raise_graph", "RaisedGraph", "UnraisedOp"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "primitives":
        return importlib.import_module("nhil.compiler.primitives")
    raise AttributeError(f"module 'nhil.compiler' has no attribute {name!r}")
