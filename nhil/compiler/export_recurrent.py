"""Decode-step export of hybrid / state-space models: a static recurrent-state cache next to the KV caches.

transformers' ExecuTorch recipe (``TorchExportableModuleWithStaticCache``) cannot export
a model whose cache has linear-attention layers (transformers 5.24 ``cache_utils``
``LinearAttentionLayer``: Mamba / Mamba-2 mixers, gated DeltaNet, LFM2 short
convolutions): it reads ``num_attention_heads`` / ``head_dim`` to pre-allocate keys and
values (``'MambaConfig' object has no attribute 'num_attention_heads'``) and its
``early_initialization`` skips the linear layers (``supports_early_init = False``), whose
conv and recurrent states are then allocated lazily inside the traced forward.

nhil shapes that cache itself (as it does for DeepSeek's latent cache,
``export._shape_mla_cache``):

1. ``StaticCache(config, max_cache_len=L)`` dispatches each layer by ``layer_types``
   (attention layers ``StaticLayer``, sliding ones replaced by ``StaticLayer`` as the
   recipe does, linear layers ``LinearAttentionLayer``);
2. one eager *probe* step (token 0 at position 0) lets every layer allocate its tensors
   with the shapes its own module asks for (no per-family shape table); then every
   tensor is zeroed and ``cumulative_length`` reset;
3. after the probe each linear layer has ``has_previous_state = True``, so the exported
   step takes the modules' *decode* branch (``seq_len == 1`` with a state: e.g.
   ``modeling_mamba2.causal_conv1d_update`` + ``mamba2_selective_state_update``).
   From zero states this branch is the exact recurrence the prefill form computes in
   chunks, so a prompt runs through the program token by token like attention models;
4. the tensors are registered as buffers of the wrapper: ``key_cache_<i>`` /
   ``value_cache_<i>`` for attention layers (as the recipe names them),
   ``conv_state_<i>`` and ``ssm_state_<i>`` for linear layers (``_<s>`` suffix for a
   layer's further states), so the graph updates them in place (``aten.copy_``) under
   those names.
"""

from __future__ import annotations

import torch

from nhil.errors import CompileError


def has_recurrent_layers(config) -> bool:
    """Whether the text config's static cache holds a linear-attention (conv / recurrent state) layer."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticCache

    try:
        cache = StaticCache(config=config.get_text_config(decoder=True), max_cache_len=1)
    except Exception:  # noqa: BLE001 - a config StaticCache cannot dispatch is not a recurrent one
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


class TorchExportableModuleWithRecurrentCache(torch.nn.Module):
    """Decode-step wrapper holding a static cache with recurrent-state layers (module docstring).

    ``forward(input_ids [1,1] int64, cache_position [1] int64) -> logits [1,1,V] fp32``;
    buffers ``key_cache_<i>`` / ``value_cache_<i>`` [1, Hkv, L, hd], ``cumulative_length_<i>``,
    ``conv_state_<i>`` [1, conv channels, kernel] and ``ssm_state_<i>`` (family shape, e.g.
    Mamba-2 [1, heads, head_dim, state_size]) fp32, updated in place.

    Raises:
        CompileError: the probe step of the eager model fails (names the model class).
    """

    def __init__(self, model: torch.nn.Module, max_cache_len: int) -> None:
        super().__init__()
        from transformers.cache_utils import (DummyLayer, LinearAttentionCacheLayerMixin, StaticCache, StaticLayer,
                                              StaticSlidingWindowLayer)

        self.model = model
        cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=max_cache_len)
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, StaticSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
                cache.layers[i] = StaticLayer(max_cache_len)  # as the recipe: no generation beyond the window
            elif isinstance(layer, DummyLayer):
                cache.layers[i] = StaticLayer(0)
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros((1, 1), dtype=torch.long), cache=cache, use_cache=True)
        except Exception as e:  # noqa: BLE001 - the eager model itself fails on one token
            raise CompileError(f"the recurrent-state cache probe (one eager step of {type(model).__name__}) failed: {type(e).__name__}: {e}") from e
        self.static_cache = cache
        # positions as generate() gives them (cache_position): a model that, without position_ids, counts positions
        # from 0 in every call (Bamba's ``arange(seq_len)``) would otherwise see position 0 at every decode step
        self.positions_from_cache = _counts_from_zero(model)
        self.attention_layers: list[int] = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for kind, states in (("conv_state", layer.conv_states), ("ssm_state", layer.recurrent_states)):
                    for s, t in states.items():
                        if t is not None:
                            t.zero_()
                            self.register_buffer(f"{kind}_{i}" + (f"_{s}" if s else ""), t, persistent=False)
            if isinstance(layer, StaticLayer) and getattr(layer, "keys", None) is not None:
                layer.keys.zero_()
                layer.values.zero_()
                layer.cumulative_length.zero_()
                self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
                self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
                self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)
                self.attention_layers.append(i)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i in self.attention_layers:
            self.static_cache.layers[i].cumulative_length.copy_(cache_position[0])
        kw = {"position_ids": cache_position.unsqueeze(0)} if self.positions_from_cache else {}
        return self.model(input_ids=input_ids, attention_mask=None, cache=self.static_cache, use_cache=True, **kw).logits


def _counts_from_zero(model: torch.nn.Module) -> bool:
    """Whether the decoder stack, given no ``position_ids``, numbers the tokens of every call from 0 (it reads no
    cache length: ``arange(seq_len)``), so that a decode step must be handed its position. Read from the source of
    the base model's ``forward`` (``position_ids = torch.arange(...)`` without ``get_seq_length`` /
    ``cache_position``); a model whose forward takes no ``position_ids`` (Mamba-2) needs none."""
    import inspect

    base = getattr(model, "model", None) or getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    try:
        if "position_ids" not in inspect.signature(base.forward).parameters:
            return False
        src = inspect.getsource(type(base).forward)
    except (TypeError, OSError, ValueError):
        return False
    at = src.find("if position_ids is None")
    if at < 0:
        return False
    block = src[at: at + 400]
    return "arange" in block and not any(k in block for k in ("get_seq_length", "cache_position", "past_seen"))


def export_recurrent_decode(model: torch.nn.Module, max_cache_len: int, example: tuple[torch.Tensor, torch.Tensor]) -> torch.export.ExportedProgram:
    """``torch.export`` (strict, as the recipe) of one decode step of a model with recurrent layers.

    Args:
        model: eval-mode fp32 transformers causal LM whose cache has linear-attention layers.
        max_cache_len: positions of the attention layers' static KV caches.
        example: ``(input_ids [1,1], cache_position [1])`` int64.

    Returns:
        ExportedProgram: user inputs ``input_ids``, ``cache_position``; output logits [1,1,V];
        the buffers of :class:`TorchExportableModuleWithRecurrentCache` mutated in place.

    Raises:
        CompileError: the probe or ``torch.export`` failed.
    """
    wrapper = TorchExportableModuleWithRecurrentCache(model, max_cache_len)
    with torch.no_grad():
        return torch.export.export(wrapper, args=(), kwargs={"input_ids": example[0], "cache_position": example[1]}, strict=True)
