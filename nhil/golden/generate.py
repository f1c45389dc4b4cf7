"""Golden generation: PyTorch eager fp32 on the original model.

Two passes (shapes for prompt length P, generated tokens T, hidden H, vocab V):

1. Greedy ``model.generate`` (``do_sample=False``, ``max_new_tokens=T``, EOS ignored so
   exactly T tokens come out) gives the golden tokens.
2. One teacher-forced forward over ``prompt_ids + tokens[:-1]`` (length P+T-1, no KV
   cache) with forward hooks on the token embedding and every decoder layer, found from
   the model itself with no naming convention (``nhil.golden.decoder_stack``:
   ``get_input_embeddings()`` and the ModuleList of the config's layer count), gives the
   per-position activations and the logits.

Teacher forcing is what targets are compared against: every step sees the golden prefix,
so one wrong token does not make all later steps incomparable (vLLM
``check_logprobs_close`` stops at the first divergence for the same reason).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from nhil.errors import GoldenError
from nhil.golden.decoder_stack import find_decoder_stack

__all__ = ["generate_golden", "config_hash", "act_name"]


def act_name(module_path: str) -> str:
    """Golden tensor name of a module's output activation, e.g. ``act.model.layers.3``."""
    return f"act.{module_path}"


def config_hash(model: torch.nn.Module) -> str:
    """sha256 hex of ``model.config.to_json_string()`` (identifies the architecture config)."""
    return hashlib.sha256(model.config.to_json_string().encode("utf-8")).hexdigest()


def _first_tensor(out: Any, where: str) -> torch.Tensor:
    # decoder layers return a tensor in transformers 5; older versions and some families return (hidden, ...)
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise GoldenError(f"cannot capture the golden: {where} returned a {type(out).__name__}, not a hidden-state tensor (or a tuple starting with one)")


@torch.no_grad()
def _teacher_forced(model, stack, ids: torch.Tensor, tokens: torch.Tensor, cls: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One no-cache forward over ``prompt + tokens[:-1]`` [1, P+T-1]: per-layer hidden states (hooked) and the
    logits [T, V] fp32 that predict ``tokens``.

    Raises:
        GoldenError: the forward failed, or a hooked module's output is not [1, P+T-1, hidden].
    """
    P, T = ids.shape[1], tokens.numel()
    captured: dict[str, torch.Tensor] = {}
    S = P + T - 1

    def hook(name: str, where: str):
        def fn(_module, _inp, output):
            h = _first_tensor(output, where)
            if h.dim() != 3 or h.shape[0] != 1 or h.shape[1] != S:
                raise GoldenError(f"cannot capture the golden: {where} returned shape {tuple(h.shape)}, expected [1, {S}, hidden] (token-major hidden state)")
            captured[name] = h[0].detach().to(torch.float32).clone()

        return fn

    handles = [stack.embedding.register_forward_hook(hook(act_name("model.embed_tokens"), f"token embedding {stack.embedding_path!r}"))]
    for i, layer in enumerate(stack.layers):
        handles.append(layer.register_forward_hook(hook(act_name(f"model.layers.{i}"), f"decoder layer {stack.layers_path}.{i} ({type(layer).__name__})")))
    try:
        full = torch.cat([ids[0], tokens[:-1]]).unsqueeze(0)
        fwd = model(input_ids=full, attention_mask=torch.ones_like(full), use_cache=False)
    except GoldenError:
        raise
    except Exception as e:  # noqa: BLE001 - as for generate
        raise GoldenError(f"cannot generate the golden: eager {cls} forward (teacher-forced, no cache) failed: {type(e).__name__}: {str(e)[:300]}") from e
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in [act_name("model.embed_tokens")] + [act_name(f"model.layers.{i}") for i in range(len(stack.layers))] if n not in captured]
    if missing:
        raise GoldenError(f"cannot capture the golden of {cls}: the forward pass never called {', '.join(missing)} (layers under {stack.layers_path!r})")
    return captured, fwd.logits[0, P - 1 :, :].to(torch.float32).contiguous()  # [T, V]


def _greedy_without_cache(model, ids: torch.Tensor, n_tokens: int, cls: str) -> torch.Tensor:
    """``n_tokens`` greedy tokens int64 [T], each the argmax of a full no-cache forward over the sequence so far.

    Raises:
        GoldenError: a forward failed.
    """
    seq = ids
    try:
        with torch.no_grad():
            for _ in range(n_tokens):
                nxt = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    except Exception as e:  # noqa: BLE001 - as for generate
        raise GoldenError(f"cannot generate the golden: eager {cls} forward (greedy, no cache) failed: {type(e).__name__}: {str(e)[:300]}") from e
    return seq[0, ids.shape[1]:].to(torch.int64)


def generate_golden(
    bundle: Any,
    prompt_ids: list[int],
    n_tokens: int,
    seed: int = 0,
    *,
    prompt_text: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Golden tokens, logits and per-layer activations of ``bundle.model`` in eager fp32.

    Args:
        bundle: a :class:`nhil.models.ModelBundle` (its ``model`` is a HF causal LM,
            fp32, eval mode; any module layout, see :mod:`nhil.golden.decoder_stack`).
        prompt_ids: P >= 1 prompt token ids.
        n_tokens: T >= 1 tokens to generate greedily (EOS does not stop generation).
        seed: ``torch.manual_seed`` before generating (greedy decoding does not sample;
            recorded for provenance).
        prompt_text: prompt text for the metadata; default: decoded from ``prompt_ids``
            if the bundle has a tokenizer, else "".

    Returns:
        ``(tensors, metadata)``. Tensors:

        * ``prompt_ids`` int64 [P]; ``tokens`` int64 [T] (generated);
        * ``logits`` float32 [T, V]: row i = logits at position P-1+i of the
          teacher-forced pass, i.e. the prediction of ``tokens[i]``;
        * ``act.model.embed_tokens`` float32 [P+T-1, H];
        * ``act.model.layers.{l}`` float32 [P+T-1, H]: output hidden state of decoder
          layer l (residual stream, before the final norm).

        Metadata (all str): model, weights_id, prompt, prompt_ids (JSON list), n_tokens,
        seed, dtype ("float32"), config_hash, generator ("pytorch-eager"), greedy ("generate", or
        "forward without cache ..." when ``generate`` disagreed with the teacher-forced forward at more
        than half the steps: it computed another function, e.g. RoBERTa-family positions), num_layers,
        embedding_path / layers_path (module paths the activations were captured at),
        hidden_size, vocab_size, teacher_forced_argmax_matches ("true"/"false": argmax of
        every ``logits`` row equals ``tokens``), teacher_forced_mismatch_steps (JSON
        list of step indices where it does not; KV-cached and full-sequence attention
        round differently, so a near-tie can flip).

    Raises:
        ValueError: empty prompt or n_tokens < 1.
        GoldenError: the decoder stack cannot be found or hooked, eager ``generate`` /
            forward of the model failed, or a layer's output is not [1, P+T-1, H]
            (all LOAD_FAIL in ``nhil verify``, naming the model class and the module).
    """
    if len(prompt_ids) < 1:
        raise ValueError("generate_golden needs at least one prompt token")
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    model = bundle.model
    model.eval()
    ids = torch.tensor([list(map(int, prompt_ids))], dtype=torch.int64)
    P, T = ids.shape[1], int(n_tokens)

    stack = find_decoder_stack(model)  # before generating: an uncapturable model fails fast
    cls = type(model).__name__
    torch.manual_seed(seed)
    pad = getattr(model.config, "pad_token_id", None)
    try:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=T,
            eos_token_id=None,
            pad_token_id=pad if pad is not None else 0,
            # plain greedy decoding: no logits processor from the checkpoint's generation_config (BART-family
            # configs force EOS at the last step and BOS at the first, some suppress tokens or penalise repeats)
            forced_eos_token_id=None, forced_bos_token_id=None, suppress_tokens=None, begin_suppress_tokens=None,
            no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0, min_new_tokens=0, bad_words_ids=None,
        )
    except Exception as e:  # noqa: BLE001 - the eager reference itself failed: a clear LOAD_FAIL, not a CRASH
        raise GoldenError(f"cannot generate the golden: eager {cls}.generate failed: {type(e).__name__}: {str(e)[:300]}") from e
    tokens = out[0, P:].to(torch.int64)
    if tokens.numel() != T:
        raise GoldenError(f"cannot generate the golden: {cls}.generate returned {tokens.numel()} new tokens, expected {T}")

    captured, logits = _teacher_forced(model, stack, ids, tokens, cls)
    mism = torch.nonzero(logits.argmax(dim=-1) != tokens).flatten().tolist()
    greedy = "generate"
    if 2 * len(mism) > T:
        # generate() computed another function than the model's forward (RoBERTa-family positions: generate hands in
        # position_ids from the attention mask, the forward counts from padding_idx + 1): greedy over the forward itself
        tokens = _greedy_without_cache(model, ids, T, cls)
        captured, logits = _teacher_forced(model, stack, ids, tokens, cls)
        greedy = f"forward without cache (generate() disagreed with the forward at {len(mism)}/{T} steps)"
    mism = torch.nonzero(logits.argmax(dim=-1) != tokens).flatten().tolist()
    tensors: dict[str, torch.Tensor] = {"prompt_ids": ids[0].clone(), "tokens": tokens.clone(), "logits": logits}
    tensors[act_name("model.embed_tokens")] = captured[act_name("model.embed_tokens")]
    for i in range(len(stack.layers)):
        tensors[act_name(f"model.layers.{i}")] = captured[act_name(f"model.layers.{i}")]

    if prompt_text is None:
        prompt_text = bundle.decode(list(prompt_ids)) if getattr(bundle, "tokenizer", None) is not None else ""
    cfg = model.config
    metadata = {
        "model": str(bundle.name),
        "weights_id": str(bundle.weights_id),
        "prompt": prompt_text,
        "prompt_ids": json.dumps([int(t) for t in prompt_ids]),
        "n_tokens": str(T),
        "seed": str(seed),
        "dtype": "float32",
        "config_hash": config_hash(model),
        "generator": "pytorch-eager",
        "greedy": greedy,
        "num_layers": str(len(stack.layers)),
        "embedding_path": stack.embedding_path,
        "layers_path": stack.layers_path,
        "hidden_size": str(getattr(cfg, "hidden_size", "")),
        "vocab_size": str(logits.shape[-1]),
        "teacher_forced_argmax_matches": "true" if not mism else "false",
        "teacher_forced_mismatch_steps": json.dumps(mism),
    }
    return tensors, metadata
