"""Attribute checks of the ``nhil::*`` primitives, run on every raised graph.

A primitive's attributes (the non-tensor arguments of its schema in
``nhil.compiler.primitives``, plus the few tensor attributes whose values are part of the
model's definition, such as RoPE's ``inv_freq``) come from the model's config. A value
that makes no sense (a soft-cap of 0 or below, a sliding window of 0, head counts that do
not divide, a non-finite scale, top-k above the expert count, ...) would otherwise be
accepted silently or fail much later with an unrelated message (a cap of 0 divides by
zero and surfaces as ``max |diff| nan``). :func:`check_attributes` runs right after
raising, before anything is evaluated, and raises a :class:`~nhil.errors.CompileError`
(outcome ``COMPILE_FAIL``) that names the primitive, the attribute, its value, the
module path and the rule.

One check function per primitive, registered by primitive name in :data:`ATTR_CHECKS`
(as the lowering table, ``nhil.compiler.lowering``). A check receives the node's
arguments by schema name (defaults filled in) and yields ``(attribute, value, rule)`` for
every violated rule.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from nhil.errors import CompileError

Violation = tuple[str, object, str]
CheckFn = Callable[[dict], Iterator[Violation]]
ATTR_CHECKS: dict[str, CheckFn] = {}

GELU_APPROXIMATE = ("tanh", "none")
SCORE_FUNCS = ("softmax", "sigmoid")
MOE_ACTS = ("silu", "swiglu_clamp")
EXPERT_LAYOUTS = ("concat", "transposed_interleaved")


def _check(*names: str) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        for n in names:
            ATTR_CHECKS[f"nhil::{n}"] = fn
        return fn

    return deco


# ---------------------------------------------------------------- rules
def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(a: dict, name: str, optional: bool = False) -> Iterator[Violation]:
    """``a[name]`` is a finite number > 0 (``None`` allowed when ``optional``)."""
    v = a[name]
    if v is None and optional:
        return
    if not (_finite(v) and v > 0):
        yield name, v, "must be a finite number > 0"


def _finite_attr(a: dict, name: str, optional: bool = False) -> Iterator[Violation]:
    v = a[name]
    if v is None and optional:
        return
    if not _finite(v):
        yield name, v, "must be a finite number"


def _at_least(a: dict, name: str, lo: int, optional: bool = False) -> Iterator[Violation]:
    v = a[name]
    if v is None and optional:
        return
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        yield name, v, f"must be an integer >= {lo}"


def _one_of(a: dict, name: str, allowed: tuple) -> Iterator[Violation]:
    if a[name] not in allowed:
        yield name, a[name], f"must be one of {', '.join(map(repr, allowed))}"


def _divides(a: dict, num: str, den: str) -> Iterator[Violation]:
    n, d = a[num], a[den]
    if isinstance(n, int) and isinstance(d, int) and d >= 1 and n % d:
        yield f"{num} % {den}", f"{n} % {d} = {n % d}", f"{den} must divide {num}"


def _last_dim(a: dict, name: str):
    v = a[name]
    return int(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() else None


# ---------------------------------------------------------------- per primitive
@_check("embedding")
def _embedding(a: dict) -> Iterator[Violation]:
    yield from _positive(a, "scale", optional=True)


@_check("gelu_mul")
def _gelu_mul(a: dict) -> Iterator[Violation]:
    yield from _one_of(a, "approximate", GELU_APPROXIMATE)


@_check("softcap")
def _softcap(a: dict) -> Iterator[Violation]:
    yield from _positive(a, "cap")


@_check("rms_norm")
def _rms_norm(a: dict) -> Iterator[Violation]:
    yield from _positive(a, "eps")
    yield from _at_least(a, "head_dim", 1, optional=True)
    width = _last_dim(a, "x")
    if isinstance(a["head_dim"], int) and a["head_dim"] >= 1 and width is not None and width % a["head_dim"]:
        yield "head_dim", a["head_dim"], f"must divide the normalised width {width}"


@_check("layer_norm")
def _layer_norm(a: dict) -> Iterator[Violation]:
    yield from _positive(a, "eps")


@_check("linear")
def _linear(a: dict) -> Iterator[Violation]:
    return iter(())


@_check("rope_cos_sin")
def _rope_cos_sin(a: dict) -> Iterator[Violation]:
    yield from _positive(a, "attention_scaling")
    f = a["inv_freq"]
    # 0 is a frequency that does not rotate: Gemma 4's proportional RoPE zeroes the pass-through dims
    # (transformers modeling_rope_utils ``_compute_proportional_rope_parameters``)
    if isinstance(f, torch.Tensor) and not f.is_meta and f.numel() and not bool((torch.isfinite(f) & (f >= 0)).all()):
        bad = f[~(torch.isfinite(f) & (f >= 0))][0].item()
        yield "inv_freq", bad, "must be finite and >= 0 (inv_freq = 1 / rope_theta^(2i/d): rope_theta must be a finite number > 0)"


@_check("rope")
def _rope(a: dict) -> Iterator[Violation]:
    from nhil.compiler.primitives_rope import ROPE_STYLES

    yield from _at_least(a, "head_dim", 2)
    yield from _one_of(a, "style", ROPE_STYLES)
    hd, rd = a["head_dim"], a["rotary_dim"]
    if rd is not None:
        if not (isinstance(rd, int) and 2 <= rd and rd % 2 == 0 and (not isinstance(hd, int) or rd <= hd)):
            yield "rotary_dim", rd, f"must be an even integer in [2, head_dim={hd}]"
    width = _last_dim(a, "x")
    if isinstance(hd, int) and hd >= 2 and width is not None and width % hd:
        yield "head_dim", hd, f"must divide the projection width {width}"


@_check("narrow")
def _narrow(a: dict) -> Iterator[Violation]:
    yield from _at_least(a, "start", 0)
    yield from _at_least(a, "length", 1)


@_check("attention_kv", "attention")
def _attention(a: dict) -> Iterator[Violation]:
    yield from _at_least(a, "num_heads", 1)
    yield from _at_least(a, "num_kv_heads", 1)
    yield from _divides(a, "num_heads", "num_kv_heads")
    yield from _positive(a, "scale")
    yield from _at_least(a, "window", 1, optional=True)
    yield from _positive(a, "softcap", optional=True)


@_check("silu_mul", "add")
def _none(a: dict) -> Iterator[Violation]:
    return iter(())


@_check("gelu")
def _gelu(a: dict) -> Iterator[Violation]:
    from nhil.compiler.primitives_dense import GELU_VARIANTS

    yield from _one_of(a, "variant", GELU_VARIANTS)


@_check("pos_embedding")
def _pos_embedding(a: dict) -> Iterator[Violation]:
    return iter(())


def _experts(a: dict) -> Iterator[Violation]:
    """``num_experts`` >= 1 and 1 <= ``top_k`` <= ``num_experts`` (nhil::moe, nhil::moe_experts)."""
    yield from _at_least(a, "num_experts", 1)
    yield from _at_least(a, "top_k", 1)
    e, k = a["num_experts"], a["top_k"]
    if isinstance(e, int) and isinstance(k, int) and k > e:
        yield "top_k", k, f"must be <= num_experts={e}"


@_check("moe")
def _moe(a: dict) -> Iterator[Violation]:
    yield from _experts(a)
    yield from _one_of(a, "score_func", SCORE_FUNCS)
    yield from _one_of(a, "act", MOE_ACTS)
    yield from _one_of(a, "experts_layout", EXPERT_LAYOUTS)
    yield from _at_least(a, "n_group", 1)
    yield from _divides(a, "num_experts", "n_group")
    yield from _at_least(a, "topk_group", 1)
    g, tg = a["n_group"], a["topk_group"]
    if isinstance(g, int) and isinstance(tg, int) and tg > g:
        yield "topk_group", tg, f"must be <= n_group={g}"
    yield from _positive(a, "routed_scaling_factor")
    yield from _finite_attr(a, "swiglu_alpha")
    yield from _positive(a, "swiglu_limit")


@_check("attention_scores", "attention_values")
def _attention_halves(a: dict) -> Iterator[Violation]:
    yield from _at_least(a, "num_heads", 1)
    yield from _at_least(a, "num_kv_heads", 1)
    yield from _divides(a, "num_heads", "num_kv_heads")


@_check("moe_experts")
def _moe_experts(a: dict) -> Iterator[Violation]:
    yield from _experts(a)


@_check("mla_kv", "mla")
def _mla(a: dict) -> Iterator[Violation]:
    for n in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        yield from _at_least(a, n, 1)
    yield from _at_least(a, "qk_rope_head_dim", 2)
    if isinstance(a["qk_rope_head_dim"], int) and a["qk_rope_head_dim"] % 2:
        yield "qk_rope_head_dim", a["qk_rope_head_dim"], "must be even (RoPE rotates pairs)"
    yield from _positive(a, "scale")
    yield from _at_least(a, "q_lora_rank", 1, optional=True)


# ---------------------------------------------------------------- driver
def _named_args(node: torch.fx.Node) -> dict:
    """The node's arguments by schema name, defaults filled in; tensor arguments as their values (``meta['val']``
    or, for graph constants, the tensor itself)."""
    schema = node.target._schema
    out = {}
    pos = list(node.args)
    for i, arg in enumerate(schema.arguments):
        if i < len(pos) and not arg.kwarg_only:
            v = pos[i]
        elif arg.name in node.kwargs:
            v = node.kwargs[arg.name]
        else:
            v = arg.default_value if arg.has_default_value() else None
        out[arg.name] = v
    return out


def _tensor_of(gm: torch.fx.GraphModule, v):
    if not isinstance(v, torch.fx.Node):
        return v
    if v.op == "get_attr":
        t = gm
        for part in v.target.split("."):
            t = getattr(t, part, None)
        if isinstance(t, torch.Tensor):
            return t
    return v.meta.get("val")


def check_attributes(gm: torch.fx.GraphModule) -> None:
    """Check the attributes of every ``nhil::*`` node of a raised graph (see the module docstring).

    Raises:
        CompileError: the first violated rule, e.g. ``nhil::attention_kv attribute softcap = -5.0
            at model.model.layers.0.self_attn: must be a finite number > 0``, with every other
            violation of the same node.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "nhil":
            continue
        name = f"nhil::{node.target._opname}"
        check = ATTR_CHECKS.get(name)
        if check is None:
            raise CompileError(f"{name} at {node.meta.get('nn_module_stack_path', '?')} has no attribute check (nhil.compiler.attr_checks)")
        args = {k: _tensor_of(gm, v) for k, v in _named_args(node).items()}
        bad = list(check(args))
        if bad:
            path = node.meta.get("nn_module_stack_path", "?")
            what = "; ".join(f"attribute {attr} = {val!r}: {rule}" for attr, val, rule in bad)
            raise CompileError(f"{name} at {path}: {what}. The value comes from the model's config; fix the config "
                               f"(a raised primitive never runs with attributes outside its definition)")
