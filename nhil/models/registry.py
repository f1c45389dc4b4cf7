"""Registry of models by standard architecture name.

Each entry builds an eval-mode, fp32 ``transformers`` model plus what a run needs to
know about it (tokenizer, default prompt, weights digest for golden provenance).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

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
    """

    name: str
    model: torch.nn.Module
    tokenizer: object | None
    weights_id: str
    source: str
    default_prompt: str | None = None

    def encode(self, prompt: str | None) -> list[int]:
        """Token ids of ``prompt`` (int64 ids, no batch dim).

        For tokenizer-less tiny models, ``prompt`` may be a comma-separated list of
        ids; ``None`` gives a fixed seeded prompt of 6 ids.
        """
        if self.tokenizer is not None:
            text = prompt if prompt is not None else self.default_prompt
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if prompt is None:
            g = torch.Generator().manual_seed(1234)
            cfg = self.model.config
            text = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg  # multimodal: the text part's vocab
            vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size")
            return torch.randint(0, vocab, (6,), generator=g).tolist()
        try:
            return [int(t) for t in prompt.split(",") if t.strip()]
        except ValueError as e:
            raise SetupError(
                f"model {self.name!r} has no tokenizer: give PROMPT as comma-separated token ids, e.g. PROMPT=1,2,3 ({e})"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (or the ids themselves for tokenizer-less models)."""
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids)


_REGISTRY: dict[str, tuple[Callable[[], ModelBundle], str]] = {}


def register(name: str, description: str):
    """Decorator registering a zero-argument builder returning a :class:`ModelBundle`."""

    def deco(fn: Callable[[], ModelBundle]):
        _REGISTRY[name] = (fn, description)
        return fn

    return deco


def list_models() -> dict[str, str]:
    """Registered names -> one-line descriptions."""
    _load_builtin()
    return {k: v[1] for k, v in sorted(_REGISTRY.items())}


_CACHE: dict[str, ModelBundle] = {}


def get_model(name: str, layers: int | None = None) -> ModelBundle:
    """Build (once per process) and return the model registered as ``name``, or load a path.

    ``name`` may also be a path (``nhil.models.from_path``: a Hugging Face folder, a
    ``.gguf`` file or a bare ``config.json``); ``layers`` keeps its first N decoder layers.

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
    if name not in _CACHE:
        _CACHE[name] = _REGISTRY[name][0]()
    return _CACHE[name]


def _load_builtin() -> None:
    from nhil.models import llama  # noqa: F401  (registers llama, llama-tiny)
    from nhil.models import zoo  # noqa: F401  (registers the tiny seeded zoo: mistral, qwen2, ...)
