"""Golden-output files: safetensors with provenance metadata and a sha256 manifest.

A golden is one ``.safetensors`` file (tensors + a string->string ``__metadata__``
map, which the format defines as purely informative, so nhil checks it itself). Next to
it, ``<dir>/MANIFEST.json`` records each file's sha256; :func:`load_golden` refuses a
file whose bytes no longer match. Files are written atomically (temp file in the same
directory, then ``os.replace``) under a ``filelock.FileLock`` so concurrent writers of
one directory cannot lose manifest entries. Nothing is ever unpickled.

Manifest format (JSON)::

    {"schema_version": "1",
     "files": {"<file name>": {"sha256": "<hex>", "bytes": <int>, "written": "<UTC ISO>"}}}
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import struct
import subprocess
from pathlib import Path
from typing import Any, Mapping

import torch

from nhil.errors import GoldenError
from nhil.util import atomic_write_bytes as _atomic_write_bytes

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "REGEN_HINT",
    "write_golden",
    "load_golden",
    "golden_key",
    "golden_path",
    "read_manifest",
]

SCHEMA_VERSION = "1"
KNOWN_SCHEMAS = frozenset({"1"})
MANIFEST_NAME = "MANIFEST.json"
REGEN_HINT = "rerun with `make verify ... REGEN=1` or `nhil golden --regen`"


def _versions() -> dict[str, str]:
    import safetensors

    import nhil

    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = "not installed"
    return {
        "torch_version": torch.__version__,
        "transformers_version": tv,
        "nhil_version": getattr(nhil, "__version__", "unknown"),
        "safetensors_version": getattr(safetensors, "__version__", "unknown"),
    }


def _git_commit() -> str:
    """HEAD of the nhil checkout (with ``-dirty`` if modified), or ``"unknown"``; best effort, <1 s."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _lock(directory: Path):
    from filelock import FileLock

    return FileLock(str(directory / (MANIFEST_NAME + ".lock")), timeout=60)


def read_manifest(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """File name -> {sha256, bytes, written} from ``<directory>/MANIFEST.json`` ({} if absent).

    Raises:
        GoldenError: the manifest is not valid JSON or not a manifest.
    """
    mpath = Path(directory) / MANIFEST_NAME
    if not mpath.exists():
        return {}
    try:
        data = json.loads(mpath.read_text(encoding="utf-8"))
        files = data["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise GoldenError(
            f"golden manifest {mpath} is corrupt ({type(e).__name__}: {e}); delete it and regenerate the goldens in "
            f"{mpath.parent}: {REGEN_HINT}"
        ) from None
    return files


def write_golden(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """Write a golden safetensors file atomically and record its sha256 in the manifest.

    Args:
        path: destination ``.safetensors`` file; its directory is created if needed.
        tensors: name -> tensor (any dtype/shape; made contiguous and moved to CPU).
        metadata: provenance, str -> str (model, weights_id, prompt, ...). nhil adds
            ``schema_version`` ("1"), ``created`` (UTC ISO 8601), ``torch_version``,
            ``transformers_version``, ``nhil_version``, ``safetensors_version`` and
            ``git_commit``; caller values for these keys are overwritten.

    Returns:
        hex sha256 of the written file (also stored in ``<dir>/MANIFEST.json``).

    Raises:
        TypeError: a metadata key or value is not a str, or a tensor is not a tensor.
        OSError: the directory is not writable (the old golden, if any, is untouched).
    """
    from nhil.golden.schema import check_writable

    path = Path(path)
    check_writable(tensors)
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"golden metadata must be str -> str (safetensors __metadata__); got {k!r}: {type(v).__name__}")
    clean = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"golden tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        clean[name] = t.detach().cpu().contiguous().clone()
    meta = dict(metadata)
    meta.update(_versions())
    meta["schema_version"] = SCHEMA_VERSION
    meta["created"] = _utc_now()
    meta["git_commit"] = _git_commit()

    from safetensors.torch import save

    data = save(clean, metadata=meta)
    digest = hashlib.sha256(data).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path.parent):
        _remove_stale_temps(path.parent)
        _atomic_write_bytes(path, data)
        files = read_manifest(path.parent)
        files[path.name] = {"sha256": digest, "bytes": len(data), "written": meta["created"]}
        manifest = {"schema_version": SCHEMA_VERSION, "files": dict(sorted(files.items()))}
        _atomic_write_bytes(path.parent / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return digest


def _remove_stale_temps(directory: Path) -> None:
    """Delete temp files an interrupted write left (``.<name>.<random>.tmp`` of
    ``nhil.util.atomic_write_bytes``). Called under the directory's lock, which every
    writer of a golden or the manifest holds, so no temp file found here is in use."""
    for tmp in directory.glob(".*.tmp"):
        if tmp.name.startswith((f".{MANIFEST_NAME}.",)) or ".safetensors." in tmp.name:
            try:
                tmp.unlink()
            except OSError:
                pass


def _parse_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of safetensors bytes (JSON header; no tensor is decoded)."""
    if len(data) < 8:
        raise ValueError(f"file is {len(data)} bytes, shorter than the 8-byte safetensors header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"header length {n} exceeds the file size {len(data)} (truncated)")
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not a map")
    return {str(k): str(v) for k, v in meta.items()}


def load_golden(path: str | os.PathLike, expect: Mapping[str, str] | None = None,
                shapes: Mapping[str, int] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load and validate a golden written by :func:`write_golden`.

    Args:
        path: the ``.safetensors`` golden.
        expect: metadata that must match exactly (e.g. model, weights_id, prompt_ids,
            n_tokens); every differing key is listed in the error.
        shapes: the model's sizes (``nhil.golden.schema.golden_shapes``): the tensors must
            have them (``nhil.golden.schema.check_loaded``; tensors are always checked
            against the file's own metadata).

    Returns:
        (tensors name -> CPU tensor, metadata str -> str).

    Raises:
        GoldenError: the file is missing; it is not valid safetensors or is truncated;
            it is not in ``MANIFEST.json``; its sha256 differs from the manifest's
            (corrupt or edited after writing); its schema version is unknown; or an
            ``expect`` key differs; a tensor's shape or dtype differs from the metadata's
            (or ``shapes``'). Each message names the file, the problem and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise GoldenError(f"golden {path} does not exist; create it: {REGEN_HINT}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    files = read_manifest(path.parent)
    entry = files.get(path.name)
    recorded = entry.get("sha256") if isinstance(entry, dict) else None
    sha_note = ""
    if recorded is not None and recorded != digest:
        sha_note = f"; its sha256 {digest[:16]}... also differs from {MANIFEST_NAME}'s {str(recorded)[:16]}..."

    from safetensors.torch import load

    try:
        meta = _parse_metadata(data)
        tensors = load(data)
    except Exception as e:  # SafetensorError (a Rust exception class), ValueError, UnicodeDecodeError
        raise GoldenError(
            f"golden {path} is not a valid safetensors file (truncated or corrupt: {type(e).__name__}: {e}){sha_note}; "
            f"delete it and regenerate: {REGEN_HINT}"
        ) from None
    if recorded is None:
        raise GoldenError(
            f"golden {path} is not recorded in {path.parent / MANIFEST_NAME} (copied in by hand, or the manifest was "
            f"lost), so its integrity cannot be checked; regenerate it: {REGEN_HINT}"
        )
    if recorded != digest:
        raise GoldenError(
            f"golden {path} has sha256 {digest} but {MANIFEST_NAME} records {recorded}: the file is corrupt or was "
            f"edited after writing; regenerate it: {REGEN_HINT}"
        )
    schema = meta.get("schema_version")
    if schema not in KNOWN_SCHEMAS:
        raise GoldenError(
            f"golden {path} has schema_version {schema!r}; this nhil reads {sorted(KNOWN_SCHEMAS)}; regenerate it: {REGEN_HINT}"
        )
    if expect:
        diffs = [(k, meta.get(k), v) for k, v in expect.items() if meta.get(k) != v]
        if diffs:
            lines = "; ".join(f"{k}: stored {_short(s)} vs expected {_short(e)}" for k, s, e in diffs)
            raise GoldenError(
                f"golden {path} is stale or belongs to another run ({len(diffs)} metadata key(s) differ: {lines}); "
                f"regenerate it: {REGEN_HINT}"
            )
    from nhil.golden.schema import check_loaded

    check_loaded(path, tensors, meta, shapes)
    return tensors, meta


def _short(v: str | None, n: int = 120) -> str:
    if v is None:
        return "<absent>"
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def golden_key(prompt_ids: list[int], n_tokens: int, weights_id: str, **extra: Any) -> dict[str, Any]:
    """The target-independent identity of a golden: prompt ids, token count, weights id (+ extras).

    Extra keyword values (e.g. ``seed``, ``dtype``) must be JSON-serialisable.
    """
    key = {"prompt_ids": [int(t) for t in prompt_ids], "n_tokens": int(n_tokens), "weights_id": str(weights_id)}
    key.update(extra)
    return key


def golden_path(root: str | os.PathLike, model: str, target_independent_key: Any) -> Path:
    """Stable golden file path ``<root>/<model>-<hash12>.safetensors``.

    Args:
        root: directory holding goldens (one manifest per directory).
        model: registry name; characters outside ``[A-Za-z0-9._-]`` become ``_``.
        target_independent_key: what identifies the golden regardless of target, usually
            :func:`golden_key` (prompt ids, n tokens, weights id); any JSON-serialisable
            value. ``hash12`` is the first 12 hex digits of sha256 of its canonical JSON
            (sorted keys, no spaces), so equal keys always give the same name.

    Raises:
        TypeError: the key is not JSON-serialisable.
    """
    canon = json.dumps(target_independent_key, sort_keys=True, separators=(",", ":"))
    h = hashlib.sha256(canon.encode("utf-8")).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model) or "model"
    return Path(root) / f"{safe}-{h}.safetensors"
