"""Registry of models by standard architecture name.

Each entry builds an eval-mode, fp32 ``transformers`` model plus what a run needs to
know about it (tokenizer, default prompt, weights digest for golden provenance).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where a model is built: the registry itself is read in nhil.args without it
    import torch


from nhil.errors import SetupError


@dataclasses.dataclass
class ModelBundle:
    """A loaded model and its provenance.

    Attributes:
        name: registry name (``llama``, ``llama-tiny``).
        model: ``transformers`` causal LM in eval mode, fp32 weights.
        tokenizer: its tokenizer, or ``None`` for seeded tiny configs (prompts are token ids).
        weights_id: identity of the weights: sha256 of the checkpoint file (real models)
            or ``"seed:<n>"`` for seeded tiny configs.
        source: human-readable origin (file path or config description).
        default_prompt: prompt text (real models) or ``None``.
        native: for a pre-quantized checkpoint, its shipped tensors
            (:class:`nhil.models.prequant.NativeWeights`, what ``QUANT=native`` keeps); else ``None``.
        load: for a GGUF, how the model cache served the load (``nhil.models.load_cache.cached_gguf_load``'s
            ``info``: enabled, hit, seconds, key, path, bytes); else ``None``.
    """

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    weights_id: str
    source: str
    default_prompt: str | None = None
    native: object | None = None
    load: dict | None = None

    def encode(self, prompt: str | None) -> list[int]:
        """Token ids of ``prompt`` (int64 ids, no batch dim).

        For tokenizer-less tiny models, ``prompt`` may be a comma-separated list of
        ids; ``None`` gives a fixed seeded prompt of 6 ids.
        """
        if self.tokenizer is not None:
            text = prompt if prompt is not None else self.default_prompt
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if prompt is None:
            import torch

            g = torch.Generator().manual_seed(1234)
            cfg = self.model.config
            text = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg  # multimodal: the text part's vocab
            vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size")
            return torch.randint(0, vocab, (6,), generator=g).tolist()
        try:
            ids = [int(t) for t in prompt.split(",") if t.strip()]
        except ValueError as e:
            raise SetupError(
                f"model {self.name!r} has no tokenizer: give PROMPT as comma-separated token ids, e.g. PROMPT=1,2,3 ({e})"
            ) from None
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        bad = [t for t in ids if t < 0 or (vocab and t >= vocab)]
        if not ids or bad:
            raise SetupError(f"PROMPT={prompt!r} for model {self.name!r}: " + (f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})" if bad else "no token ids")
                             + "; give comma-separated ids, e.g. PROMPT=1,2,3")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (or the ids themselves for tokenizer-less models)."""
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a run can know about a registered model without building it (``nhil.args``).

    Attributes:
        name: registry name.
        description: one line (``nhil models``).
        tokenizer: True if prompts are text (the bundle has a tokenizer); False if they are
            comma-separated token ids; None if the registration did not say.
        vocab_size: token ids must be in ``[0, vocab_size)``; None if unknown until built.
        checkpoint: ``"gguf"`` if the weights come from a GGUF file (``QUANT=native`` fits),
            None otherwise.
    """

    name: str
    description: str
    tokenizer: bool | None = None
    vocab_size: int | None = None
    checkpoint: str | None = None


_REGISTRY: dict[str, tuple[Callable[..., ModelBundle], str]] = {}
_INFO: dict[str, ModelInfo] = {}


def register(name: str, description: str, *, tokenizer: bool | None = None, vocab_size: int | None = None, checkpoint: str | None = None):
    """Decorator registering a builder returning a :class:`ModelBundle`.

    A builder of seeded weights (the tiny configs) takes ``seed: int``; a real checkpoint's takes no argument.

    The keyword facts (see :class:`ModelInfo`) let ``nhil.args`` check a prompt and a
    quant recipe before the model is built; omitted facts are checked after loading.
    """

    def deco(fn: Callable[[], ModelBundle]):
        _REGISTRY[name] = (fn, description)
        _INFO[name] = ModelInfo(name, description, tokenizer, vocab_size, checkpoint)
        return fn

    return deco


def model_info(name: str) -> ModelInfo | None:
    """The :class:`ModelInfo` of registered ``name`` (None if not registered); builds nothing."""
    _load_builtin()
    return _INFO.get(name)


def list_models() -> dict[str, str]:
    """Registered names -> one-line descriptions."""
    _load_builtin()
    return {k: v[1] for k, v in sorted(_REGISTRY.items())}


_CACHE: dict = {}  # (name, seed) or "path\0layers" -> ModelBundle


def is_seeded(name: str) -> bool:
    """Does the builder of ``name`` draw seeded weights (takes ``seed``)? False for real checkpoints."""
    import inspect

    _load_builtin()
    return name in _REGISTRY and "seed" in inspect.signature(_REGISTRY[name][0]).parameters


def get_model(name: str, seed: int | None = None, layers: int | None = None) -> ModelBundle:
    """Build (once per process and seed) and return the model registered as ``name``, or load a path.

    Args:
        name: a registry name, or a path (``nhil.models.from_path``: a Hugging Face folder, a
            ``.gguf`` file or a bare ``config.json``).
        seed: weight seed of a seeded tiny model (default 0; ``weights_id`` records it as
            ``seed:<n>``); ignored by real checkpoints, whose weights are the file's.
        layers: for a path, keep its first N decoder layers.
    Raises:
        SetupError: unknown name (lists the known ones), a missing weights package, a bad
            path (names the file and the fix), or ``layers`` given for a registered name.
    """
    _load_builtin()
    if name not in _REGISTRY:
        from nhil.models.from_path import load_model_path, looks_like_path

        if looks_like_path(name):
            key = f"{name}\0{layers}"
            if key not in _CACHE:
                _CACHE[key] = load_model_path(name, layers)
            return _CACHE[key]
        raise SetupError(f"unknown model {name!r}; registered: {', '.join(sorted(_REGISTRY))} (see `nhil models`), or a path: a Hugging Face folder (config.json + *.safetensors), a .gguf file or a config.json")
    if layers is not None:
        raise SetupError(f"--layers applies to --model PATH only; {name!r} is a registered model with its own layer count")
    key = (name, int(seed or 0)) if is_seeded(name) else (name, None)
    if key not in _CACHE:
        fn = _REGISTRY[name][0]
        _CACHE[key] = fn(seed=key[1]) if key[1] is not None else fn()
    return _CACHE[key]


def _load_builtin() -> None:
    from nhil.models import llama  # noqa: F401  (registers llama, llama-tiny)
    from nhil.models import zoo  # noqa: F401  (registers the tiny seeded zoo: mistral, qwen2, ...)
