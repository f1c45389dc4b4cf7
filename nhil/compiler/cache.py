"""Content-addressed cache of compiled programs (issue 17 item 3: warm ``verify``).

A compiled decode program depends only on what went into it: the weights (sha256), the
model config, the quantization recipe, the device, the compiler passes in effect, the
maximum cache length, and the code that compiled it. :func:`cached_compile` keys an
entry by the sha256 of those parts (:func:`key_of`, canonical JSON) and stores the
program's ``.pimb`` bytes beside a manifest; a later run with the same parts decodes the
entry instead of exporting, raising, lowering and encoding again.

"The code that compiled it" is the nhil version **and** a sha256 over every ``nhil/**/*.py``
source file (:func:`source_sha256`): a development tree keeps its version string across
commits, so any edit to nhil gives new keys, plus the torch and transformers versions
(export and the tiny seeded configs depend on them).

Layout under the cache folder (``NHIL_CACHE_DIR``, default ``~/.cache/nhil``, then
``programs/``)::

    <key[:2]>/<key>.pimb    the program (Program.encode bytes)
    <key[:2]>/<key>.json    manifest: schema, key, key parts, sha256 + size of the .pimb, meta, created
    <key[:2]>/<key>.lock    filelock held while an entry is checked or built

Safety: the check-or-build runs under a per-key ``filelock.FileLock``, so parallel runs
with the same key build once and share the entry (the others wait, then read it). Files
are written to a temporary name and renamed (``nhil.util.atomic_write_*``), the ``.pimb``
first and the manifest last, so a run that dies leaves no entry that looks complete. On
load an entry is **refused with a message and rebuilt** when its manifest is unreadable,
of another schema, or records other key parts than asked for (stale), or when the
``.pimb`` is missing, of another size or sha256, or does not decode (corrupt). Nothing is
unpickled: the program is parsed by ``Program.decode`` (bounds-checked) and the manifest
is JSON.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, NamedTuple

from nhil.util import log

SCHEMA = 1
MAX_BYTES = int(float(os.environ.get("NHIL_CACHE_MAX_GB", 8)) * 2**30)  # prune least recently used entries beyond this
LOCK_TIMEOUT_S = float(os.environ.get("NHIL_CACHE_LOCK_TIMEOUT", 3600))
_SOURCE_SHA: str | None = None


def root_dir() -> Path:
    """The cache root shared by every nhil cache: ``$NHIL_CACHE_DIR`` (default ``~/.cache/nhil``); ``programs/``,
    ``references/`` (:func:`cached_tensors`) and ``models/`` (:mod:`nhil.models.load_cache`) live in it."""
    return Path(os.environ.get("NHIL_CACHE_DIR", "~/.cache/nhil")).expanduser()


def default_dir() -> Path:
    """The program cache folder: ``$NHIL_CACHE_DIR/programs`` (default ``~/.cache/nhil/programs``)."""
    return root_dir() / "programs"


def enabled() -> bool:
    """False when ``NHIL_CACHE=0`` (every run compiles from scratch)."""
    return os.environ.get("NHIL_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def source_sha256() -> str:
    """sha256 over the relative path and bytes of every ``.py`` file of the installed ``nhil`` package (computed once per process)."""
    global _SOURCE_SHA
    if _SOURCE_SHA is None:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
        _SOURCE_SHA = h.hexdigest()
    return _SOURCE_SHA


def toolchain_parts() -> dict:
    """The parts of a key that name the compiling code: nhil version + source sha256, torch and transformers versions."""
    import torch
    import transformers

    from nhil import __version__

    return {"nhil": __version__, "nhil_source_sha256": source_sha256(), "torch": torch.__version__, "transformers": transformers.__version__}


def key_of(parts: dict) -> str:
    """Hex sha256 of ``parts`` as canonical JSON (sorted keys, no spaces). Values must be JSON-serialisable."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_log = log  # the [nhil] stderr line (nhil.util.log)


def _refuse(path: Path, why: str, log) -> None:
    log(f"program cache: refusing entry {path}: {why}; rebuilding it")


def _load(stem: Path, key: str, parts: dict, log):
    """The entry's (Program, manifest) or None (missing, or refused with a message)."""
    from nhil.isa import Program

    man_p, pimb_p = stem.with_suffix(".json"), stem.with_suffix(".pimb")
    if not man_p.exists():
        return None
    try:
        man = json.loads(man_p.read_text())
        if not isinstance(man, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        _refuse(man_p, f"corrupt manifest ({e})", log)
        return None
    if man.get("schema") != SCHEMA or man.get("key") != key or man.get("key_parts") != parts:
        diff = sorted(k for k in set(parts) | set(man.get("key_parts") or {}) if (man.get("key_parts") or {}).get(k) != parts.get(k))
        _refuse(man_p, f"stale: schema {man.get('schema')} (want {SCHEMA}), key parts differ in {diff or ['key']}", log)
        return None
    try:
        blob = pimb_p.read_bytes()
    except OSError as e:
        _refuse(pimb_p, f"corrupt: program file unreadable ({e})", log)
        return None
    if len(blob) != man.get("bytes") or hashlib.sha256(blob).hexdigest() != man.get("sha256"):
        _refuse(pimb_p, f"corrupt: {len(blob)} bytes with sha256 {hashlib.sha256(blob).hexdigest()[:16]}..., manifest says {man.get('bytes')} bytes, "
                        f"{str(man.get('sha256'))[:16]}...", log)
        return None
    try:
        prog = Program.decode(blob, source=str(pimb_p))
    except Exception as e:  # noqa: BLE001 - any decode failure means the entry cannot be used; it is rebuilt
        _refuse(pimb_p, f"corrupt: does not decode ({type(e).__name__}: {e})", log)
        return None
    return prog, man


def cached_compile(key_parts: dict, build_fn: Callable[[], tuple], cache_dir: Path | None = None, log: Callable[[str], None] = _log):
    """The program for ``key_parts``: from the cache, or built by ``build_fn`` and stored.

    Args:
        key_parts: JSON-serialisable dict naming every input of the compile (weights sha256,
            config, quant recipe, device, passes, max cache length, ...); the caller adds
            :func:`toolchain_parts` (``verify_key_parts`` does).
        build_fn: ``() -> (Program, meta: dict[, blob: bytes])`` (``blob``: the program's encoding when
            the builder already has it, else it is encoded here); ``meta`` (JSON-serialisable: e.g. export
            node count, raised primitive counts) is stored and returned on later hits.
        cache_dir: cache folder (default :func:`default_dir`).
        log: where refusal / hit messages go.
    Returns:
        ``(program, meta, info)`` with ``info = {"hit", "key", "path", "bytes", "build_s"?}``; on a
        hit ``meta`` is the stored one.
    Raises:
        SetupError: the lock could not be taken within ``NHIL_CACHE_LOCK_TIMEOUT`` seconds (names the lock file).
        Whatever ``build_fn`` raises (nothing is stored then).
    """
    import time

    from filelock import FileLock, Timeout

    from nhil.errors import SetupError
    from nhil.util import atomic_write_bytes, atomic_write_text

    key = key_of(key_parts)
    d = Path(cache_dir or default_dir()) / key[:2]
    d.mkdir(parents=True, exist_ok=True)
    stem = d / key
    lock = FileLock(str(stem.with_suffix(".lock")), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            got = _load(stem, key, key_parts, log)
            if got is not None:
                prog, man = got
                log(f"program cache: hit {stem.with_suffix('.pimb')} ({man['bytes']:,} bytes)")
                os.utime(stem.with_suffix(".json"))  # recency for pruning
                return prog, man.get("meta", {}), {"hit": True, "key": key, "path": str(stem.with_suffix(".pimb")), "bytes": man["bytes"]}
            t0 = time.perf_counter()
            res = build_fn()
            prog, meta = res[0], res[1]
            blob = res[2] if len(res) > 2 else prog.encode()
            build_s = time.perf_counter() - t0
            atomic_write_bytes(stem.with_suffix(".pimb"), blob)
            man = {"schema": SCHEMA, "key": key, "key_parts": key_parts, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "meta": meta,
                   "build_s": round(build_s, 3), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            atomic_write_text(stem.with_suffix(".json"), json.dumps(man, indent=1, sort_keys=True))
            log(f"program cache: stored {stem.with_suffix('.pimb')} ({len(blob):,} bytes)")
            prune(Path(cache_dir or default_dir()), keep=key, log=log)
            return prog, meta, {"hit": False, "key": key, "path": str(stem.with_suffix(".pimb")), "bytes": len(blob), "build_s": round(build_s, 3)}
    except Timeout:
        raise SetupError(f"program cache: could not lock {lock.lock_file} within {LOCK_TIMEOUT_S:.0f} s (another run holds it; "
                         f"NHIL_CACHE_LOCK_TIMEOUT raises the wait, NHIL_CACHE=0 disables the cache)") from None


def prune(root: Path, keep: str = "", max_bytes: int | None = None, log: Callable[[str], None] = _log) -> list[str]:
    """Delete least recently used programs (manifest mtime; a hit touches it) until the ``.pimb`` files total at most
    ``max_bytes`` (default ``NHIL_CACHE_MAX_GB``, 8 GiB). An entry another run holds the lock of is skipped; ``keep`` is never deleted.

    Returns:
        the keys deleted.
    """
    entries = []
    for man in root.glob("*/*.json"):
        try:
            size = man.with_suffix(".pimb").stat().st_size if man.with_suffix(".pimb").exists() else 0
            entries.append(LruEntry(man.stat().st_mtime, man.stem, size, man.with_suffix(".pimb"), man.with_suffix(".lock"),
                                    # manifest first: a half-deleted entry is a miss, never a corrupt hit
                                    lambda man=man: (man.unlink(missing_ok=True), man.with_suffix(".pimb").unlink(missing_ok=True))))
        except OSError:
            continue
    return prune_lru(entries, MAX_BYTES if max_bytes is None else max_bytes, keep, log, "program cache")


class LruEntry(NamedTuple):
    """One cache entry as :func:`prune_lru` sees it: last use (mtime), key, bytes, shown path, lock file, how to delete it."""

    mtime: float
    key: str
    size: int
    path: Path
    lock: Path
    delete: Callable[[], object]


def prune_lru(entries: list[LruEntry], limit: int, keep: str = "", log: Callable[[str], None] = _log, what: str = "cache") -> list[str]:
    """Delete the least recently used ``entries`` until their sizes total at most ``limit`` bytes (shared by the program
    and the model cache). Each deletion runs under the entry's filelock taken without waiting: an entry another run
    is reading or building is skipped; ``keep`` is never deleted.

    Returns:
        the keys deleted (each logged as ``<what>: pruned <path> (...)``).
    """
    from filelock import FileLock, Timeout

    total = sum(e.size for e in entries)
    gone = []
    for e in sorted(entries, key=lambda e: (e.mtime, e.key)):
        if total <= limit:
            break
        if e.key == keep:
            continue
        try:
            with FileLock(str(e.lock), timeout=0):
                e.delete()
        except Timeout:
            continue
        total -= e.size
        gone.append(e.key)
        log(f"{what}: pruned {e.path} ({e.size:,} bytes; cache over {limit:,} bytes)")
    return gone


def verify_key_parts(model: str, bundle, quant: str, device, max_cache_len: int, passes=None) -> dict:
    """Key parts of ``verify``'s decode program: model name, weights id, config sha256, quant recipe, device, passes, cache length, toolchain.

    Args:
        model: registry name; bundle: its ``ModelBundle`` (``weights_id``: checkpoint file sha256; for seeded
            models the seed plus a sha256 over the state dict's tensors);
        quant: the QUANT recipe; device: the ``DeviceConfig`` compiled for; max_cache_len: KV positions;
        passes: the pipeline's scheduling passes (None: the default pipeline).
    """
    import dataclasses

    from nhil.compiler.pipeline import DEFAULT_PASSES

    cfg = bundle.model.config.to_json_string(use_diff=False)
    weights = bundle.weights_id
    if not str(weights).startswith("sha256:"):  # seeded models: hash the tensors themselves (small), not just the seed
        h = hashlib.sha256()
        for name, t in sorted(bundle.model.state_dict().items()):
            h.update(name.encode() + b"\0" + t.detach().contiguous().cpu().numpy().tobytes())
        weights = f"{weights};sha256:{h.hexdigest()}"
    return {"kind": "decode-program", "model": model, "weights_id": weights, "config_sha256": hashlib.sha256(cfg.encode()).hexdigest(),
            "quant": quant, "device": dataclasses.asdict(device), "passes": list(DEFAULT_PASSES if passes is None else passes), "max_cache_len": int(max_cache_len),
            "source": str(bundle.source), **toolchain_parts()}


def cached_verify_compile(model: str, bundle, quant: str, device, max_cache_len: int, build_fn: Callable[[], tuple], timings: dict, check: Callable,
                          passes=None):
    """``verify``'s compile stages through the cache (or straight ``build_fn`` when ``NHIL_CACHE=0``).

    Args:
        model, bundle, quant, device, max_cache_len: as :func:`verify_key_parts`.
        build_fn: ``() -> (Program, meta, blob)``: export, raise, quantize, lower and encode (timed stages of its own).
        timings: the report's stage timings; a hit adds ``program_cache_load`` (lock, read, sha256, decode).
        check: ``check(name, passed, detail)`` of the report; a hit records ``program_round_trip`` as done when built.
    Returns:
        ``(program, meta, info)``; ``info`` as :func:`cached_compile`'s plus ``enabled`` and ``seconds``.
    """
    import time

    t0 = time.perf_counter()
    if not enabled():
        _log("caches off (NHIL_CACHE=0): the program, the device-numerics reference and the loaded model are built afresh, nothing is stored")
        prog, meta, blob = build_fn()
        return prog, meta, {"enabled": False, "hit": False, "bytes": len(blob), "seconds": round(time.perf_counter() - t0, 3)}
    prog, meta, info = cached_compile(verify_key_parts(model, bundle, quant, device, max_cache_len, passes), build_fn)
    info["enabled"] = True
    info["seconds"] = round(time.perf_counter() - t0, 3)
    if info["hit"]:
        timings["program_cache_load"] = info["seconds"]
        check("program_round_trip", True, f"program from cache entry {info['path']} ({info['bytes']} bytes, sha256 checked on load); "
                                         "its .pimb round trip was checked when the entry was built")
    return prog, meta, info


def cached_tensors(key_parts: dict, build_fn: Callable[[], tuple[dict, dict]], cache_dir: Path | None = None,
                   log: Callable[[str], None] = _log) -> tuple[dict, dict, dict]:
    """Content-addressed float32 arrays (the device-numerics reference's outputs of a verify run).

    An entry is ``<key>.safetensors`` (the arrays) + ``<key>.json`` (schema, key, parts, sha256 and size of the
    tensors file, a JSON ``meta``), written tensors first, manifest last, under the key's filelock; a
    manifest that is unreadable, of another schema or other parts, or a tensors file of another size or sha256,
    is refused with a message and rebuilt. Nothing is unpickled (safetensors + JSON).

    Args:
        key_parts: what the arrays depend on (canonical JSON, :func:`key_of`).
        build_fn: ``() -> (arrays: name -> np.ndarray, meta: JSON-able dict)``.
    Returns:
        ``(arrays, meta, info)`` with ``info = {"hit", "key", "path"}``.
    """
    import hashlib as _h

    import numpy as np
    from filelock import FileLock
    from safetensors.numpy import load as st_load, save as st_save

    from nhil.util import atomic_write_bytes, atomic_write_text

    root = Path(cache_dir) if cache_dir is not None else root_dir() / "references"
    key = key_of(key_parts)
    stem = root / key[:2] / key
    stem.parent.mkdir(parents=True, exist_ok=True)
    tpath, mpath = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    with FileLock(str(stem.with_suffix(".lock")), timeout=LOCK_TIMEOUT_S):
        if mpath.exists():
            why = None
            try:
                man = json.loads(mpath.read_text())
                data = tpath.read_bytes()
                if man.get("schema") != SCHEMA or man.get("key") != key or man.get("parts") != json.loads(json.dumps(key_parts, sort_keys=True, default=str)):
                    why = "stale (other schema or key parts)"
                elif len(data) != man.get("bytes") or _h.sha256(data).hexdigest() != man.get("sha256"):
                    why = "corrupt (size or sha256 differs from its manifest)"
                else:
                    return {k: np.array(v) for k, v in st_load(data).items()}, man.get("meta", {}), {"hit": True, "key": key, "path": str(tpath)}
            except (OSError, ValueError, KeyError) as e:
                why = f"unreadable ({type(e).__name__}: {e})"
            log(f"reference cache entry {tpath} refused: {why}; rebuilding it")
        arrays, meta = build_fn()
        data = st_save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()})
        atomic_write_bytes(tpath, data)
        atomic_write_text(mpath, json.dumps({"schema": SCHEMA, "key": key, "parts": json.loads(json.dumps(key_parts, sort_keys=True, default=str)),
                                             "bytes": len(data), "sha256": _h.sha256(data).hexdigest(), "meta": meta,
                                             "created": _dt.datetime.now(_dt.timezone.utc).isoformat()}, indent=1))
        return arrays, meta, {"hit": False, "key": key, "path": str(tpath)}
