"""A tiny seeded config for any causal-LM architecture of the installed transformers.

:func:`tiny_config` starts from the config class's own defaults (the published model's
shape) and shrinks every size field it has to the zoo's tiny shape (hidden 64, 2 layers,
4 query / 2 KV heads, head dim 16, vocab 256, MoE 4 experts top-2; as in
``/work/shared/research/tiny_configs.py``). Fields are set through the config's
``attribute_map`` (``n_embd`` for ``hidden_size``, ...), so no per-family table is needed;
per-layer lists of the old layer count (``layer_types``, ...) are cut to 2, and special
token ids outside the tiny vocabulary are moved inside it. Multimodal configs shrink
their text sub-config; an architecture that cannot be built this way is a CONFIG row of
the landscape with the reason.
"""

from __future__ import annotations

from nhil.errors import SetupError

__all__ = ["tiny_config", "causal_lm_architectures", "SHRINK"]

# size fields -> tiny value; set only when the config has the field and it holds a number
SHRINK: dict[str, int | float] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
    "n_positions": 128, "n_ctx": 128, "ffn_dim": 128, "d_ff": 128, "n_inner": 128, "intermediate_size_mlp": 128,
    "word_embed_proj_dim": 64, "embed_dim": 64, "kv_channels": 16,
    # encoder-decoder families' decoders (BART, mBART, Marian, Pegasus, ...): head_dim = d_model / heads
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    # MoE
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "moe_k": 2, "top_k": 2, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 2, "topk_group": 1,
    # MLA
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    # windows, chunks, partial rotary
    "sliding_window": 8, "attention_chunk_size": 8, "rotary_dim": 8, "rotary_emb_base": 10000,
    # SSM / linear-attention parts of hybrids
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "state_size": 16, "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
    "num_heads": 4, "ssm_state_size": 16, "n_groups": 1, "mamba_n_groups": 1,
    # XLNet-style explicit per-head width (validated against d_model // n_head)
    "d_head": 16,
    # Gemma 3n / 4 per-layer input embeddings (a [vocab, layers x width] table)
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
}
# fields a config class leaves None by default though its model needs a number (Ministral's head_dim,
# Nemotron's KV heads): None there means "not set", so the tiny value is used
FILL_NONE: dict[str, int] = {"head_dim": 16, "num_key_value_heads": 2}
# MoE counts, filled only when every one of them is None (the class default leaves a MoE model's experts unset)
FILL_NONE_MOE: dict[str, int] = {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")
_TEXT_SUBCONFIGS = ("text_config", "decoder", "language_config", "llm_config", "decoder_config")


def causal_lm_architectures() -> dict[str, str]:
    """``model_type -> causal-LM class name`` of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cache_kind(kind) -> str:
    """``"attention"`` / ``"state"`` / ``"unknown"``: what a layer type keeps in transformers' cache
    (``DYNAMIC_LAYER_TYPE_MAPPING``): keys and values (a ``DynamicLayer``: full / sliding / chunked attention, and
    hybrids' ``hybrid`` layers), or only a recurrent state or nothing (linear attention, conv, ``moe`` / ``mlp``
    dummies); legacy names (``mamba``, ``attention``) are remapped first."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer
    from transformers.configuration_utils import remap_legacy_layer_types

    if not isinstance(kind, str):
        return "unknown"
    kind = remap_legacy_layer_types([kind])[0]
    cls = DYNAMIC_LAYER_TYPE_MAPPING.get("dummy" if kind in ("moe", "mlp") else kind)
    return "unknown" if cls is None else "attention" if issubclass(cls, DynamicLayer) else "state"


def _holds_attention(kind) -> bool:
    return _cache_kind(kind) == "attention"


def _kept_layers(types) -> list[int]:
    """The two layers a 2-layer tiny model keeps, as indices into ``types``: the first layer, then the first layer
    that holds attention when the first does not (a hybrid's cache needs one attention layer: transformers'
    ``get_seq_length`` reads it, and Nemotron-H's ``[mamba, moe, attention, mlp]`` or Zamba2's
    ``[mamba] * 6 + [hybrid]`` stay hybrid), else the first layer of another kind (the config validators of
    ``["linear_attention"] * 3 + ["full_attention"]`` patterns demand both), else the first two."""
    types = list(types)
    if _cache_kind(types[0]) == "state":
        attn = next((i for i, t in enumerate(types) if _holds_attention(t)), None)
        if attn is not None:
            return [0, attn]
    other = next((i for i, t in enumerate(types) if t != types[0]), None)
    return [0, other] if other is not None else [0, 1]


def _ensure_attention_layer(cfg) -> None:
    """A recurrent stack whose 2 kept layers hold no attention (Bamba's ``attn_layer_indices=None``, Granite-hybrid's
    all-Mamba default ``layer_types``, Jamba-style ``attn_layer_period`` / ``offset`` past layer 2): make the last
    layer an attention layer through the field that describes it, kept only when ``cfg.layer_types`` then shows one."""
    types = getattr(cfg, "layer_types", None)
    if not isinstance(types, (list, tuple)) or not types or any(_cache_kind(t) != "state" for t in types):
        return
    last = len(types) - 1
    key = getattr(cfg, "attribute_map", {}).get("layer_types", "layer_types")
    tries = []
    if isinstance(vars(cfg).get(key), (list, tuple)):
        tries.append({key: [*types[:-1], "full_attention"]})
    for k, v in vars(cfg).items():
        if ("attn" in k or "attention" in k) and "layer" in k and k.endswith(("_indices", "_ids")) and (v is None or isinstance(v, (list, tuple))):
            tries.append({k: [last]})
    if _is_num(getattr(cfg, "attn_layer_period", None)) and _is_num(getattr(cfg, "attn_layer_offset", None)):
        tries.append({"attn_layer_period": len(types), "attn_layer_offset": last})
    for fields in tries:
        before = {k: getattr(cfg, k) for k in fields}
        for k, v in fields.items():
            _set(cfg, k, v)
        if any(_holds_attention(t) for t in (getattr(cfg, "layer_types", None) or [])):
            return
        for k, v in before.items():
            _set(cfg, k, v)


def _rederive(cfg, stale: dict) -> None:
    """Recompute the attributes a config class derives in ``__post_init__`` (not declared fields: Zamba2's
    ``attention_hidden_size = 2 * hidden_size``, ``mamba_headdim``, ``num_query_groups``, ``hybrid_layer_ids``) from
    the shrunk fields, by building the class again from its declared fields; declared fields keep the shrunk values,
    and only an attribute still at the value derived for the default shape (``stale``) is replaced. Applied to stacks
    with recurrent layers (whose mixers derive their widths); a class that cannot be rebuilt keeps its attributes."""
    import dataclasses

    types = getattr(cfg, "layer_types", None)
    if not dataclasses.is_dataclass(cfg) or not isinstance(types, (list, tuple)) or not any(_cache_kind(t) == "state" for t in types):
        return  # hybrid stacks only for now: MLA configs' stale qk_head_dim would change rows that pass
    fields = {f.name for f in dataclasses.fields(cfg) if f.init}
    try:
        fresh = type(cfg)(**{k: v for k, v in vars(cfg).items() if k in fields})
    except Exception:  # noqa: BLE001 - not rebuildable from its own fields
        return
    for k, v in vars(fresh).items():
        # only a stale value (still what the class derived for its default shape) is replaced
        if k not in fields and not k.startswith("_") and k in vars(cfg) and v != vars(cfg)[k] and vars(cfg)[k] == stale.get(k):
            _set(cfg, k, v)


def _layer_indices(v, n: int) -> bool:
    """``v`` is a non-empty strictly increasing list of layer indices below ``n`` (not a per-layer list of flags)."""
    return (isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and all(0 <= a < b < n for a, b in zip(v, v[1:])) and 0 <= v[0] < n)


def _set(cfg, key, val) -> bool:
    try:
        setattr(cfg, key, val)
        return True
    except Exception:  # noqa: BLE001 - a read-only property of this config: leave it
        return False


def _shrink(cfg) -> tuple[dict, list[int] | None]:
    """Shrink ``cfg`` in place; returns ``{field: value before}`` of every size field changed and the indices of
    the original layers kept by ``layer_types`` (None when the layer lists were cut to their first entries)."""
    from nhil.golden.decoder_stack import num_layers_of

    old_layers = num_layers_of(cfg)
    defaults = dict(vars(cfg))
    before: dict = {}
    for key, val in SHRINK.items():
        try:
            cur = getattr(cfg, key)
        except AttributeError:
            continue
        if _is_num(cur) and cur != val:  # None (e.g. no sliding window), lists and dicts keep their meaning
            if _set(cfg, key, type(cur)(val)):
                before[key] = cur
    for key, val in FILL_NONE.items():
        if key in vars(cfg) and getattr(cfg, key, 0) is None:
            _set(cfg, key, val)
    if all(key in vars(cfg) and getattr(cfg, key, 0) is None for key in FILL_NONE_MOE):
        for key, val in FILL_NONE_MOE.items():
            _set(cfg, key, val)
    parts = [k for k, v in vars(cfg).items() if k.endswith("_layers") and k not in SHRINK and _is_num(v) and v > 0]
    keep = None  # indices of the layers kept, when the stack is described as consecutive parts
    if old_layers and len(parts) > 1 and sum(getattr(cfg, k) for k in parts) == old_layers:
        # Dory's input / recurrent / output layers: the first layer of each part
        keep = [sum(getattr(cfg, k) for k in parts[:i]) for i in range(len(parts))]
        for k in parts:
            _set(cfg, k, 1)
        _set(cfg, "num_hidden_layers", len(parts))
    kept = keep
    if old_layers and old_layers != 2:
        types_key = getattr(cfg, "attribute_map", {}).get("layer_types", "layer_types")
        types = vars(cfg).get(types_key)
        if keep is None and isinstance(types, (list, tuple)) and len(types) == old_layers:
            keep = _kept_layers(types)
        keep = kept = keep or [0, 1]
        for key, v in list(vars(cfg).items()):
            if "layer" in key and _layer_indices(v, old_layers):
                # layer indices (Zamba2's hybrid_layer_ids, Bamba's attn_layer_indices, Llama-4's moe_layers)
                # renumbered into the kept layers
                setattr(cfg, key, type(v)(keep.index(i) for i in v if i in keep))
            elif isinstance(v, (list, tuple)) and len(v) == old_layers and key != "architectures":
                setattr(cfg, key, type(v)(v[i] for i in keep))
    _ensure_attention_layer(cfg)
    _rederive(cfg, defaults)
    if _is_num(getattr(cfg, "kv_lora_rank", None)) and _is_num(getattr(cfg, "qk_rope_head_dim", None)):
        # MLA: the rotary tables are qk_rope_head_dim wide (head_dim names them) and every head has its own KV
        for key, val in (("head_dim", cfg.qk_rope_head_dim), ("num_key_value_heads", getattr(cfg, "num_attention_heads", 4))):
            if hasattr(cfg, key):
                try:
                    setattr(cfg, key, val)
                except Exception:  # noqa: BLE001
                    pass
    for expand_k, heads_k, hd_k, state_k in (("expand", "num_heads", "head_dim", "state_size"),
                                             ("mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_d_state")):
        expand, heads, hd = (getattr(cfg, k, None) for k in (expand_k, heads_k, hd_k))
        if all(_is_num(v) for v in (expand, heads, hd)) and hasattr(cfg, state_k) and hd and cfg.hidden_size * expand != heads * hd:
            # Mamba-2 SSD (and the Mamba-2 mixers of Bamba / Falcon-H1 / Granite hybrids): the inner width
            # hidden*expand is split into n_heads x head_dim
            _set(cfg, heads_k, int(cfg.hidden_size * expand) // int(hd))
            if _is_num(getattr(cfg, "mamba_d_ssm", None)):
                _set(cfg, "mamba_d_ssm", int(cfg.hidden_size * expand))
    vocab = getattr(cfg, "vocab_size", 256)
    for key in _TOKEN_IDS:
        v = getattr(cfg, key, None)
        if _is_num(v) and v >= vocab:
            setattr(cfg, key, {"bos_token_id": 1, "eos_token_id": 2}.get(key, 0))
        elif isinstance(v, list) and any(_is_num(x) and x >= vocab for x in v):
            setattr(cfg, key, [2])
    return before, kept


def _validated(cfg, before: dict) -> None:
    """Run the config class's own validators; a shrunk field they refuse (ZAYA's one expert per token) goes back
    to its default, one field at a time, until they accept it.

    Raises:
        SetupError: the validators refuse the shrunk config whatever single field is restored.
    """
    validate = getattr(cfg, "validate", None)
    if validate is None:
        return
    try:
        validate()
        return
    except Exception as e:  # noqa: BLE001 - the class's validators name what they refuse
        first = e
    for key, val in before.items():
        cur = getattr(cfg, key)
        _set(cfg, key, val)
        try:
            validate()
            return
        except Exception:  # noqa: BLE001
            _set(cfg, key, cur)
    raise SetupError(f"transformers refuses the tiny {type(cfg).__name__}: {type(first).__name__}: {str(first)[:300]}")


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (see the module docstring).

    Raises:
        SetupError: unknown model type, or the config class refuses its defaults.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise SetupError(f"unknown model_type {model_type!r} in the installed transformers")
    try:
        cfg = CONFIG_MAPPING[model_type]()
    except Exception as e:  # noqa: BLE001 - the config class cannot be built from its defaults
        raise SetupError(f"{CONFIG_MAPPING[model_type].__name__}() with its defaults fails: {type(e).__name__}: {str(e)[:200]}") from None
    if getattr(cfg, "is_decoder", None) is False:
        # a causal LM: the BERT-family LM heads (BertLMHeadModel, RoBERTa, ...) are causal, with a KV cache, only
        # as decoders; their configs default to the bidirectional encoder
        _set(cfg, "is_decoder", True)
    cfg = _shrunk(cfg)
    for sub in _TEXT_SUBCONFIGS:
        s = getattr(cfg, sub, None)
        if s is not None and hasattr(s, "to_dict"):
            setattr(cfg, sub, _shrunk(s))
    return cfg


def _shrunk(cfg):
    """``cfg`` shrunk and validated; a heterogeneous config (transformers' ``per_layer_config``: Gemma 4's global
    layers have twice the head dim) is shrunk as its homogeneous form, then the kept layers get their overrides back,
    each size scaled as the global one was (head_dim 256 -> 16 makes an override of 512 -> 32)."""
    if "_heterogeneity_spec" not in vars(cfg):
        before, _ = _shrink(cfg)
        _validated(cfg, before)
        return cfg
    d = cfg.to_dict()
    overrides = {int(k): v for k, v in (d.pop("per_layer_config", None) or {}).items()}
    flat = type(cfg).from_dict(dict(d, per_layer_config={}))  # an empty override table: homogeneous
    before, kept = _shrink(flat)
    kept = kept or list(range(int(flat.num_hidden_layers)))
    new = {}
    for j, i in enumerate(kept):
        ov = {}
        for attr, val in overrides.get(i, {}).items():
            g = before.get(attr)
            ov[attr] = type(val)(max(1, round(getattr(flat, attr) * val / g))) if _is_num(val) and _is_num(g) and g else val
        if ov:
            new[str(j)] = ov
    out = type(cfg).from_dict(dict(flat.to_dict(), per_layer_config=new))
    _validated(out, before)
    return out
