"""What makes two loads of a checkpoint the same: the checks :mod:`nhil.models.load_cache` stores an entry and loads it back by.

Two loads are the same when every state-dict tensor and every buffer (the non-persistent ones too, e.g. rotary
``inv_freq``) has the same name, dtype, shape and bytes, the same parameters are tied (one tensor), the class, the
config JSON (``to_json_string(use_diff=False)``, which the program cache key hashes), the generation config and the
attention / experts implementation are equal, and the tokenizers have one :func:`tokenizer_digest`.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["differences", "generation_json", "same_bits", "ties", "tokenizer_digest"]

_PROBES = ("The capital of France is", "Hello, world!\n\tx  y 123", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "")
_TOK_ATTRS = ("chat_template", "model_max_length", "padding_side", "truncation_side", "add_bos_token", "add_eos_token",
              "clean_up_tokenization_spaces", "split_special_tokens")


def tokenizer_digest(tok) -> str | None:
    """Hex sha256 over a tokenizer's definition and behaviour (None for no tokenizer).

    Covers its class, the ``tokenizers`` pipeline JSON (``backend_tokenizer.to_str()``: normalizer, pre-tokenizer,
    model, post-processor, decoder, added tokens), vocabulary, added and special tokens, the attributes in
    ``_TOK_ATTRS`` (chat template, BOS/EOS flags, ...), and the ids and decoded text of a few probe strings.
    """
    if tok is None:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    d = {"class": type(tok).__name__, "backend": backend.to_str() if backend is not None else None,
         "vocab": sorted(tok.get_vocab().items()), "added": sorted((i, repr(t)) for i, t in tok.added_tokens_decoder.items()),
         "special": {k: repr(v) for k, v in tok.special_tokens_map.items()}, "attrs": {a: getattr(tok, a, None) for a in _TOK_ATTRS},
         "probes": [(tok(s)["input_ids"], tok(s, add_special_tokens=False)["input_ids"], tok.decode(tok(s)["input_ids"])) for s in _PROBES]}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=repr).encode()).hexdigest()


def generation_json(model) -> str | None:
    """The model's ``generation_config.to_json_string()`` (None without one): what ``generate`` defaults to."""
    gc = getattr(model, "generation_config", None)
    return gc.to_json_string() if gc is not None else None


def ties(model) -> list[list[str]]:
    """Names of parameters that are one tensor (tied embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight``)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (compared as uint8: -0.0 is not 0.0, and a NaN equals only the same NaN)."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                                                                     b.detach().reshape(-1).contiguous().view(torch.uint8))


def differences(a, ta, b, tb) -> str | None:
    """The first way model ``b`` / tokenizer ``tb`` differ from ``a`` / ``ta``: state-dict tensors and buffers (names, dtypes,
    shapes, bits), tied parameters, class, config JSON, generation config, attention and experts implementation, tokenizer digest."""
    for what, x, y in (("state-dict", a.state_dict(), b.state_dict()), ("buffer", dict(a.named_buffers()), dict(b.named_buffers()))):
        if list(x) != list(y):
            return f"{what} names differ ({sorted(set(x) ^ set(y))[:3]} ...)"
        for k in x:
            if not same_bits(x[k], y[k]):
                return f"{what} tensor {k} differs"
    checks = (("tied parameters", ties), ("class", lambda m: type(m).__name__), ("config JSON", lambda m: m.config.to_json_string(use_diff=False)),
              ("generation config", generation_json), ("attention", lambda m: (m.config._attn_implementation, getattr(m.config, "_experts_implementation", None))))
    for what, f in checks:
        if f(a) != f(b):
            return f"{what} differs"
    if tokenizer_digest(ta) != tokenizer_digest(tb):
        return "tokenizer differs"
    return None
