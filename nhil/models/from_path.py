"""``--model PATH``: bring your own checkpoint, GGUF file or bare config.

Three kinds of PATH (:func:`load_model_path`):

* a **Hugging Face folder**: ``config.json`` + ``*.safetensors`` (sharded or not, as
  ``save_pretrained`` writes them), tokenizer files if present. A pre-quantized checkpoint
  (``quantization_config``: compressed-tensors, ``fp8``) is dequantized by its producer's code
  for the fp32 model and its shipped tensors kept for ``QUANT=native`` (:mod:`nhil.models.prequant`). Loaded with
  ``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)`` in fp32; every
  parameter must come from the checkpoint (a missing or shape-mismatched tensor is an
  error, never a silent random init).
* a **``.gguf`` file**: loaded by transformers' GGUF reader (``gguf_file=``), which
  dequantizes to fp32 and undoes llama.cpp's q/k row permutation
  (``transformers/modeling_gguf_pytorch_utils.py``); the tokenizer comes from the same file
  when it carries one. A second load of the same file (by content) comes from the model
  cache (:mod:`nhil.models.load_cache`, bit-identical; ``NHIL_CACHE=0`` disables it).
* a bare **``config.json``**: the model is built from the config with seeded random
  weights (:mod:`nhil.models.seeding`), so bring-up starts the day a config is published.

``layers=N`` keeps the first N decoder layers (the config's layer count and every
per-layer list of that length, e.g. ``layer_types``, are cut to N; a checkpoint's
weights of later layers are not loaded). Nothing is fetched from a hub.

Every bad input is a :class:`nhil.errors.SetupError` (LOAD_FAIL) naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from nhil.errors import SetupError
from nhil.models.prequant import check_against_dense, load_dense_config, quant_config_of, read_native
from nhil.models.registry import ModelBundle
from nhil.models.spec import looks_like_path, model_label  # noqa: F401  (part of this module's interface)

__all__ = ["looks_like_path", "model_label", "load_model_path", "MAX_SEEDED_PARAMS"]

# a config-only model bigger than this (fp32: 4 bytes each) is refused with the --layers hint
MAX_SEEDED_PARAMS = int(os.environ.get("NHIL_MAX_SEEDED_PARAMS", 2_000_000_000))
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
KINDS = "a registered name (`nhil models`), a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a config.json"


def _sha256_files(paths: list[Path], known: dict[Path, str] | None = None) -> str:
    """sha256 over ``name:sha256`` lines of the files (sorted); ``known``: file sha256s already computed."""
    from nhil.util import file_sha256

    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(f"{p.name}:{(known or {}).get(p) or file_sha256(p)}\n".encode())
    return h.hexdigest()


def _read_config(path: Path):
    """The transformers config object of a config.json (validated model_type, causal-LM class known)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise SetupError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SetupError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the file") from None
    if not isinstance(d, dict):
        raise SetupError(f"{path} holds a JSON {type(d).__name__}, not a config object; give a transformers config.json")
    from transformers import PretrainedConfig

    d = PretrainedConfig._decode_special_floats(d)  # {"__float__": "Infinity"} as to_json_string writes it (Mamba-2 time_step_limit)
    mt = d.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise SetupError(f"{path} has no \"model_type\" key; add the transformers model type (e.g. \"llama\") to the config")
    if mt not in CONFIG_MAPPING:
        import transformers

        close = sorted(k for k in CONFIG_MAPPING.keys() if k[:3] == mt[:3])[:6]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise SetupError(
            f"{path}: unknown model_type {mt!r}: transformers {transformers.__version__} has no such architecture{hint}; "
            "fix model_type or install a transformers release that has it"
        )
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise SetupError(f"{path}: model_type {mt!r} has no causal-LM class in transformers (AutoModelForCausalLM); nhil verifies decoder-only causal LMs")
    try:
        cfg = CONFIG_MAPPING[mt].from_dict(d)
    except Exception as e:  # noqa: BLE001 - config classes validate in their own ways
        raise SetupError(f"{path}: transformers refuses this {mt} config: {type(e).__name__}: {str(e)[:300]}; fix the field it names") from None
    # MoE experts as batched matmuls: transformers' default per-expert loop has data-dependent
    # guards that torch.export refuses (as for the zoo's MoE entries); no effect on dense models
    cfg._experts_implementation = "batched_mm"
    return cfg


def _cut_layers(config, layers: int, where: Path) -> int:
    """Set the config's decoder layer count to ``layers`` and cut every per-layer list; returns the old count."""
    from nhil.golden.decoder_stack import num_layers_of

    cfg = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    old = num_layers_of(cfg)
    if old is None:
        raise SetupError(f"{where}: --layers needs a layer count in the config (num_hidden_layers), and this config names none")
    if not 1 <= layers <= old:
        raise SetupError(f"--layers {layers}: {where} has {old} decoder layers; give 1..{old}")
    for key, v in list(vars(cfg).items()):
        if isinstance(v, (list, tuple)) and len(v) == old and key not in ("architectures",):
            setattr(cfg, key, type(v)(v[:layers]))
    cfg.num_hidden_layers = layers
    return old


def _tokenizer(folder: Path, **kw):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kw)
    except Exception as e:  # noqa: BLE001
        raise SetupError(f"{folder}: the tokenizer files do not load ({type(e).__name__}: {str(e)[:200]}); fix or remove them (prompts are then token ids)") from None


def _load_folder(folder: Path, layers: int | None) -> ModelBundle:
    from transformers import AutoModelForCausalLM

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SetupError(f"{folder} has no config.json; a Hugging Face model folder holds config.json and *.safetensors (save_pretrained writes both)")
    config = _read_config(cfg_path)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        bins = sorted(folder.glob("*.bin"))
        extra = f" (it has {bins[0].name}: convert it to safetensors; nhil never unpickles weights)" if bins else ""
        raise SetupError(f"{folder} has config.json but no *.safetensors weights{extra}; "
                         f"for seeded random weights give the config alone: --model {cfg_path}")
    if layers is not None:
        _cut_layers(config, layers, cfg_path)
    qcfg = quant_config_of(cfg_path)  # a pre-quantized checkpoint: its tensors read (and checked) before transformers sees them
    native = read_native(folder, qcfg, config) if qcfg else None
    extra = {"quantization_config": load_dense_config(qcfg)} if qcfg else {}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), config=config, dtype=torch.float32, local_files_only=True,
            output_loading_info=True, ignore_mismatched_sizes=True, **extra)
    except Exception as e:  # noqa: BLE001 - safetensors / transformers raise many types
        raise SetupError(f"{folder}: loading the checkpoint failed: {type(e).__name__}: {str(e)[:300]}") from None
    bad = sorted(info.get("mismatched_keys") or [], key=lambda t: t[0])
    if bad:
        k, ckpt, want = bad[0]
        raise SetupError(
            f"{folder}: {len(bad)} tensor(s) in *.safetensors disagree with config.json, e.g. {k}: checkpoint {list(ckpt)} vs config {list(want)}; "
            "the config does not describe these weights: fix config.json (or use the config the checkpoint was saved with)")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SetupError(f"{folder}: {len(missing)} weight(s) the config needs are missing from *.safetensors, e.g. {missing[0]}; "
                         "the checkpoint is incomplete or for another config (nhil never fills weights with random values)")
    model.eval()
    if native is not None:
        check_against_dense(native, model)
    tok = _tokenizer(folder) if any((folder / f).exists() for f in _TOKENIZER_FILES) else None
    wid = "sha256:" + _sha256_files(weights + [cfg_path]) + (f";layers:{layers}" if layers is not None else "")
    return ModelBundle(name=model_label(str(folder)), model=model, tokenizer=tok, weights_id=wid, source=str(folder),
                       default_prompt="The capital of France is" if tok is not None else None, native=native)


def _truncate_loaded(model: torch.nn.Module, layers: int, where: Path) -> None:
    """Keep the first ``layers`` decoder layers of a loaded model (its ModuleList and config)."""
    from nhil.golden.decoder_stack import find_decoder_stack

    stack = find_decoder_stack(model)
    _cut_layers(model.config, layers, where)
    parent_path, _, attr = stack.layers_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, torch.nn.ModuleList(stack.layers[:layers]))


def _load_gguf_direct(path: Path):
    """transformers' load of the GGUF (config and weights from one parse) and its tokenizer (None if the file has none)."""
    from transformers import AutoModelForCausalLM

    from nhil.models.gguf_once import parsed_once

    try:
        with parsed_once():  # config and weights from one parse of the file
            model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                               local_files_only=True, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises ValueError/KeyError/struct errors
        msg = str(e)[:300]
        fix = "check that the file is a complete GGUF written by llama.cpp or gguf-py"
        if "not supported" in msg.lower():
            fix = "transformers' GGUF reader does not know this architecture; convert the model to a Hugging Face folder (config.json + safetensors)"
        raise SetupError(f"{path}: cannot load the GGUF: {type(e).__name__}: {msg}; {fix}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SetupError(f"{path}: {len(missing)} weight(s) the model needs are not in the GGUF, e.g. {missing[0]}; "
                         "the file is incomplete or its metadata describes another model (nhil never fills weights with random values)")
    model.eval()
    tok = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception:  # noqa: BLE001 - a GGUF without tokenizer metadata: prompts are token ids
        tok = None
    return model, tok


def _load_gguf(path: Path, layers: int | None) -> ModelBundle:
    """A GGUF through the model cache (:mod:`nhil.models.load_cache`: the whole file's model, cut to ``layers`` after)."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise SetupError(f"loading {path} needs the gguf package: pip install gguf ({e})") from None
    from nhil.models.load_cache import cached_gguf_load
    from nhil.util import file_sha256

    sha = file_sha256(path)
    model, tok, info = cached_gguf_load(path, sha, lambda: _load_gguf_direct(path))
    if layers is not None:
        _truncate_loaded(model, layers, path)
    model.eval()
    wid = "sha256:" + _sha256_files([path], {path: sha}) + (f";layers:{layers}" if layers is not None else "")
    return ModelBundle(name=model_label(str(path)), model=model, tokenizer=tok, weights_id=wid, source=str(path),
                       default_prompt="The capital of France is" if tok is not None else None, load=info)


def _load_config_only(path: Path, layers: int | None, seed: int) -> ModelBundle:
    from transformers import AutoModelForCausalLM

    from nhil.models.seeding import seed_weights, std_for_hidden

    config = _read_config(path)
    if layers is not None:
        _cut_layers(config, layers, path)
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as e:  # noqa: BLE001 - the modeling code refuses the config
        raise SetupError(f"{path}: transformers cannot build a model from this config: {type(e).__name__}: {str(e)[:300]}") from None
    if n > MAX_SEEDED_PARAMS:
        raise SetupError(f"{path}: the model has {n / 1e9:.1f} G parameters ({4 * n / 2**30:.0f} GiB in fp32), more than the "
                         f"{MAX_SEEDED_PARAMS / 1e9:.1f} G that seeded weights are built for; keep fewer decoder layers (--layers 2) "
                         "or raise NHIL_MAX_SEEDED_PARAMS")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    std = std_for_hidden(getattr(text, "hidden_size", 64) or 64)
    suffix = seed_weights(model, std)
    model.eval()
    cfg_digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    wid = f"seed:{seed};std:{std:.4g};config:{cfg_digest}" + (f";layers:{layers}" if layers is not None else "") + suffix
    return ModelBundle(name=model_label(str(path)), model=model, tokenizer=None, weights_id=wid, source=f"{path} (seeded random weights)")


def load_model_path(spec: str, layers: int | None = None, seed: int = 0) -> ModelBundle:
    """Load ``--model PATH`` (see the module docstring) as an eval-mode fp32 :class:`ModelBundle`.

    Args:
        spec: folder, ``.gguf`` file or ``config.json`` path.
        layers: keep the first N decoder layers (1 <= N <= the config's count).
        seed: seed of the random weights (config-only models).

    Raises:
        SetupError: no such path; a folder without config.json or safetensors; invalid
            JSON, no or unknown ``model_type``, no causal-LM class; weights missing from
            or shaped differently than the config; an unreadable GGUF; a config-only
            model too large to build (each names the file and the fix).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(spec)
    if not p.exists():
        raise SetupError(f"--model {spec}: no such file or folder; give {KINDS}")
    if layers is not None and (not isinstance(layers, int) or layers < 1):
        raise SetupError(f"--layers must be a positive integer, got {layers!r}")
    if p.is_dir():
        return _load_folder(p, layers)
    if p.suffix == ".gguf":
        return _load_gguf(p, layers)
    if p.suffix == ".json":
        return _load_config_only(p, layers, seed)
    raise SetupError(f"--model {spec}: a file that is neither .gguf nor .json; give {KINDS}")
