"""Raising by pattern: the pattern table and the dispatch of one region.

Every region is offered to the patterns whose anchor ops it contains, in ``PATTERNS`` order
(the most specific first); the first that matches the whole region exactly wins. Module class
names play no part: they only name regions in reports. A region no pattern raises becomes an
attention core by its anchors (``raise_anchor``) or, when it holds no PIM-bound work, host ATen
(``host_aten``): the exported ops themselves.
"""

from __future__ import annotations

from typing import Callable

from nhil.compiler.raise_attention import h_attention
from nhil.compiler.raise_ctx import Ctx, aten
from nhil.compiler.raise_deepseek import DEEPSEEK_HANDLERS
from nhil.compiler.raise_handlers import (h_act, h_causal_lm, h_conv1d, h_dropout, h_embedding, h_gelu_new, h_layer_norm,
                                          h_linear, h_mlp, h_residual, h_rms_norm, h_rotary, h_scaled_embedding)
from nhil.compiler.raise_match import Mismatch
from nhil.compiler.raise_moe import h_moe_block, h_moe_experts, h_moe_router
from nhil.compiler.raise_positions import FLOAT_MASK_OPS, INDEX_OPS, h_gpt2_model, h_static_cache_wrapper

__all__ = ["PATTERNS", "candidates", "raise_region"]


def _recurrent() -> dict:
    """The recurrent-layer patterns (``raise_recurrent``), each offered only to programs that keep a
    recurrent state (``conv_state_<i>`` / ``ssm_state_<i>`` buffers): their pieces are short and
    would otherwise claim look-alike regions of other models (a MoE block's head reshape)."""
    from nhil.compiler.raise_delta import DELTA_HANDLERS  # gated DeltaNet (linear attention)
    from nhil.compiler.raise_recurrent import RECURRENT_HANDLERS  # state-space / short-conv layers

    def guarded(h):
        def run(ctx: Ctx) -> None:
            if not any(str(f).startswith(("conv_state_", "ssm_state_")) for f in ctx.r.fqn.values()):
                raise Mismatch(ctx.nodes[0], "no recurrent state in this program")
            h(ctx)

        return run

    return {k: guarded(h) for k, h in {**RECURRENT_HANDLERS, **DELTA_HANDLERS}.items()}


RECURRENT = _recurrent()


# Raising by pattern: every region is offered to the patterns whose anchor ops it contains, in
# this order (the most specific first); the first that matches the whole region exactly wins.
# Module class names play no part: they only name regions in reports. A region no pattern
# raises becomes an attention core by its anchors (raise_anchor) or, when it holds no
# PIM-bound work, host ATen (host_aten): the exported ops themselves.
_INDEX = INDEX_OPS | FLOAT_MASK_OPS
PATTERNS: list[tuple[str, Callable[[Ctx], None], frozenset | None]] = [
    ("static-cache position", h_static_cache_wrapper, frozenset({aten.copy_.default})),
    ("dropout (eval)", h_dropout, frozenset({aten.dropout.default})),
    ("embedding", h_embedding, frozenset({aten.embedding.default})),
    ("scaled embedding", h_scaled_embedding, frozenset({aten.embedding.default})),
    ("linear", h_linear, frozenset({aten.linear.default})),
    ("Conv1D linear", h_conv1d, frozenset({aten.addmm.default})),
    ("RMSNorm", h_rms_norm, frozenset({aten.rsqrt.default})),
    ("LayerNorm", h_layer_norm, frozenset({aten.layer_norm.default})),
    ("RoPE tables", h_rotary, frozenset({aten.cos.default})),
    ("gated activation", h_act, frozenset({aten.silu.default, aten.gelu.default})),
    ("gelu_new", h_gelu_new, frozenset({aten.tanh.default})),
    ("logit soft-cap", h_causal_lm, frozenset({aten.tanh.default})),
    ("gated MLP", h_mlp, frozenset({aten.mul.Tensor, aten.chunk.default})),
    ("positions / causal mask", h_gpt2_model, frozenset(_INDEX)),
    ("residual add", h_residual, frozenset({aten.add.Tensor})),
    ("attention", h_attention, frozenset({aten.scaled_dot_product_attention.default, aten.index_copy_.default, aten.matmul.default, aten.view.default, aten.add_.Tensor})),
    ("MLA attention", DEEPSEEK_HANDLERS["DeepseekV3Attention"], None),
    # recurrent layers (raise_recurrent: shared conv / state-update / delta-rule / gated-norm pieces)
    ("Mamba-2 mixer", RECURRENT["Mamba2Mixer"], None),  # its pieces (convex regions) need not hold the state write
    ("gated short conv", RECURRENT["Lfm2ShortConv"], None),  # its pieces (convex regions) need not hold the state write
    ("gated DeltaNet", RECURRENT["OlmoHybridGatedDeltaNet"], None),  # its pieces (convex regions) need not hold the state write
    ("gated RMSNorm", RECURRENT["MambaRMSNormGated"], frozenset({aten.rsqrt.default})),
    ("RMSNorm before gate", RECURRENT["OlmoHybridRMSNormGated"], frozenset({aten.rsqrt.default})),
    ("inline SwiGLU", RECURRENT["Lfm2MLP"], frozenset({aten.silu.default})),
    ("DeepSeek router", DEEPSEEK_HANDLERS["DeepseekV3TopkRouter"], None),
    ("DeepSeek MoE block", DEEPSEEK_HANDLERS["DeepseekV3MoE"], None),  # needs a raised DeepSeek router: before the generic block
    ("MoE router", h_moe_router, None),
    ("MoE experts", h_moe_experts, None),
    ("MoE block", h_moe_block, None),
]




def candidates(ops: set) -> list[tuple[str, Callable[[Ctx], None]]]:
    """The patterns to try on a region whose ATen ops are ``ops`` (see ``PATTERNS``)."""
    return [(name, h) for name, h, anchor in PATTERNS if anchor is None or anchor & ops]


def raise_region(ctx: Ctx) -> str:
    """Raise one region: the first pattern that matches it exactly, else the attention anchors,
    else host ATen. Returns the name of what raised it (``"host ATen"`` for the fallback).

    Raises:
        Mismatch: nothing raised it; the reason names the PIM-bound op that kept it off the
            host, or else the first pattern's mismatch.
    """
    from nhil.compiler.host_aten import h_host_aten
    from nhil.compiler.raise_anchor import h_attention_anchor
    from nhil.compiler.raise_anchor_eager import EAGER_PRODUCTS, h_attention_eager

    ops = {n.target for n in ctx.nodes}
    first: Mismatch | None = None
    tried: set[str] = set()
    tries = candidates(ops)
    if aten.scaled_dot_product_attention.default in ops:
        tries.append(("attention (anchors)", h_attention_anchor))
    elif aten.index_copy_.default in ops and ops & set(EAGER_PRODUCTS):
        tries.append(("attention (anchors)", h_attention_eager))
    tries.append(("host ATen", h_host_aten))
    for name, h in tries:
        try:
            try:
                h(ctx)
            except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
                # a pattern written for other regions met arguments of another kind (a scalar
                # where it expects a tensor, ...): it does not fit this region
                raise Mismatch(ctx.nodes[0], f"the {name} pattern does not fit: {type(e).__name__}: {e}") from None
            ctx.check_outputs_mapped()
            return name
        except Mismatch as m:
            ctx.undo()
            # report what says most: the attention anchors' reason when they were tried (the region is an
            # attention), else host ATen's refusal of PIM-bound work, else the first pattern's mismatch
            if first is None or name == "attention (anchors)" or (name == "host ATen" and "anchors" not in tried and ("PIM-bound" in m.reason or "writes into" in m.reason)):
                first = m
            tried.add("anchors" if name == "attention (anchors)" else name)
    raise first if first is not None else Mismatch(ctx.nodes[0], "no pattern")
