"""Content-addressed cache of a loaded GGUF checkpoint: a second load of the same file reads a safetensors folder.

transformers loads a GGUF by parsing its metadata, dequantizing every tensor to fp32 and building the tokenizer from
the vocabulary arrays (``modeling_gguf_pytorch_utils.py``, ``integrations/gguf/``): ~20 s for SmolLM2-135M's Q4_1
file on two cores, on every run. :func:`cached_gguf_load` keeps the result as transformers itself writes a model
folder (``model.save_pretrained(dir, safe_serialization=True)``: ``config.json``, ``generation_config.json`` and
``model.safetensors``, the safetensors format with a tied embedding stored once; ``tokenizer.save_pretrained(dir)``:
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) and loads it back with ``from_pretrained``.

Key: :func:`nhil.compiler.cache.key_of` (sha256 of canonical JSON) of :func:`key_parts`: the GGUF's sha256, the
transformers, tokenizers, gguf and torch versions, :data:`LOADER_SCHEMA` and the dtype (float32). Layout under
``$NHIL_CACHE_DIR/models`` (default ``~/.cache/nhil/models``)::

    <key[:2]>/<key>/          save_pretrained's files + manifest.json
    <key[:2]>/<key>.lock      filelock held while the entry is checked, loaded or built

The manifest holds the key parts, the bytes and sha256 of every other file, and what a load must give back: the
direct load's ``config.to_json_string(use_diff=False)`` (the program cache key hashes it,
:func:`nhil.compiler.cache.verify_key_parts`), its generation config, attention implementation, model class, tied
parameter names and :func:`nhil.models.load_identity.tokenizer_digest`.

Safety, as in :mod:`nhil.compiler.cache`: check-or-build under the key's filelock; an entry is written to a temporary
folder beside it, manifest last, then renamed into place (:func:`nhil.util.replace_dir`), so a crash never leaves a
folder that looks complete. An entry is **refused with a one-line message and rebuilt** from the GGUF when its
manifest is missing or unreadable, records other key parts (stale), lists other files than the folder holds, a file
has another size or sha256 (corrupt), it does not load, or what it loads differs from the manifest. An entry is
stored only if loading it back gives the direct load bit for bit (:func:`nhil.models.load_identity.differences`), and
the cold load returns that loaded-back model, so the first run and every later one get the same model. Weights are
read into process memory (``from_pretrained(disable_mmap=True)``), not mapped: a later write to the file cannot
change a loaded model. Nothing is unpickled (safetensors + JSON).

What a safetensors folder does not carry, and how the load still gives the direct load's model:

* ``model.hf_quantizer``: transformers' GGUF loader marks the model quantized and ``save_pretrained`` refuses it,
  although the weights are dense fp32 (the llama GGUF path dequantizes every tensor). The marker is set aside while
  saving (:func:`_saveable`); the cached model has none (nhil never calls what it guards: ``.half()``, ``.float()``).
  A model with non-fp32 (packed) parameters is not cached.
* the config fields naming where the file was read (``_name_or_path``: its folder; ``quantization_config``: a
  ``GgufConfig`` with its file name) and ``architectures`` (None from a GGUF, the class name after
  ``save_pretrained``) are set back as a direct load of the path being loaded has them (:func:`_restore`), so the
  config JSON, and the program cache key with it, is the direct load's.

Entries beyond ``NHIL_MODEL_CACHE_MAX_GB`` (default 4 GiB; SmolLM2 takes 0.54 GB) are pruned least recently used
first (:func:`nhil.compiler.cache.prune_lru`, shared with the program cache). ``NHIL_CACHE=0`` bypasses the cache.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from nhil.compiler.cache import LOCK_TIMEOUT_S, LruEntry, enabled, key_of, prune_lru, root_dir
from nhil.models.load_identity import differences, generation_json, ties, tokenizer_digest
from nhil.util import atomic_write_text, file_sha256, log, remove_dir, replace_dir

__all__ = ["LOADER_SCHEMA", "MAX_BYTES", "cached_gguf_load", "default_dir", "key_parts", "prune"]

LOADER_SCHEMA = 1  # bump when what an entry holds or how it is loaded back changes: older entries become stale
MAX_BYTES = int(float(os.environ.get("NHIL_MODEL_CACHE_MAX_GB", 4)) * 2**30)
MANIFEST = "manifest.json"


def default_dir() -> Path:
    """The model cache folder: ``$NHIL_CACHE_DIR/models`` (default ``~/.cache/nhil/models``)."""
    return root_dir() / "models"


def key_parts(gguf_sha256: str) -> dict:
    """What a loaded GGUF depends on: the file's hex sha256, the loading libraries' versions, :data:`LOADER_SCHEMA`, the dtype."""
    from importlib.metadata import version

    import tokenizers
    import torch
    import transformers

    return {"kind": "gguf-model", "gguf_sha256": gguf_sha256, "dtype": "float32", "loader_schema": LOADER_SCHEMA,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "gguf": version("gguf"), "torch": torch.__version__}


def cached_gguf_load(path: Path, gguf_sha256: str, load_fn: Callable[[], tuple], cache_dir: Path | None = None,
                     log: Callable[[str], None] = log) -> tuple:
    """The model and tokenizer of the GGUF at ``path``: from the cache, or from ``load_fn`` and then stored.

    Args:
        path: the GGUF file (a direct load records its folder and name in the config).
        gguf_sha256: hex sha256 of the file (callers have it for ``weights_id``).
        load_fn: ``() -> (model, tokenizer or None)``, the direct load
            (``from_pretrained(folder, gguf_file=name, dtype=torch.float32)``), model in eval mode.
        cache_dir: cache folder (default :func:`default_dir`).
        log: where hit / stored / refused messages go.
    Returns:
        ``(model, tokenizer, info)``: an eval-mode model with float32 parameters, the tokenizer or None, and
        ``info = {"enabled", "hit", "seconds"}`` plus ``"key", "path", "bytes"`` when the cache is on.
    Raises:
        SetupError: the key's lock was not taken within ``NHIL_CACHE_LOCK_TIMEOUT`` seconds (names the lock file).
        Whatever ``load_fn`` raises (nothing is stored then).
    """
    from filelock import FileLock, Timeout

    from nhil.errors import SetupError

    t0 = time.perf_counter()
    if not enabled():
        model, tok = load_fn()
        return model, tok, {"enabled": False, "hit": False, "seconds": round(time.perf_counter() - t0, 3)}
    path = Path(path)
    parts = key_parts(gguf_sha256)
    key = key_of(parts)
    root = Path(cache_dir) if cache_dir is not None else default_dir()
    entry = root / key[:2] / key
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or full cache folder: the direct load, with a message
        log(f"model cache: cannot use {entry.parent} ({type(e).__name__}: {e}); loading {path} directly")
        model, tok = load_fn()
        return model, tok, {"enabled": False, "hit": False, "seconds": round(time.perf_counter() - t0, 3)}
    lock = FileLock(str(entry.parent / f"{key}.lock"), timeout=LOCK_TIMEOUT_S)
    info = {"enabled": True, "key": key, "path": str(entry)}
    try:
        with lock:
            got = _load(entry, parts, path, log)
            if got is not None:
                os.utime(entry / MANIFEST)  # recency for pruning
                log(f"model cache: hit {entry} ({_bytes(got[2]):,} bytes)")
                return got[0], got[1], {**info, "hit": True, "bytes": _bytes(got[2]), "seconds": round(time.perf_counter() - t0, 3)}
            model, tok = load_fn()
            got = _store(entry, parts, path, model, tok, log)
            if got is None:  # not cacheable: the direct load, unchanged (the reason is logged)
                return model, tok, {**info, "hit": False, "bytes": 0, "seconds": round(time.perf_counter() - t0, 3)}
            log(f"model cache: stored {entry} ({_bytes(got[2]):,} bytes)")
            prune(root, keep=key, log=log)
            return got[0], got[1], {**info, "hit": False, "bytes": _bytes(got[2]), "seconds": round(time.perf_counter() - t0, 3)}
    except Timeout:
        raise SetupError(f"model cache: could not lock {lock.lock_file} within {LOCK_TIMEOUT_S:.0f} s (another run holds it; "
                         "NHIL_CACHE_LOCK_TIMEOUT raises the wait, NHIL_CACHE=0 disables the cache)") from None


def prune(root: Path | None = None, keep: str = "", max_bytes: int | None = None, log: Callable[[str], None] = log) -> list[str]:
    """Delete least recently used model entries (manifest mtime; a hit touches it) beyond ``max_bytes`` (default
    :data:`MAX_BYTES`); an entry another run holds the lock of, and ``keep``, stay.

    Returns:
        the keys deleted.
    """
    root = Path(root) if root is not None else default_dir()
    entries = []
    for man in root.glob(f"*/*/{MANIFEST}"):
        entry = man.parent
        try:
            size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
            entries.append(LruEntry(man.stat().st_mtime, entry.name, size, entry, entry.parent / f"{entry.name}.lock",
                                    lambda entry=entry: remove_dir(entry)))
        except OSError:
            continue
    return prune_lru(entries, MAX_BYTES if max_bytes is None else max_bytes, keep, log, "model cache")


def _bytes(man: dict) -> int:
    """Bytes of the entry's files as its manifest lists them (the manifest itself not counted)."""
    return sum(int(f["bytes"]) for f in man["files"].values())


def _refuse(path: Path, why: str, log) -> None:
    log(f"model cache: refusing entry {path}: {why}; rebuilding it from the GGUF")


def _load(entry: Path, parts: dict, path: Path, log):
    """The entry's ``(model, tokenizer, manifest)``, or None: no entry, or refused with a message (the caller rebuilds it)."""
    if not entry.exists():
        return None
    man_p = entry / MANIFEST
    try:
        man = json.loads(man_p.read_text())
        if not isinstance(man, dict):
            raise ValueError(f"a JSON {type(man).__name__}, not an object")
    except FileNotFoundError:
        return _refuse(entry, "no manifest (an unfinished or foreign folder)", log)
    except (OSError, ValueError) as e:
        return _refuse(man_p, f"unreadable manifest ({type(e).__name__}: {e})", log)
    if man.get("schema") != LOADER_SCHEMA:
        return _refuse(man_p, f"stale: manifest schema {man.get('schema')!r}, this nhil writes {LOADER_SCHEMA}", log)
    if man.get("key") != entry.name or man.get("key_parts") != parts:
        had = man.get("key_parts") if isinstance(man.get("key_parts"), dict) else {}
        diff = sorted(k for k in set(parts) | set(had) if had.get(k) != parts.get(k))
        return _refuse(man_p, f"stale: key parts differ in {diff or ['key']}", log)
    bad = _check_files(entry, man)
    if bad is not None:
        return _refuse(entry / bad[0], f"corrupt: {bad[1]}", log)
    try:
        model, tok = _from_folder(entry, man, path)
        why = _mismatch(model, tok, man, path)
    except Exception as e:  # noqa: BLE001 - a folder transformers cannot load (or a manifest missing a field) is rebuilt, never a crash
        return _refuse(entry, f"corrupt: it does not load ({type(e).__name__}: {str(e)[:200]})", log)
    if why:
        return _refuse(entry, f"loads differently than its manifest records: {why}", log)
    return model, tok, man


def _check_files(entry: Path, man: dict) -> tuple[str, str] | None:
    """``(file name, reason)`` of the first file that is missing, extra, of another size or sha256; None if all match."""
    files = man.get("files")
    if not isinstance(files, dict) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str) for f in files.values()):
        return MANIFEST, "the manifest has no table of files with bytes and sha256"
    try:
        present = {p.name for p in entry.iterdir() if p.name != MANIFEST}
        if present != set(files):
            return ".", f"files other than the manifest lists (extra {sorted(present - set(files))}, missing {sorted(set(files) - present)})"
        for name in sorted(files):  # sizes first: a stat each
            if (entry / name).stat().st_size != files[name].get("bytes"):
                return name, f"{(entry / name).stat().st_size:,} bytes, the manifest says {files[name].get('bytes')}"
        for name in sorted(files):
            sha = file_sha256(entry / name)
            if sha != files[name].get("sha256"):
                return name, f"sha256 {sha[:16]}..., the manifest says {str(files[name].get('sha256'))[:16]}..."
    except OSError as e:
        return ".", f"unreadable ({type(e).__name__}: {e})"
    return None


def _from_folder(entry: Path, man: dict, path: Path):
    """transformers' load of the entry (weights read into process memory), config fields restored (:func:`_restore`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # disable_mmap: the file is read into process memory, not mapped, so a later write to it cannot change the model
    model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32, local_files_only=True, disable_mmap=True,
                                                 attn_implementation=man["attn_implementation"])
    tok = AutoTokenizer.from_pretrained(str(entry), local_files_only=True) if man.get("tokenizer") else None
    _restore(model, tok, _direct_config(man, path))
    model.eval()
    return model, tok


def _direct_config(man: dict, path: Path) -> dict:
    """The config dict a direct load of the file at ``path`` gives: the recorded one, the folder and file name it was
    built from replaced by ``path``'s (the same file elsewhere is the same entry)."""
    cfg = json.loads(man["config_json"])
    if cfg.get("_name_or_path") == man["gguf"]["folder"]:
        cfg["_name_or_path"] = str(path.parent)
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("gguf_file") == man["gguf"]["name"]:
        q["gguf_file"] = path.name
    return cfg


def _restore(model, tok, want: dict) -> None:
    """Set the config fields a safetensors round trip changes (``_name_or_path``, ``architectures``,
    ``quantization_config``) to ``want``'s, and the model's and tokenizer's ``name_or_path`` with them."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    cfg = model.config
    cfg.name_or_path = want.get("_name_or_path", "")
    model.name_or_path = cfg.name_or_path
    cfg.architectures = want.get("architectures")
    if isinstance(want.get("quantization_config"), dict):
        cfg.quantization_config = AutoQuantizationConfig.from_dict(want["quantization_config"])
    elif "quantization_config" in vars(cfg):
        del cfg.quantization_config
    if tok is not None:
        tok.name_or_path = cfg.name_or_path


def _mismatch(model, tok, man: dict, path: Path) -> str | None:
    """What the loaded entry has other than its manifest records (class, config, generation config, attention, ties, tokenizer), or None."""
    if type(model).__name__ != man.get("model_class"):
        return f"model class {type(model).__name__}, recorded {man.get('model_class')}"
    got, want = json.loads(model.config.to_json_string(use_diff=False)), _direct_config(man, path)
    if got != want:
        return f"config differs in {sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))}"
    if generation_json(model) != man.get("generation_config"):
        return "generation config differs"
    if model.config._attn_implementation != man.get("attn_implementation"):
        return f"attention implementation {model.config._attn_implementation}, recorded {man.get('attn_implementation')}"
    if ties(model) != man.get("ties"):
        return f"tied parameters {ties(model)}, recorded {man.get('ties')}"
    if tokenizer_digest(tok) != man.get("tokenizer"):
        return "tokenizer differs (definition, vocabulary or probe encodings)"
    return None


def _not_dense(model) -> str | None:
    """Why ``model`` cannot be stored as a plain fp32 folder (a parameter of another dtype: packed GGUF blocks), or None."""
    import torch

    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or type(p.data) is not torch.Tensor:
            return f"parameter {name} is {type(p.data).__name__} {p.dtype}, not a dense float32 tensor"
    return None


@contextlib.contextmanager
def _saveable(model):
    """Within the block ``model`` has no ``hf_quantizer`` and its config no ``quantization_config``, so ``save_pretrained``
    writes the dense fp32 folder; afterwards both are as before (``save_pretrained`` also sets ``config.architectures``)."""
    had, quantizer = "hf_quantizer" in vars(model), vars(model).get("hf_quantizer")
    cfg_vars = dict(vars(model.config))
    if had:
        del model.hf_quantizer
    vars(model.config).pop("quantization_config", None)
    try:
        yield
    finally:
        if had:
            model.hf_quantizer = quantizer
        vars(model.config).clear()
        vars(model.config).update(cfg_vars)


def _store(entry: Path, parts: dict, path: Path, model, tok, log):
    """Write the entry of the direct load ``model`` / ``tok``, load it back and check it; ``(model, tokenizer, manifest)`` of the
    loaded-back entry, or None (not cacheable, logged; the direct load is then used unchanged)."""
    why = _not_dense(model)
    if why:
        log(f"model cache: not caching {path}: {why}")
        return None
    for old in entry.parent.glob(f".{entry.name}.*"):  # leftovers of a crashed build or replace
        shutil.rmtree(old, ignore_errors=True)
    tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
    try:
        man = {"schema": LOADER_SCHEMA, "key": entry.name, "key_parts": parts, "gguf": {"folder": str(path.parent), "name": path.name},
               "model_class": type(model).__name__, "attn_implementation": model.config._attn_implementation, "ties": ties(model),
               "config_json": model.config.to_json_string(use_diff=False), "generation_config": generation_json(model), "tokenizer": tokenizer_digest(tok)}
        t0 = time.perf_counter()
        with _saveable(model):
            model.save_pretrained(str(tmp), safe_serialization=True)
        if tok is not None:
            tok.save_pretrained(str(tmp))
        man["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir())}
        man["save_s"] = round(time.perf_counter() - t0, 3)
        man["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        atomic_write_text(tmp / MANIFEST, json.dumps(man, indent=1, sort_keys=True))  # last: the folder is complete
        replace_dir(tmp, entry)
    except Exception as e:  # noqa: BLE001 - a model transformers cannot save is used uncached, never a crash
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"model cache: not caching {path}: writing {entry} failed ({type(e).__name__}: {str(e)[:200]}); using the direct load")
        return None
    got = _load(entry, parts, path, log)
    why = "it does not load back (above)" if got is None else differences(model, tok, got[0], got[1])
    if why:
        remove_dir(entry)
        log(f"model cache: not caching {path}: entry {entry} loads back other than the direct load ({why}); using the direct load")
        return None
    return got
