"""Quantization pass: assign a weight format to every PIM linear from a recipe.

The recipe grammar and the named recipes: ``nhil.compiler.quantize_recipe``; a GGUF checkpoint's own
blocks (``native``): ``nhil.compiler.quantize_gguf``; the accuracy thresholds per recipe:
``nhil.compiler.quantize_thresholds``. This module holds the :class:`QuantPlan` of one compile and
:func:`build_plan`, and re-exports the names of those modules.

Quantization is weight-only: activations stay bf16, accumulation fp32 (``docs/numerics.md``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

import numpy as np

from nhil.compiler.quantize_gguf import gguf_qk_row_order, native_gguf_weights, read_gguf_tensors
from nhil.compiler.quantize_recipe import ACT, KV_CACHE, RECIPES, _fmt_of, hf_name, parse_recipe, with_kv_cache
from nhil.compiler.quantize_thresholds import MEASURED_MODEL, QUANT_THRESHOLDS, tolerance_profile
from nhil.errors import CompileError
from nhil.numerics.formats import QTensor, QuantizeError, get_format

__all__ = [
    "ACT", "KV_CACHE", "MEASURED_MODEL", "QUANT_THRESHOLDS", "RECIPES", "QuantPlan", "build_plan", "gguf_qk_row_order",
    "hf_name", "lm_head_weight", "native_gguf_weights", "parse_recipe", "read_gguf_tensors", "tolerance_profile", "with_kv_cache",
]


@dataclasses.dataclass
class QuantPlan:
    """Format assignment of one compile (``lower_decode_graph(..., quant=plan)``).

    Attributes:
        recipe: the recipe string.
        base: default format (``native``, ``bf16`` or a format name).
        overrides: (pattern, format) pairs, first match wins.
        lm_head: graph constant name of the logits linear's weight (for the ``lm_head`` pattern).
        native: HF name -> QTensor holding the checkpoint's own blocks (``native`` only).
        refused: HF name -> NativeRefusal of a pre-quantized checkpoint (``native`` on it is a CompileError).
        activations: a pre-quantized checkpoint's activation scheme that the weight-only MAC does not apply.
        assigned: filled while lowering: HF name -> format name used.
    """

    recipe: str
    base: str
    overrides: list[tuple[str, str]]
    lm_head: str | None = None
    native: dict[str, QTensor] | None = None
    refused: dict = dataclasses.field(default_factory=dict)
    activations: str | None = None
    act_native: str | None = None
    assigned: dict[str, str] = dataclasses.field(default_factory=dict)
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def format_for(self, const_name: str) -> str:
        hn = hf_name(const_name)
        for pat, fmt in self.overrides:
            if pat in ("kv_cache", "act"):
                continue
            if (pat == "lm_head" and const_name == self.lm_head) or fnmatch.fnmatchcase(hn, pat) or fnmatch.fnmatchcase(const_name, pat):
                return _fmt_of(fmt)
        return _fmt_of(self.base)

    @property
    def act(self) -> str | None:
        """W8A8 activation mode of quantized linears: the ``act=`` override, else a pre-quantized checkpoint's own
        per-token dynamic int8/fp8 activations under ``native`` (:attr:`act_native`), else None (bf16)."""
        a = next((f for p, f in self.overrides if p == "act"), None)
        if a is None:
            a = self.act_native
        return None if a in (None, "bf16") else a

    @property
    def kv_cache(self) -> str:
        """Storage of the KV cache: ``bf16`` or ``fp8`` (the ``kv_cache=fp8`` override, ``--kv-cache fp8``)."""
        return next((f for p, f in self.overrides if p == "kv_cache"), "bf16")

    def kv_scales(self, layer: int, kv_heads: int):
        """(k, v) scales float32 [kv_heads] of an fp8 cache's layer: 1.0 per head (vLLM's default without calibrated
        ``k_scale``/``v_scale``; a checkpoint's calibrated scales are not read yet)."""
        one = np.ones(kv_heads, np.float32)
        return one, one.copy()

    def weight(self, const_name: str, tensor) -> QTensor | None:
        """The stored form of a linear's weight: a QTensor, or None for bf16."""
        if const_name in self._cache:
            return self._cache[const_name]
        fmt = self.format_for(const_name)
        hn = hf_name(const_name)
        qt = None
        if fmt == "native":
            if hn in self.refused:
                raise CompileError(self.refused[hn].message())
            qt = (self.native or {}).get(hn)
        elif fmt != "bf16":
            w = tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)
            try:
                qt = get_format(fmt).quantize(np.ascontiguousarray(w, np.float32))
            except QuantizeError as e:
                raise CompileError(f"cannot quantize {hn} to {fmt}: {e}") from None
        if qt is not None and self.act:
            qt.meta["act"] = self.act
        self.assigned[hn] = qt.fmt.name if qt is not None else "bf16"
        self._cache[const_name] = qt
        return qt

    def describe(self) -> dict:
        d = {"recipe": self.recipe, "base": self.base, "overrides": [f"{p}={f}" for p, f in self.overrides], "assigned": dict(self.assigned)}
        if self.act:
            d["activations"] = f"{self.act} per-token dynamic (W8A8, nhil.numerics.act_quant) on the quantized linears"
        if self.activations and not self.act_native:
            d["activations_not_applied"] = f"checkpoint quantizes activations ({self.activations}); nhil runs them in bf16 (weight-only MAC)"
        return d


def lm_head_weight(gm) -> str | None:
    """Constant name of the weight of the linear whose output is the graph's logits."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0]
    res = res[0] if isinstance(res, (tuple, list)) else res
    seen = [res]
    while seen:
        n = seen.pop()
        if getattr(n, "op", None) == "call_function" and "linear" in str(n.target):
            w = n.args[1]
            return w.target if w.op == "get_attr" else w.name
        seen.extend(a for a in getattr(n, "args", ()) if hasattr(a, "op"))
    return None


def build_plan(recipe: str, gm=None, gguf_path: str | Path | None = None, model=None, checkpoint=None) -> QuantPlan:
    """A QuantPlan for ``recipe``; ``native`` needs the GGUF file and the loaded ``model``, or a pre-quantized
    checkpoint's ``checkpoint`` (:class:`nhil.models.prequant.NativeWeights`, ``ModelBundle.native``).

    Raises:
        CompileError: bad recipe, or ``native`` without a GGUF or pre-quantized checkpoint.
    """
    base, overrides = parse_recipe(recipe)
    plan = QuantPlan(recipe, base, overrides, lm_head=lm_head_weight(gm) if gm is not None else None)
    if base == "native" or any(f == "native" for _, f in overrides):
        if checkpoint is not None:
            plan.native, plan.refused, plan.activations = checkpoint.tensors, checkpoint.refused, checkpoint.activations
            plan.act_native = getattr(checkpoint, "act_mode", None)
        elif gguf_path is None:
            raise CompileError("QUANT=native keeps a checkpoint's own formats, but this model was loaded neither from a GGUF file nor from a pre-quantized folder")
        else:
            plan.native = native_gguf_weights(gguf_path, model)
    return plan
