"""The layout a golden's tensors must have, checked when it is written and when it is loaded.

A golden written by ``nhil.golden.generate.generate_golden`` holds (``docs/golden-format.md``):

* ``prompt_ids`` int64 [P] (P = len of the ``prompt_ids`` metadata JSON list);
* ``tokens`` int64 [T] (T = ``n_tokens``), each in ``[0, V)``;
* ``logits`` float32 [T, V] (V = ``vocab_size``);
* ``act.model.embed_tokens`` and ``act.model.layers.{0..L-1}`` float32 [P+T-1, H]
  (L = ``num_layers``, H = ``hidden_size``).

:func:`check_loaded` checks every tensor that is present against every metadata key that
is present (so small hand-made goldens still load), and, when the caller gives the
model's sizes (:func:`golden_shapes`), that ``logits`` and ``tokens`` exist and the sizes
are the model's: a golden of another shape is a LOAD_FAIL at the golden stage, not a
CRASH in the compare stage. :func:`check_writable` refuses what the loader could not read
back: the name ``__metadata__`` (safetensors reserves it for the metadata map) and
logits or hidden states in another dtype than float32 (a bf16/fp16 golden would
silently round the reference).
"""

from __future__ import annotations

import json
import re
from typing import Mapping

import torch

from nhil.errors import GoldenError

RESERVED_NAMES = frozenset({"__metadata__"})
_LAYER_RE = re.compile(r"act\.model\.layers\.(\d+)")
_FP32_NAMES = ("logits", "act.")


def _shape(t: torch.Tensor) -> list[int]:
    return [int(s) for s in t.shape]


def check_writable(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse tensors a golden must not hold (module docstring).

    Raises:
        GoldenError: an empty or reserved name, or ``logits`` / ``act.*`` not float32.
    """
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name in RESERVED_NAMES:
            raise GoldenError(f"golden tensor name {name!r} is reserved or empty (safetensors keeps '__metadata__' for the metadata map); rename the tensor")
        if isinstance(t, torch.Tensor) and (name == "logits" or name.startswith("act.")) and t.dtype != torch.float32:
            raise GoldenError(f"golden tensor {name!r} is {t.dtype}, but goldens store logits and hidden states in float32 "
                              f"(docs/golden-format.md); pass the fp32 values (tensor.float() before any rounding)")


def _int_meta(meta: Mapping[str, str], key: str) -> int | None:
    v = meta.get(key)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def golden_shapes(model: torch.nn.Module) -> dict[str, int]:
    """``vocab_size`` (rows of the output embedding), ``num_layers`` and ``hidden_size`` of
    ``model``, computed as ``generate_golden`` records them; keys it cannot find are left out."""
    from nhil.errors import GoldenError
    from nhil.golden.decoder_stack import find_decoder_stack

    out: dict[str, int] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        out["vocab_size"] = int(head.weight.shape[0])
    try:
        out["num_layers"] = len(find_decoder_stack(model).layers)
    except (GoldenError, ValueError, AttributeError, TypeError):
        pass
    h = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(h, int):
        out["hidden_size"] = h
    return out


def check_loaded(path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], shapes: Mapping[str, int] | None = None) -> None:
    """Check ``tensors`` against ``meta`` (and the model's ``shapes``, if given).

    Args:
        path: the golden file (for messages).
        tensors: name -> tensor as loaded.
        meta: the file's metadata.
        shapes: the model's ``vocab_size`` / ``num_layers`` / ``hidden_size``
            (:func:`golden_shapes`); given, ``logits`` and ``tokens`` are required.

    Raises:
        GoldenError: naming the file, the tensor, its shape/dtype, what the metadata (or the
            model) says, and the fix (regenerate).
    """
    from nhil.golden.store import REGEN_HINT

    def bad(what: str) -> GoldenError:
        return GoldenError(f"golden {path} is malformed or stale: {what}; regenerate it: {REGEN_HINT}")

    if shapes:
        missing = [n for n in ("tokens", "logits") if n not in tensors]
        if missing:
            raise bad(f"tensor(s) {missing} missing (a verify golden holds prompt_ids, tokens, logits and act.* hidden states)")
        for key, want in shapes.items():
            have = _int_meta(meta, key)
            if have is not None and have != want:
                raise bad(f"its metadata {key} is {have} but the model's is {want}")
    T = _int_meta(meta, "n_tokens")
    V = _int_meta(meta, "vocab_size") or (shapes or {}).get("vocab_size")
    H = _int_meta(meta, "hidden_size") or (shapes or {}).get("hidden_size")
    L = _int_meta(meta, "num_layers") or (shapes or {}).get("num_layers")
    P = None
    try:
        P = len(json.loads(meta["prompt_ids"])) if "prompt_ids" in meta else None
    except (ValueError, TypeError):
        raise bad(f"metadata prompt_ids {meta.get('prompt_ids')!r:.80} is not a JSON list") from None

    for name, t in tensors.items():
        if (name == "logits" or name.startswith("act.")) and t.dtype != torch.float32:
            raise bad(f"tensor {name!r} is {t.dtype}, goldens hold float32 {name}")
    if "prompt_ids" in tensors:
        t = tensors["prompt_ids"]
        if t.dtype != torch.int64 or t.dim() != 1 or (P is not None and t.shape[0] != P):
            raise bad(f"tensor 'prompt_ids' is {t.dtype} {_shape(t)}, expected int64 [{P if P is not None else 'P'}]")
    if "tokens" in tensors:
        t = tensors["tokens"]
        if t.dtype != torch.int64 or t.dim() != 1 or (T is not None and t.shape[0] != T):
            raise bad(f"tensor 'tokens' is {t.dtype} {_shape(t)}, expected int64 [{T if T is not None else 'T'}] (n_tokens)")
        if V is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
            raise bad(f"tensor 'tokens' holds ids outside the vocabulary [0, {V})")
    if "logits" in tensors:
        t = tensors["logits"]
        if t.dim() != 2 or (T is not None and t.shape[0] != T) or (V is not None and t.shape[1] != V):
            raise bad(f"tensor 'logits' has shape {_shape(t)}, expected [n_tokens, vocab_size] = [{T if T is not None else 'T'}, {V if V is not None else 'V'}]")
    layers = sorted(int(m.group(1)) for n in tensors if (m := _LAYER_RE.fullmatch(n)))
    if layers and (layers != list(range(len(layers))) or (L is not None and len(layers) != L)):
        raise bad(f"hidden states of layers {layers[:8]}{'...' if len(layers) > 8 else ''}, expected layers 0..{(L or len(layers)) - 1} (num_layers {L})")
    rows = P + T - 1 if P is not None and T is not None else None
    for name, t in tensors.items():
        if name.startswith("act.model."):
            if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (H is not None and t.shape[1] != H):
                raise bad(f"tensor {name!r} has shape {_shape(t)}, expected [prompt + n_tokens - 1, hidden_size] = "
                          f"[{rows if rows is not None else 'P+T-1'}, {H if H is not None else 'H'}]")


def why_not_comparable(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> str | None:
    """None if the two goldens' ``logits`` can be compared element by element (``nhil golden
    --regen``), else why not (a tensor missing, or shapes/dtypes that differ)."""
    a, b = old.get("logits"), new.get("logits")
    if a is None or b is None:
        return "the old golden has no logits" if a is None else "the new golden has no logits"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"old logits are {a.dtype} {_shape(a)}, new ones {b.dtype} {_shape(b)}: another prompt, token count or vocabulary"
    return None
