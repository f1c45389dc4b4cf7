"""torch.export front door: prefill and static-KV-cache decode programs of a HF causal LM.

Recipes measured in ``/work/shared/DESIGN.md`` ("Facts measured"): prefill is
``torch.export.export(model, (ids,), kwargs={"use_cache": False})``; decode is transformers'
ExecuTorch recipe ``TorchExportableModuleForDecoderOnlyLM`` with a ``StaticCache``.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from nhil.errors import CompileError


def export_prefill(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.export.ExportedProgram:
    """Export one full forward over a prompt, without KV cache.

    Args:
        model: an eval-mode transformers ``*ForCausalLM`` (fp32).
        input_ids: [1, S] int64 prompt (S is baked into the program).

    Returns:
        ExportedProgram with one user input ``input_ids`` and output logits [1, S, V] fp32.

    Raises:
        CompileError: bad ``input_ids`` or ``torch.export`` failed.
    """
    if input_ids.dtype != torch.int64 or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise CompileError(f"export_prefill wants input_ids int64 [1,S], got {tuple(input_ids.shape)} {input_ids.dtype}")
    try:
        with torch.no_grad():
            return torch.export.export(model, (input_ids,), kwargs={"use_cache": False})
    except Exception as e:  # torch.export raises many types
        _reraise_nhil(e)
        raise CompileError(f"torch.export of the prefill graph failed: {type(e).__name__}: {e}") from e


def _reraise_nhil(e: BaseException) -> None:
    """Re-raise an nhil error (e.g. a stage timeout) that torch wrapped into its own exception types."""
    from nhil.errors import NhilError

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NhilError):
            raise e
        e = e.__cause__ or e.__context__


def export_decode(model: torch.nn.Module, max_cache_len: int) -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor, torch.Tensor]]:
    """Export one decode step (1 token) with a static KV cache of ``max_cache_len`` positions.

    Uses ``transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM``.
    The model's ``generation_config`` is set to a static-cache config for the export and
    restored afterwards, so ``model.generate`` keeps working.

    Returns:
        (ep, example_inputs): ep takes ``input_ids`` [1,1] int64 and ``cache_position`` [1]
        int64 and returns logits [1,1,V] fp32; its buffers ``key_cache_<i>`` /
        ``value_cache_<i>`` [1, Hkv, L, hd] are updated in place (``aten.index_copy_``).
        example_inputs = (input_ids=[[0]], cache_position=[0]).

    MLA models (config ``kv_lora_rank``, DeepSeek-V2/V3): the cache holds the compressed
    latent, so ``key_cache_<i>`` is ``[1, 1, L, kv_lora_rank]`` (the normalised latent) and
    ``value_cache_<i>`` ``[1, 1, L, qk_rope_head_dim]`` (the RoPE'd shared key), see
    :func:`_shape_mla_cache`.

    Hybrid / state-space models (a cache with linear-attention layers: Mamba-2, gated
    DeltaNet, ...): :func:`nhil.compiler.export_recurrent.export_recurrent_decode`, with
    ``conv_state_<i>`` / ``ssm_state_<i>`` buffers next to the attention layers' KV caches.

    Raises:
        CompileError: bad ``max_cache_len`` or the export failed.
    """
    if not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise CompileError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    L = max_cache_len
    saved_gc = copy.deepcopy(model.generation_config)
    saved_use_cache = getattr(model.config, "use_cache", None)
    example = (torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
    try:
        model.generation_config = GenerationConfig(
            use_cache=True,
            cache_implementation="static",
            max_length=L,
            cache_config={"batch_size": 1, "max_cache_len": L},
        )
        from nhil.compiler.export_recurrent import export_recurrent_decode, has_recurrent_layers

        if has_recurrent_layers(model.config):  # conv / SSM / linear-attention states: nhil's own cache shaping
            return export_recurrent_decode(model, L, example), example
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=L)
        if getattr(model.config, "kv_lora_rank", None):
            _shape_mla_cache(wrapper.model, model.config)
        else:
            _shape_cache_as_written(wrapper.model, model)
        with torch.no_grad():
            try:
                ep = wrapper.export(input_ids=example[0], cache_position=example[1])
                if _value_sliced(ep) and _accepts_position_ids(model):
                    # exported, but the positions are a slice at a tensor's value (BERT's position_ids buffer
                    # [cache_length:]): a size only known at run time, handed in below as for the failures
                    raise _ValueSliced("exported with a data-dependent slice")
            except Exception as e:
                if not (_data_dependent(e) and _accepts_position_ids(model)):
                    raise
                ep = None
                for mask_len in (None, L):  # positions handed in (OPT, XGLM), then an all-ones padding mask too (BioGPT)
                    _same_steps_with_positions(wrapper.model, model, mask_len, e)
                    with _positions_from_cache(model, mask_len):
                        try:
                            ep = wrapper.export(input_ids=example[0], cache_position=example[1])
                            break
                        except Exception as again:
                            if mask_len is not None or not _data_dependent(again):
                                raise
            assert ep is not None
    except CompileError:
        raise
    except Exception as e:
        _reraise_nhil(e)
        raise CompileError(f"torch.export of the decode step (static cache, L={L}) failed: {type(e).__name__}: {e}") from e
    finally:
        model.generation_config = saved_gc
        if saved_use_cache is not None:
            model.config.use_cache = saved_use_cache
    return ep, example


def _data_dependent(e: BaseException) -> bool:
    """True when torch.export failed on a value-dependent size (an unbacked symbol from ``.item()``)."""
    text = f"{type(e).__name__}: {e}".lower()
    return "data-dependent" in text or "pendingunbackedsymbolnotfound" in text


class _ValueSliced(Exception):
    """An export that succeeded with a slice bounded by a tensor's value (retried with the positions handed in)."""


def _value_sliced(ep: torch.export.ExportedProgram) -> bool:
    """True when a tensor's value (``aten.item``) sets the bounds of a slice in ``ep``'s graph."""
    slicing = {torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default}
    return any(n.op == "call_function" and n.target == torch.ops.aten.item.default and any(u.target in slicing for u in n.users)
               for n in ep.graph.nodes)


def _accepts_position_ids(model: torch.nn.Module) -> bool:
    import inspect

    return "position_ids" in inspect.signature(model.forward).parameters


@contextlib.contextmanager
def _positions_from_cache(model: torch.nn.Module, mask_len: int | None = None):
    """Pass ``position_ids`` [1, 1] int64 = the cache position to every call of the model (a forward pre-hook),
    and with ``mask_len`` an all-ones ``attention_mask`` [1, mask_len] fp32 (no padding over the
    whole static cache: the causal rule alone decides, as with no mask).

    Models that derive their positions from ``cache.get_seq_length()`` and slice a cumsum with it
    (OPT's learned positions, BioGPT, XGLM, CTRL's sinusoids, ...) make torch.export guard on a
    tensor value; a static-cache decode step's position is ``cumulative_length`` of the cache's
    first layer at entry (transformers' export wrapper sets it to ``cache_position[0]`` before the
    call), so handing it in as ``position_ids`` is the same arithmetic with a static shape. The
    hook is removed on exit, so eager generation is untouched.
    """
    def with_positions(module, args, kwargs):
        cache = kwargs.get("cache")
        if kwargs.get("position_ids") is None and cache is not None and getattr(cache, "layers", None):
            kwargs["position_ids"] = cache.layers[0].cumulative_length.reshape(1, 1).clone()
        if mask_len is not None and kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = torch.ones((1, mask_len), dtype=torch.float32)
        return args, kwargs

    hook = model.register_forward_pre_hook(with_positions, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


def _same_steps_with_positions(static_module: torch.nn.Module, model: torch.nn.Module, mask_len: int | None, why: BaseException,
                               steps: int = 3) -> None:
    """Check, eagerly and bit for bit, that :func:`_positions_from_cache` keeps the model's arithmetic: the logits
    of ``steps`` decode steps through the static-cache module (token ``1 + p`` at position ``p``) with the hook
    equal those without it. The cache buffers are restored afterwards.

    Raises:
        CompileError: the model's own positions are not the cache positions (RoBERTa counts from
            ``padding_idx + 1``), so handing them in would change the model; names the original export failure.
    """
    saved = {k: b.clone() for k, b in static_module.named_buffers()}

    def run() -> list[torch.Tensor]:
        out = []
        for p in range(steps):
            out.append(static_module(input_ids=torch.tensor([[1 + p]]), cache_position=torch.tensor([p])))
        for k, b in static_module.named_buffers():
            b.copy_(saved[k])
        return out

    with torch.no_grad():
        want = run()
        with _positions_from_cache(model, mask_len):
            got = run()
    if not all(torch.equal(a, b) for a, b in zip(want, got)):
        raise CompileError(f"torch.export of the decode step failed on a value-dependent size ({type(why).__name__}: "
                           f"{str(why).splitlines()[0][:200]}), and this model's positions are not its cache positions, "
                           "so they cannot be handed in as position_ids without changing its logits")


def _shape_mla_cache(static_module: torch.nn.Module, config) -> None:
    """Re-allocate the StaticCache layers of an MLA model in the latent shapes MLA writes.

    transformers' recipe (``TorchExportableModuleWithStaticCache``) allocates every layer
    as ``[B, num_key_value_heads, L, head_dim]`` for both keys and values, but
    ``DeepseekV3Attention.forward`` (transformers 5.24, modeling_deepseek_v3.py) calls
    ``cache.update(kv_nope, k_rot)`` with the single-head latent ``kv_nope``
    ``[B, 1, S, kv_lora_rank]`` and shared RoPE key ``k_rot`` ``[B, 1, S, qk_rope_head_dim]``,
    so ``index_copy_`` fails on the shape mismatch. This re-runs each ``StaticLayer``'s own
    ``lazy_initialization`` with those shapes (zeros, the model dtype) and re-registers the
    wrapper's ``key_cache_<i>`` / ``value_cache_<i>`` buffers on the new tensors.

    Raises:
        CompileError: a cache layer that is not a plain ``StaticLayer``.
    """
    from transformers.cache_utils import StaticLayer

    dtype = next(static_module.model.parameters()).dtype
    batch = static_module.static_cache.layers[0].keys.shape[0]
    for i, layer in enumerate(static_module.static_cache.layers):
        if type(layer) is not StaticLayer:
            raise CompileError(f"MLA decode export needs plain StaticLayer caches, layer {i} is {type(layer).__name__}")
        layer.is_initialized = False
        layer.lazy_initialization(torch.zeros((batch, 1, 0, config.kv_lora_rank), dtype=dtype),
                                  torch.zeros((batch, 1, 0, config.qk_rope_head_dim), dtype=dtype))
        static_module.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        static_module.register_buffer(f"value_cache_{i}", layer.values, persistent=False)


def _shape_cache_as_written(static_module: torch.nn.Module, model: torch.nn.Module) -> None:
    """Re-allocate the StaticCache layers whose shape differs from what the model writes.

    transformers' recipe allocates every layer as ``[B, num_key_value_heads, L, head_dim]``
    from the config, but several attention codes write other shapes (GPT-BigCode and Falcon
    multi-query attention: one KV head; the BART-family decoders: ``decoder_attention_heads``).
    One eager step with a dynamic cache (1 token, no grad) shows the ``[B, H, 1, d]`` keys and
    values each layer really writes; a plain ``StaticLayer`` of another shape is re-initialised
    with those (zeros, the model dtype) and the wrapper's ``key_cache_<i>`` / ``value_cache_<i>``
    buffers re-registered. Layers that already fit are untouched (the programs of the families
    that fit stay byte-identical).

    Raises:
        CompileError: a layer that must be re-shaped is not a plain ``StaticLayer``.
    """
    from transformers.cache_utils import StaticLayer

    cache = getattr(static_module, "static_cache", None)  # the hybrid-cache wrapper (sliding layers) keeps its own shapes
    layers = getattr(cache, "layers", None)
    if not layers:
        return
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True)
        written = getattr(out, "past_key_values", None)
        seen = [(lay.keys, lay.values) for lay in written.layers] if written is not None and hasattr(written, "layers") else []
    except Exception:  # noqa: BLE001 - the export itself then reports what fails
        return
    if len(seen) != len(layers):
        return
    batch = layers[0].keys.shape[0] if getattr(layers[0], "keys", None) is not None else 1
    for i, (layer, (k, v)) in enumerate(zip(layers, seen)):
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4 and v.dim() == 4):
            continue
        want = ((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]))
        have = ((layer.keys.shape[1], layer.keys.shape[3]), (layer.values.shape[1], layer.values.shape[3])) if getattr(layer, "keys", None) is not None else None
        if have == want:
            continue
        if type(layer) is not StaticLayer:
            raise CompileError(f"the model writes KV cache layer {i} as keys {tuple(k.shape)} / values {tuple(v.shape)}, "
                               f"but the static cache allocates {type(layer).__name__} {have}; only plain StaticLayer caches can be re-shaped")
        layer.is_initialized = False
        layer.lazy_initialization(torch.zeros((batch, k.shape[1], 0, k.shape[3]), dtype=k.dtype), torch.zeros((batch, v.shape[1], 0, v.shape[3]), dtype=v.dtype))
        static_module.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        static_module.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
