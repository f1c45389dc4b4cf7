"""Goldens shared between the workers of a Ray sweep by content.

A row's ``nhil verify`` reads or creates its golden in the worker's ``goldens/`` (one
``MANIFEST.json`` with each file's sha256, :mod:`nhil.golden.store`). Workers on other
machines do not see the driver's folder, so the Ray sweep passes the driver's goldens of a
row's model to its task as arguments (name -> sha256, bytes through Ray's object store) and
a golden the worker made comes back with the row (name, sha256, bytes) to the driver's
folder, for later sweeps on any node. :func:`install` verifies the sha256 of the bytes it
got before writing (temp file + rename, under the store's lock) and records it in the
folder's manifest, so ``load_golden`` verifies it again on read; bytes that do not match are
refused (:class:`~nhil.errors.GoldenError`), never written. On one machine (or a shared
file system) the file is already there with the same sha256 and nothing is rewritten.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nhil.errors import GoldenError


def golden_of(report: dict) -> tuple[str, str, bytes] | None:
    """``(file name, sha256, bytes)`` of the golden a verify report used, or None (no
    golden reached, or the file is gone / no longer has the reported sha256)."""
    g = report.get("golden") or {}
    path = g.get("path")
    if not path or not Path(path).is_file():
        return None
    data = Path(path).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    if g.get("sha256") and g["sha256"] != sha:
        return None
    return Path(path).name, sha, data


def install(goldens_dir: Path, name: str, sha256: str, data: bytes) -> bool:
    """Put a shared golden into ``goldens_dir`` unless the same content is there already.

    Args:
        goldens_dir: the node's golden folder (created if needed).
        name: file name (``<model>-<hash12>.safetensors``; no folder part).
        sha256: hex sha256 the index recorded for it.
        data: the file's bytes as received.

    Returns:
        True if written, False if the folder already had this name with this sha256.

    Raises:
        GoldenError: ``data`` does not hash to ``sha256`` (corrupted in transit or a wrong
            index entry), or ``name`` is not a plain file name; nothing is written.
    """
    from nhil.golden.store import MANIFEST_NAME, SCHEMA_VERSION, _lock, _utc_now, read_manifest
    from nhil.util import atomic_write_bytes as _atomic_write_bytes

    if Path(name).name != name or not name.endswith(".safetensors"):
        raise GoldenError(f"shared golden name {name!r} is not a plain .safetensors file name")
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise GoldenError(f"shared golden {name}: received bytes hash to {got[:16]}... but the sweep's index records {sha256[:16]}...; "
                          "refusing to install it (rerun the row; the worker that published it regenerates it)")
    goldens_dir = Path(goldens_dir)
    goldens_dir.mkdir(parents=True, exist_ok=True)
    with _lock(goldens_dir):
        files = read_manifest(goldens_dir)
        path = goldens_dir / name
        if path.is_file() and files.get(name, {}).get("sha256") == sha256 and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
            return False
        _atomic_write_bytes(path, data)
        files[name] = {"sha256": sha256, "bytes": len(data), "written": _utc_now()}
        manifest = {"schema_version": SCHEMA_VERSION, "files": dict(sorted(files.items()))}
        _atomic_write_bytes(goldens_dir / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return True
