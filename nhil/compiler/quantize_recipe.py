"""Quantization recipes: the grammar of ``QUANT=`` strings and the named recipes.

A recipe string is ``<base>[:<pattern>=<format>[,<pattern>=<format>...]]``:

* ``<base>``: a name of :data:`RECIPES` (``native``, ``bf16``, ``int8``, ``int4-g128``,
  ``fp8-e4m3``, ``mxfp8``, ``mxfp6``, ``mxfp4``, ``mxint8``, ``nvfp4``, ``q8_0``, ``q4_0``,
  ``q4_1``) or any weight-format name of ``nhil.numerics.formats`` (e.g. ``int4-g32-asym``,
  ``mxfp6-e3m2``, ``mxfp4-rceil``, ``fp8-e4m3-pc``);
* overrides, first match wins: ``<pattern>`` is ``lm_head`` (the linear producing the
  logits, tied to the embedding in SmolLM2) or an ``fnmatch`` pattern over the weight's
  Hugging Face name (``model.layers.3.mlp.down_proj.weight``); ``<format>`` is ``bf16``,
  ``native`` or a format name. Example: ``mxfp4:lm_head=bf16,*.down_proj.*=mxfp8``;
* ``act=int8`` / ``act=fp8``: W8A8, per-token dynamic 8-bit activations on every quantized linear
  (``nhil.numerics.act_quant``), e.g. ``int8:act=int8``, ``fp8-e4m3-pc:act=fp8``;
* ``kv_cache=fp8`` (the pattern ``kv_cache``): the KV cache in E4M3 with per-head scales
  (``nhil.numerics.kv_fp8``), e.g. ``bf16:kv_cache=fp8`` (``verify --kv-cache fp8`` adds it).

Torch-free (``nhil.args`` reads the grammar before any work starts). The pass that applies a recipe:
``nhil.compiler.quantize``.
"""

from __future__ import annotations

from nhil.errors import CompileError
from nhil.numerics.formats import QuantizeError, get_format

RECIPES: dict[str, dict] = {
    "native": {"format": "native", "about": "the checkpoint's own formats (GGUF: Q4_1 linears, Q8_0 tied embedding/LM head)"},
    "bf16": {"format": "bf16", "about": "ISA v0 baseline: weights rounded to bf16 (RNE)"},
    "int8": {"format": "int8", "about": "int8 per-output-channel symmetric, fp32 scale"},
    "int4-g128": {"format": "int4-g128", "about": "int4 symmetric, groups of 128 along K, fp16 scale (GPTQ v2 zero 8, RTN)"},
    "fp8-e4m3": {"format": "fp8-e4m3", "about": "FP8 E4M3FN with one fp32 per-tensor scale"},
    "mxfp8": {"format": "mxfp8-e4m3", "about": "OCP MXFP8 (E4M3 elements, E8M0 scale per 32, FLOOR rule)"},
    "mxfp6": {"format": "mxfp6-e2m3", "about": "OCP MXFP6 E2M3 (the FP6 variant with more mantissa, for weights)"},
    "mxfp4": {"format": "mxfp4", "about": "OCP MXFP4 (E2M1, E8M0 per 32, FLOOR rule)"},
    "mxint8": {"format": "mxint8", "about": "OCP MXINT8 (int8 k/64, E8M0 per 32)"},
    "nvfp4": {"format": "nvfp4", "about": "NVFP4 (E2M1, UE4M3 per 16, fp32 per tensor)"},
    "q8_0": {"format": "q8_0", "about": "GGUF Q8_0 requantized from the fp32 weights"},
    "q4_0": {"format": "q4_0", "about": "GGUF Q4_0 requantized from the fp32 weights"},
    "q4_1": {"format": "q4_1", "about": "GGUF Q4_1 requantized from the fp32 weights (== the file's blocks for llama)"},
}


KV_CACHE = ("bf16", "fp8")  # ``kv_cache=<x>`` override: the KV cache's storage (fp8: nhil.numerics.kv_fp8)
ACT = ("bf16", "int8", "fp8")  # ``act=<x>`` override: activations of quantized linears (nhil.numerics.act_quant)


def with_kv_cache(recipe: str, kv_cache: str) -> str:
    """``recipe`` with the KV-cache storage ``kv_cache`` (``bf16`` leaves it unchanged): ``int8`` + ``fp8`` ->
    ``int8:kv_cache=fp8``; ``mxfp4:lm_head=bf16`` + ``fp8`` -> ``mxfp4:lm_head=bf16,kv_cache=fp8``.

    Raises:
        CompileError: ``kv_cache`` not in :data:`KV_CACHE`, or the recipe already names another one.
    """
    if kv_cache not in KV_CACHE:
        raise CompileError(f"--kv-cache {kv_cache!r}: the KV cache is one of {', '.join(KV_CACHE)}")
    base, overrides = parse_recipe(recipe)
    have = next((f for p, f in overrides if p == "kv_cache"), None)
    if have is not None and have != kv_cache:
        raise CompileError(f"--kv-cache {kv_cache} contradicts QUANT={recipe!r} (kv_cache={have})")
    if kv_cache == "bf16" or have is not None:
        return recipe
    rest = recipe.strip().partition(":")[2]
    return f"{base}:{rest + ',' if rest.strip() else ''}kv_cache={kv_cache}"


def hf_name(const_name: str) -> str:
    """Graph constant name -> Hugging Face parameter name (drops the export wrapper's ``model.`` prefix)."""
    return const_name[len("model.") :] if const_name.startswith("model.model.") or const_name.startswith("model.lm_head") else const_name


def parse_recipe(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``"mxfp4:lm_head=bf16"`` -> (``"mxfp4"``, [(``"lm_head"``, ``"bf16"``)]).

    Raises:
        CompileError: unknown base or format, or a malformed override.
    """
    base, _, rest = (text or "bf16").strip().partition(":")
    base = base.strip()
    overrides = []
    for item in filter(None, (x.strip() for x in rest.split(","))):
        pat, eq, fmt = item.partition("=")
        if not eq or not pat or not fmt:
            raise CompileError(f"bad quantization override {item!r} in {text!r}: use <pattern>=<format>, e.g. lm_head=bf16")
        overrides.append((pat.strip(), fmt.strip()))
    for pat, f in overrides:
        if pat == "kv_cache" and f not in KV_CACHE:
            raise CompileError(f"QUANT={text!r}: kv_cache={f!r}: the KV cache is one of {', '.join(KV_CACHE)}")
        if pat == "act" and f not in ACT:
            raise CompileError(f"QUANT={text!r}: act={f!r}: activations are one of {', '.join(ACT)} (W8A8 per-token dynamic)")
    for f in [base, *(f for p, f in overrides if p not in ("kv_cache", "act"))]:
        _check_format(f, text)
    return base, overrides


def _check_format(f: str, text: str) -> None:
    if f in RECIPES or f in ("native", "bf16"):
        return
    try:
        get_format(f)
    except QuantizeError as e:
        raise CompileError(f"QUANT={text!r}: {e}; recipes: {', '.join(RECIPES)}") from None


def _fmt_of(name: str) -> str:
    return RECIPES[name]["format"] if name in RECIPES else name
