"""Arguments of a run, checked before any work starts (and before any folder is made).

``nhil verify`` used to find a bad argument only after loading and exporting the model
(40-100 s), and some (``TOKENS=0``, an out-of-vocabulary prompt id) ended as a CRASH with a
traceback. :func:`check_verify_args` checks every argument against the registries in
well under a second and raises :class:`UsageError` (its own outcome ``USAGE_ERROR`` and exit
code :data:`EXIT_USAGE`, no report folder, no traceback file):

* names are never paths: model, target, quant recipe and device preset (the board's
  device) must be names of their registries (``nhil.models``, ``nhil.targets``,
  ``nhil.compiler.quantize_recipe``, ``nhil.isa.DEVICE_PRESETS``); a ``/``, ``..``, NUL or any
  character outside :data:`NAME_PATTERN` is refused before a registry lookup;
* the quant recipe parses and fits the model (``native`` needs a GGUF checkpoint);
* the prompt has the model's form (text with a tokenizer, comma-separated ids in
  ``[0, vocab)`` without one);
* ``TOKENS >= 1``, ``REPEAT >= 1``, ``0 <= SEED < 2**63``.

Run folders: :func:`new_run_dir` makes ``<runs>/<UTC stamp>-<model>-<target>[-<quant>]``
from sanitised parts (:func:`safe_component`), unique across runs started in the same
second and across processes (an exclusive ``mkdir``; a taken name gets ``-2``, ``-3``...).
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path

from nhil.errors import NhilError

EXIT_USAGE = 64  # EX_USAGE of sysexits.h: the command was used incorrectly
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_SAFE_RE = re.compile(r"[^A-Za-z0-9._-]")
MAX_SEED = 2**63


class UsageError(NhilError):
    """An argument is wrong (unknown name, bad value, a recipe that does not fit the model).

    Raised before any work starts; the CLI prints it and exits with :data:`EXIT_USAGE`.
    """

    outcome = "USAGE_ERROR"


def _show(value, limit: int = 240) -> str:
    """``repr(value)`` cut at ``limit`` characters (a long path still shows whole; a megabyte of junk does not)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def check_name(kind: str, value, known) -> str:
    """``value`` if it is a plain name (:data:`NAME_PATTERN`) and one of ``known``.

    Args:
        kind: what is named, for the message (``model``, ``target``, ...).
        value: the name given by the user.
        known: iterable of registered names.

    Raises:
        UsageError: not a str, looks like a path (``/``, ``..``, NUL, other characters),
            or not registered; the message lists the registered names.
    """
    names = sorted(known)
    hint = f"registered {kind}s: {', '.join(names)}"
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise UsageError(f"{kind} {_show(value)} is not a {kind} name (names match {NAME_PATTERN}: no '/', '..' or NUL; "
                         f"a name is never a path); {hint}")
    if value not in names:
        raise UsageError(f"unknown {kind} {value!r}; {hint}")
    return value


def safe_component(text: str, limit: int = 64) -> str:
    """``text`` as one file-name component: characters outside ``[A-Za-z0-9._-]`` become ``_``,
    leading dots are dropped, at most ``limit`` characters, never empty."""
    s = _SAFE_RE.sub("_", str(text)).lstrip(".")[:limit]
    return s or "_"


def check_quant(recipe: str, model: str | None = None) -> str:
    """The recipe if it parses (``nhil.compiler.quantize_recipe.parse_recipe``) and fits ``model``.

    Raises:
        UsageError: unknown base or format, malformed override, or ``native`` for a model
            whose registration has no GGUF checkpoint.
    """
    from nhil.compiler.quantize_recipe import parse_recipe
    from nhil.errors import CompileError

    if not isinstance(recipe, str) or "\x00" in recipe or not recipe.strip():
        raise UsageError(f"QUANT {_show(recipe)} is not a recipe (e.g. bf16, mxfp4, int4-g128:lm_head=bf16)")
    try:
        base, overrides = parse_recipe(recipe)
    except CompileError as e:
        raise UsageError(str(e)) from None
    if model is not None and (base == "native" or any(f == "native" for _, f in overrides)):
        from nhil.models.registry import model_info

        info = model_info(model)
        if info is not None and info.checkpoint != "gguf":
            raise UsageError(f"QUANT={recipe!r} keeps a GGUF checkpoint's own blocks, but model {model!r} is not loaded from a GGUF "
                             f"file ({info.description}); use a format recipe such as QUANT=q4_1 or QUANT=mxfp4")
    return recipe


def check_prompt(model: str, prompt: str | None) -> None:
    """Check ``prompt`` has ``model``'s form (see the module docstring); None is the default prompt.

    Raises:
        UsageError: NUL in the prompt, an empty prompt, text for a tokenizer-less model,
            or a token id outside ``[0, vocab)``.
    """
    if prompt is None:
        return
    from nhil.models.registry import model_info

    if not isinstance(prompt, str) or "\x00" in prompt or not prompt.strip():
        raise UsageError(f"PROMPT {_show(prompt)} is empty or not text; leave PROMPT unset for the model's default prompt")
    info = model_info(model)
    if info is None or info.tokenizer is not False:
        return
    try:
        ids = [int(t) for t in prompt.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"model {model!r} has no tokenizer: PROMPT {_show(prompt)} must be comma-separated token ids, e.g. PROMPT=1,2,3") from None
    if not ids:
        raise UsageError(f"PROMPT {_show(prompt)} holds no token ids; e.g. PROMPT=1,2,3")
    if info.vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise UsageError(f"PROMPT token id(s) {bad[:5]} outside the vocabulary [0, {info.vocab_size}) of model {model!r}")


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise UsageError(f"{name}={_show(value)} must be an integer {rng}")


def check_verify_args(opts) -> None:
    """Check a :class:`nhil.verify.VerifyOptions` before any work (module docstring lists what).

    Builds no model and makes no folder; imports only the registries.

    Raises:
        UsageError: the first bad argument, naming it, the allowed values and the fix.
    """
    from nhil.isa.device import DEVICE_PRESETS
    from nhil.targets.registry import target_names

    check_model(opts.model)
    check_name("target", opts.target, target_names())
    if opts.device is not None:
        check_name("device preset", opts.device, DEVICE_PRESETS)
    dev = (opts.target_options or {}).get("device")
    if isinstance(dev, str):
        check_name("device preset", dev, DEVICE_PRESETS)
    check_quant(opts.quant, opts.model)
    _check_int("TOKENS", opts.tokens, 1)
    _check_int("REPEAT", opts.repeat, 1)
    _check_int("SEED", opts.seed, 0, MAX_SEED)
    check_prompt(opts.model, opts.prompt)
    check_sim_threads()


def check_sim_threads() -> None:
    """``NHIL_SIM_THREADS``, when set, is a positive integer (``nhil.targets.sim.kernels.threads`` reads it).

    Raises:
        UsageError: it is set to anything else (names the value and the fix).
    """
    from nhil.util import sim_threads_setting

    try:
        sim_threads_setting()
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_model(model) -> None:
    """A registered model name, or ``--model PATH`` resolved to a file or folder that exists (``nhil.models.from_path``).

    Raises:
        UsageError: neither a registered name nor an existing path (the message names both ways).
    """
    from nhil.models.registry import list_models

    names = list_models()
    if isinstance(model, str) and model not in names and "\x00" not in model and model.strip() == model and model:
        from nhil.models.spec import looks_like_path

        if looks_like_path(model):
            p = Path(model).expanduser().resolve()
            if (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix in (".gguf", ".json")):
                return  # a real model path: the loader checks its contents (weights, shapes) and names the file on error
            why = "no such file or folder" if not p.exists() else "not a Hugging Face folder (no config.json), a .gguf file or a config.json"
            raise UsageError(f"--model {_show(model)} is not a model name, and not a usable path: {why}; give a registered model "
                             f"({', '.join(sorted(names))}) or a path to a Hugging Face folder, a .gguf file or a config.json")
    check_name("model", model, names)


def check_sweep_names(models: str | None, targets: str | None, quants: str | None) -> None:
    """Check the comma-separated ``nhil sweep --models/--targets/--quants`` lists (None: not given).

    Raises:
        UsageError: a name that is not registered or looks like a path; a bad recipe.
    """
    from nhil.models.registry import list_models
    from nhil.targets.registry import target_names

    for m in (models or "").split(","):
        if m.strip():
            check_name("model", m.strip(), list_models())
    for t in (targets or "").split(","):
        if t.strip():
            check_name("target", t.strip(), target_names())
    for q in (quants or "").split(","):
        if q.strip():
            check_quant(q.strip())


def _stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")


def new_run_dir(runs_dir: str | os.PathLike, *parts: str) -> Path:
    """Create and return a fresh run folder ``<runs_dir>/<UTC stamp>-<part>-<part>...``.

    Every part goes through :func:`safe_component` (so ``../x`` or ``/etc`` stay one
    component inside ``runs_dir``). ``mkdir`` without ``exist_ok`` is atomic, so two runs
    started in the same second (in one or several processes) get different folders: the
    second takes ``<name>-2``, then ``-3``...

    Raises:
        OSError: ``runs_dir`` cannot be created or written.
    """
    root = Path(runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    base = "-".join([_stamp(), *(safe_component(p) for p in parts if p)])
    for i in range(1, 10_000):
        d = root / (base if i == 1 else f"{base}-{i}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise OSError(f"no free run folder name for {root / base} after 10000 tries")
