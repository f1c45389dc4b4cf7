"""Reuse or generate one golden, once per key even when several runs start together.

Two ``nhil verify`` runs of the same model/prompt/tokens used to both generate the golden
and both write it; the surviving report then recorded a sha256 the file no longer had.
:func:`obtain_golden` holds a ``filelock.FileLock`` per golden file (``<golden>.lock``
beside it) while it checks, generates and writes: the first run generates, the others
wait and then load what it wrote (``reused: True``), so every report's sha256 is the file's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Mapping

GENERATE_LOCK_TIMEOUT_S = 3600.0  # the real model's golden takes ~1 min; a stuck holder ends the wait


def obtain_golden(path: str | Path, expect: Mapping[str, str], regen: bool, generate: Callable[[], tuple[dict, dict]],
                  shapes: Mapping[str, int] | None = None) -> tuple[dict, dict, dict]:
    """Load the golden at ``path`` or (absent, or ``regen``) generate and write it, under its lock.

    Args:
        path: golden file (``nhil.golden.store.golden_path``).
        expect: metadata the stored golden must match (``load_golden(expect=...)``).
        regen: generate even if the file exists.
        generate: ``() -> (tensors, metadata)``, e.g. ``generate_golden`` bound to the model.
        shapes: expected sizes passed to ``load_golden`` (``vocab_size``, ``num_layers``,
            ``hidden_size``; each optional).

    Returns:
        ``(tensors, metadata, info)`` with info ``{"path", "reused", "sha256"}``; sha256 is
        of the file as it is on disk when this run uses it.

    Raises:
        GoldenError: the stored golden is refused by ``load_golden``.
        filelock.Timeout: another process held the lock for ``GENERATE_LOCK_TIMEOUT_S``.
    """
    from filelock import FileLock

    from nhil.golden.store import load_golden, write_golden

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=GENERATE_LOCK_TIMEOUT_S):
        if path.exists() and not regen:
            tensors, meta = load_golden(path, expect=expect, shapes=shapes)
            return tensors, meta, {"path": str(path), "reused": True, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        tensors, meta = generate()
        sha = write_golden(path, tensors, meta)
        return tensors, meta, {"path": str(path), "reused": False, "sha256": sha}
