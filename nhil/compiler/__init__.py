"""nhil compiler frontend: torch.export -> graph IR of ``torch.ops.nhil`` primitives.

``export_prefill`` / ``export_decode`` produce ATen ExportedPrograms; ``raise_graph``
pattern-matches them exactly into nhil primitives (``primitives.py``) and
``check_raised_exact`` proves the raised graph bit-identical on example inputs.
"""

from nhil.compiler import primitives  # noqa: F401  (registers torch.ops.nhil.*)
from nhil.compiler.check import check_raised_exact
from nhil.compiler.export import export_decode, export_prefill
from nhil.compiler.raising import RaisedGraph, UnraisedOp, raise_graph

__all__ = ["check_raised_exact", "export_decode", "export_prefill", "raise_graph", "RaisedGraph", "UnraisedOp"]
