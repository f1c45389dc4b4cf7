"""What a ``--model`` spec names, decided without loading anything heavy (argument checks run in
the first second): a registry name or a file system path, and its run-folder label."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["looks_like_path", "model_label"]


def looks_like_path(spec: str) -> bool:
    """True if ``spec`` names a file system path rather than a registry name."""
    return os.sep in spec or "/" in spec or spec.endswith((".gguf", ".json")) or Path(spec).exists()


def model_label(spec: str) -> str:
    """Filesystem-safe name of a model spec for run folders and golden folders.

    A registry name is returned unchanged; a path becomes its folder or file stem
    (``.../SmolLM2/`` -> ``SmolLM2``, ``x.gguf`` -> ``x``, ``.../qwen3/config.json`` ->
    ``qwen3-config``), with characters outside ``[A-Za-z0-9._-]`` replaced by ``_``.
    """
    if not looks_like_path(spec):
        return spec
    p = Path(spec.rstrip("/"))
    if p.name == "config.json":
        base = f"{p.parent.resolve().name or 'model'}-config"
    elif p.suffix in (".gguf", ".json"):
        base = p.stem
    else:
        base = p.resolve().name or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)
