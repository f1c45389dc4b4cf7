"""Find the token embedding and the decoder layers of any transformers causal LM.

Golden generation hooks the token embedding and every decoder layer to capture the
per-layer hidden states (the residual stream). No module naming convention is assumed:

* the token embedding is ``model.get_input_embeddings()`` (transformers' own accessor,
  ``PreTrainedModel.get_input_embeddings``), located by identity in ``named_modules()``;
* the decoder layers are the ``nn.ModuleList`` whose length is the config's layer count
  (``num_hidden_layers``, or ``n_layer`` / ``num_layers`` / ``n_layers`` for configs that
  do not alias it, or ``decoder_layers``; the text sub-config of a multimodal config) and whose elements all
  share one class. When several lists qualify (e.g. a list of per-layer rotary tables
  beside the blocks), the one holding the most parameters is the decoder stack: the
  blocks carry the projections. Ties are refused rather than guessed.

The layer outputs are stored under the canonical names ``act.model.embed_tokens`` and
``act.model.layers.{l}`` whatever the module paths are (``docs/golden-format.md``); the
paths themselves go into the golden's metadata for reports.
"""

from __future__ import annotations

import dataclasses

import torch

from nhil.errors import GoldenError

__all__ = ["DecoderStack", "find_decoder_stack", "num_layers_of", "layer_counts_of"]

_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclasses.dataclass
class DecoderStack:
    """The modules whose outputs a golden captures.

    Attributes:
        embedding: the token embedding module (output [B, S, H] fp32).
        embedding_path: its path in ``model.named_modules()`` (e.g. ``model.embed_tokens``,
            ``transformer.wte``, ``model.decoder.embed_tokens``).
        layers: the decoder layers in execution order (each returns the hidden state
            [B, S, H], or a tuple/list whose first element is it).
        layers_path: the ModuleList's path (e.g. ``model.layers``, ``transformer.h``).
    """

    embedding: torch.nn.Module
    embedding_path: str
    layers: list[torch.nn.Module]
    layers_path: str


def layer_counts_of(config) -> set[int]:
    """Every layer count the config names (``num_hidden_layers`` and its aliases, ``decoder_layers``).

    Encoder-decoder families used as a causal LM (BART's ``BartForCausalLM``) alias
    ``num_hidden_layers`` to ``encoder_layers`` while the stack that runs is
    ``decoder_layers`` long, so a list of any of these lengths qualifies.
    """
    counts = set()
    for cfg in _configs(config):
        for key in _LAYER_COUNT_KEYS + ("decoder_layers",):
            v = getattr(cfg, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                counts.add(v)
    return counts


def _configs(config) -> list:
    cfgs = [config] if config is not None else []
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # noqa: BLE001 - a config without a text part: use the config itself
            text = None
        if text is not None and text is not config:
            cfgs.insert(0, text)
    return cfgs


def num_layers_of(config) -> int | None:
    """The decoder layer count of a transformers config (``None`` if it names none).

    Reads ``num_hidden_layers`` (most configs alias their own key to it through
    ``attribute_map``) or ``n_layer`` / ``num_layers`` / ``n_layers``, on the text
    sub-config when the config has one (``PretrainedConfig.get_text_config``).
    """
    for cfg in _configs(config):
        for key in _LAYER_COUNT_KEYS:
            v = getattr(cfg, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _hybrid_stack(m: torch.nn.ModuleList) -> bool:
    """A hybrid model's stack mixes layer classes (OLMo-hybrid: attention and linear-attention decoder layers); it
    counts as a decoder stack when every block is a transformers ``GradientCheckpointingLayer`` (the decoder-layer base)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        return False
    return all(isinstance(c, GradientCheckpointingLayer) for c in m)


def find_decoder_stack(model: torch.nn.Module) -> DecoderStack:
    """The token embedding and decoder layers of ``model`` (see the module docstring).

    Args:
        model: a transformers ``*ForCausalLM`` (any module layout).

    Raises:
        GoldenError: no input embedding, no ModuleList of the config's layer count, or
            two equally large candidates; the message names the model class, what was
            looked for and the candidates found.
    """
    cls = type(model).__name__
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get_emb):
        try:
            emb = get_emb()
        except (NotImplementedError, AttributeError):
            emb = None
    paths = {id(m): p for p, m in model.named_modules()}
    if emb is None or id(emb) not in paths:
        raise GoldenError(
            f"cannot capture the golden of {cls}: model.get_input_embeddings() returns no submodule of the model, "
            "so the token-embedding activation has nothing to hook; the model class must implement get_input_embeddings"
        )
    counts = layer_counts_of(getattr(model, "config", None))
    cands = []
    for path, m in model.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) == 0:
            continue
        if counts and len(m) not in counts:
            continue
        if (len({type(c) for c in m}) != 1 and not _hybrid_stack(m)) or _n_params(m) == 0:
            continue
        cands.append((_n_params(m), path, m))
    if not cands:
        want = f"{' or '.join(map(str, sorted(counts)))} (config layer count)" if counts else "any length (the config names no layer count)"
        raise GoldenError(
            f"cannot capture the golden of {cls}: no torch.nn.ModuleList of {want} identical blocks with parameters "
            "was found, so there are no decoder layers to hook; per-layer hidden states need the decoder blocks in a ModuleList"
        )
    cands.sort(key=lambda c: (-c[0], c[1]))
    if len(cands) > 1 and cands[0][0] == cands[1][0]:
        raise GoldenError(
            f"cannot capture the golden of {cls}: two ModuleLists are equally likely decoder stacks "
            f"({cands[0][1]!r} and {cands[1][1]!r}, {cands[0][0]} parameters each)"
        )
    _, lpath, layers = cands[0]
    return DecoderStack(embedding=emb, embedding_path=paths[id(emb)], layers=list(layers), layers_path=lpath)
