"""Run reports: atomic JSON/text writers, Markdown rendering and a console summary.

See :mod:`nhil.report.writer` for the verify-report dict layout.
"""

from nhil.report.writer import atomic_write_text, print_summary, render_markdown, write_json

__all__ = ["atomic_write_text", "print_summary", "render_markdown", "write_json"]
