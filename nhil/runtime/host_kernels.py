"""Host kernels: the parts of a step that run on the host CPU, not in PIM.

Each kernel takes fp32 numpy views of host buffers/images and writes its outputs. Where
a graph-IR primitive exists, the kernel calls its reference kernel (``torch.ops.nhil``)
so host numerics are exactly the graph IR's. ``masked_softmax`` is the host half of
decode attention: ``softmax(scale * scores)`` over cache positions ``<= pos`` in fp32
(``torch.softmax``), positions beyond ``pos`` get probability exactly 0 — the same
computation SDPA does with a boolean causal mask.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nhil.errors import RunError

KERNELS: dict[str, Callable] = {}
ARITY: dict[str, tuple[tuple[int, int | None], tuple[int, int | None]]] = {}  # name -> ((min, max) inputs, (min, max) outputs)
VALIDATORS: dict[str, Callable] = {}  # name -> fn(n_inputs, n_outputs, attrs) -> reason | None, after the type checks
_ATTR_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list,)}


def kernel(name: str, n_in: int | tuple = (0, None), n_out: int | tuple = (0, None)):
    """Register a host kernel ``fn(inputs: list, outputs: list[np.ndarray], ctx: dict, **attrs)``.

    ``n_in`` / ``n_out``: how many input / output names it takes (a count, or ``(min, max)``, max
    None = unbounded); the attribute names, types (annotations) and defaults come from the
    signature. :func:`check_host_op` checks a program's host ops against both at load.
    """

    def deco(fn):
        KERNELS[name] = fn
        ARITY[name] = tuple((a, a) if isinstance(a, int) else a for a in (n_in, n_out))
        return fn

    return deco


def check_host_op(kernel_name: str, n_inputs: int, n_outputs: int, attrs: dict) -> str | None:
    """Why a host op cannot run (unknown kernel, wrong arity, missing/unknown/ill-typed attribute), or None.

    Attribute types are the kernel signature's annotations (``int``, ``float`` (int accepted),
    ``bool``, ``str``, ``list``, optionally ``| None``).
    """
    import inspect

    fn = KERNELS.get(kernel_name)
    if fn is None:
        return f"unknown host kernel {kernel_name!r} (this nhil has {', '.join(sorted(KERNELS))})"
    for what, n, (lo, hi) in (("inputs", n_inputs, ARITY[kernel_name][0]), ("outputs", n_outputs, ARITY[kernel_name][1])):
        if n < lo or (hi is not None and n > hi):
            want = str(lo) if lo == hi else f"{lo}..{hi if hi is not None else 'any'}"
            return f"{kernel_name} takes {want} {what}, got {n}"
    params = list(inspect.signature(fn).parameters.values())[3:]
    names = {p.name for p in params}
    unknown = sorted(set(attrs) - names)
    if unknown:
        return f"{kernel_name} has no attribute(s) {unknown} (attributes: {sorted(names)})"
    for p in params:
        if p.name not in attrs:
            if p.default is inspect.Parameter.empty:
                return f"{kernel_name} needs attribute {p.name!r}"
            continue
        v = attrs[p.name]
        ann = str(p.annotation).replace(" ", "")
        optional = ann.endswith("|None")
        base = ann.removesuffix("|None")
        if v is None and optional:
            continue
        ok = _ATTR_TYPES.get(base)
        if ok is not None and (not isinstance(v, ok) or (base != "bool" and isinstance(v, bool))):
            return f"{kernel_name} attribute {p.name}={v!r:.40} is a {type(v).__name__}, expected {ann.replace('|', ' | ')}"
    check = VALIDATORS.get(kernel_name)
    return check(n_inputs, n_outputs, attrs) if check is not None else None


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float32))


class _Reference:
    """``torch.ops.nhil`` without the dispatcher: each attribute is the op's reference kernel itself (the function
    ``torch.ops.nhil.<name>`` dispatches to on CPU tensors, so the same bits), saving the dispatch per host call."""

    def __getattr__(self, name):
        import nhil.compiler.primitives  # noqa: F401  (registers every op and its reference kernel)
        from nhil.compiler.primitives_lib import REFERENCE

        fn = REFERENCE.get(name) or getattr(torch.ops.nhil, name)
        setattr(self, name, fn)
        return fn


_REFERENCE = _Reference()


def _ops():
    return _REFERENCE


@kernel("embedding", 2, 1)
def embedding(inputs, outputs, ctx, scale: float | None = None):
    table, token = inputs
    if not 0 <= token < table.shape[0]:
        raise RunError(f"token id {token} outside the vocabulary of {table.shape[0]}")
    outputs[0][:] = _ops().embedding(_t(table), torch.tensor([[token]]), scale).reshape(-1).numpy()


@kernel("rms_norm", 2, 1)
def rms_norm(inputs, outputs, ctx, eps: float, head_dim: int | None = None, unit_offset: bool = False):
    x, w = inputs
    outputs[0][:] = _ops().rms_norm(_t(x).reshape(1, 1, -1), _t(w), eps, head_dim, unit_offset).reshape(-1).numpy()


@kernel("rope_cos_sin", 2, 2)
def rope_cos_sin(inputs, outputs, ctx, attention_scaling: float, half: bool = False):
    pos, inv_freq = inputs
    cos, sin = _ops().rope_cos_sin(torch.tensor([[pos]]), _t(inv_freq), attention_scaling, half=half)
    outputs[0][:] = cos.reshape(-1).numpy()
    outputs[1][:] = sin.reshape(-1).numpy()


@kernel("rope", 3, 1)
def rope(inputs, outputs, ctx, head_dim: int, rotary_dim: int | None = None, style: str = "rotate_half"):
    x, cos, sin = inputs
    y = _ops().rope(_t(x).reshape(1, 1, -1), _t(cos).reshape(1, 1, -1), _t(sin).reshape(1, 1, -1), head_dim, rotary_dim, style=style)
    outputs[0][:] = y.reshape(-1).numpy()


@kernel("silu_mul", 2, 1)
def silu_mul(inputs, outputs, ctx):
    g, u = inputs
    outputs[0][:] = _ops().silu_mul(_t(g), _t(u)).numpy()


@kernel("add", 2, 1)
def add(inputs, outputs, ctx):
    a, b = inputs
    outputs[0][:] = _ops().add(_t(a), _t(b)).numpy()


@kernel("masked_softmax", (2, 3), 1)
def masked_softmax(inputs, outputs, ctx, num_heads: int, max_len: int, scale: float, window: int | None = None, softcap: float | None = None, sinks: bool = False):
    """Host half of decode attention: ``softmax(cap(scale * scores))`` over the visible keys.

    Visible: ``j <= pos`` and, with a sliding ``window`` W, ``j > pos - W``
    (``nhil::attention_kv``'s mask, ``primitives.visible_mask``); ``softcap`` c applies
    ``c * tanh(s / c)`` to the scaled logits first (Gemma 2). Masked keys get exactly 0.
    ``sinks`` (GPT-OSS): ``inputs[2]`` holds one sink logit per head, appended as an extra
    column; ``softmax(s - max)`` over keys + sink, sink column dropped
    (``primitives_attention._attend_sinks``), so the probabilities of a row sum to less than 1.
    """
    scores, pos = inputs[:2]
    sink = inputs[2] if sinks else None
    outputs[0][:] = masked_softmax_rows(_t(scores).reshape(1, num_heads, max_len), [pos], scale, window, softcap, sink).reshape(-1).numpy()


def masked_softmax_rows(scores: torch.Tensor, pos: list[int], scale: float, window: int | None = None, softcap: float | None = None,
                        sink: np.ndarray | None = None) -> torch.Tensor:
    """:func:`masked_softmax` of T tokens at once (token t at position ``pos[t]``; the prefill runtime's batched call,
    ``nhil.runtime.host_batch``, and the per-token kernel with T = 1).

    Args:
        scores: fp32 [T, H, L] raw q·K scores; pos: T positions; sink: fp32 [H] sink logits (GPT-OSS) or None.
    Returns:
        fp32 [T, H, L] probabilities, exactly 0 at masked keys.
    """
    from nhil.compiler.primitives import visible_mask

    T, H, _ = scores.shape
    s = scores * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    visible = visible_mask(torch.tensor(list(pos)), scores.shape[2], window)  # [T, L]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    if sink is not None:
        comb = torch.cat([s, _t(sink).reshape(1, H, 1).expand(T, H, 1)], dim=-1)
        comb = comb - comb.max(dim=-1, keepdim=True).values
        return torch.softmax(comb, dim=-1)[:, :, :-1]
    return torch.softmax(s, dim=-1)


@kernel("narrow", 1, 1)
def narrow(inputs, outputs, ctx, start: int, length: int):
    (x,) = inputs
    outputs[0][:] = _ops().narrow(_t(x), start, length).numpy()


@kernel("gelu_mul", 2, 1)
def gelu_mul(inputs, outputs, ctx, approximate: str = "tanh"):
    g, u = inputs
    outputs[0][:] = _ops().gelu_mul(_t(g), _t(u), approximate).numpy()


@kernel("softcap", 1, 1)
def softcap(inputs, outputs, ctx, cap: float):
    (x,) = inputs
    outputs[0][:] = _ops().softcap(_t(x), cap).numpy()


@kernel("moe_route", (1, 2), 1)
def moe_route(inputs, outputs, ctx, top_k: int, norm_topk_prob: bool = True, score_func: str = "softmax", softmax_after_topk: bool = False, n_group: int = 1, topk_group: int = 1,
              routed_scaling_factor: float = 1.0):
    """MoE routing on the host: router logits [E] (and, for the DeepSeek sigmoid rule, the
    ``e_score_correction_bias`` [E] as a second input) -> ``route`` = [expert ids (fp32) ...,
    weights ...] (``2*top_k``, slot order), by ``primitives.moe_routing`` (the reference
    kernel's routing; ``softmax_after_topk``: GPT-OSS top-k then softmax, logits incl. the router bias)."""
    from nhil.compiler.primitives import moe_routing

    logits = inputs[0]
    bias = _t(inputs[1]) if len(inputs) > 1 else None
    w, ids = moe_routing(_t(logits).reshape(1, -1), top_k, score_func, norm_topk_prob, bias, n_group, topk_group, routed_scaling_factor,
                         softmax_after_topk=softmax_after_topk)
    outputs[0][:top_k] = ids.reshape(-1).numpy().astype(np.float32)
    outputs[0][top_k:] = w.reshape(-1).numpy()


@kernel("moe_pack", 2, 1)
def moe_pack(inputs, outputs, ctx, top_k: int):
    """Route buffer ``[ids ..., weights ...]`` of ``nhil::moe_experts`` from its host-ATen ids and weights (k each)."""
    ids, w = inputs
    if len(ids) != top_k or len(w) != top_k:
        raise RunError(f"moe_pack: {len(ids)} ids and {len(w)} weights for top_k={top_k}")
    outputs[0][:top_k] = ids
    outputs[0][top_k:] = w


@kernel("moe_expert", (0, None), (0, None))
def moe_expert(inputs, outputs, ctx, layer: int, expert: int):
    """Marker opening expert ``expert``'s sub-program; the Runner never calls it in the
    linear stream (it skips sub-programs and runs them from ``moe_dispatch``)."""
    raise RunError(f"moe_expert marker (layer {layer}, expert {expert}) reached in the linear stream: this runtime does not implement MoE dispatch")


@kernel("moe_dispatch", (1, None), 1)
def moe_dispatch(inputs, outputs, ctx, layer: int, experts: list, top_k: int, num_experts: int):
    """Combine of a MoE layer after the Runner ran the routed experts' sub-programs:
    ``out = (stack(y[id_j]) * w[:, None]).view(1, k, H).sum(1)`` over the k slots, as
    ``primitives.moe_ref``. inputs = [route, y_0 .. y_{E-1}] (unrouted y_e are stale, unread)."""
    route = inputs[0]
    ids = [int(i) for i in route[:top_k]]
    w = _t(route[top_k : 2 * top_k])
    ys = torch.stack([_t(inputs[1 + e]) for e in ids])
    y = ys * w.unsqueeze(-1)
    outputs[0][:] = y.view(1, top_k, -1).sum(dim=1).reshape(-1).numpy()


@kernel("layer_norm", (1, 3), 1)
def layer_norm(inputs, outputs, ctx, eps: float, has_weight: bool = True, has_bias: bool = True, width: int | None = None):
    """LayerNorm of one token: inputs = [x, weight (if has_weight), bias (if has_bias)] -> ``nhil::layer_norm``;
    ``width``: normalise each run of ``width`` elements (a per-head norm), default the whole token."""
    it = iter(inputs[1:])
    w = _t(next(it)) if has_weight else None
    b = _t(next(it)) if has_bias else None
    x = _t(inputs[0]).reshape(1, 1, -1) if width is None else _t(inputs[0]).reshape(1, -1, width)
    outputs[0][:] = _ops().layer_norm(x, w, b, eps).reshape(-1).numpy()


@kernel("gelu", 1, 1)
def gelu(inputs, outputs, ctx, variant: str = "gelu_new"):
    (x,) = inputs
    outputs[0][:] = _ops().gelu(_t(x), variant).numpy()


@kernel("pos_embedding", 3, 1)
def pos_embedding(inputs, outputs, ctx):
    """Learned absolute position of the step: ``x + table[pos]`` (``nhil::pos_embedding``)."""
    x, table, pos = inputs
    if not 0 <= pos < table.shape[0]:
        raise RunError(f"position {pos} is beyond the {table.shape[0]} learned position embeddings (n_positions) of the model")
    outputs[0][:] = _ops().pos_embedding(_t(x).reshape(1, 1, -1), _t(table), torch.tensor([[pos]])).reshape(-1).numpy()


@kernel("moe_shared_add", (2, 3), 1)
def moe_shared_add(inputs, outputs, ctx, gated: bool = True):
    """Shared expert of a MoE layer added to the routed combine: inputs = [routed [H],
    shared [H], (gate logit [1])]; ``out = routed + sigmoid(gate) * shared`` (without
    ``gated``: ``routed + shared``), the same torch ops as ``primitives.moe_ref``."""
    routed, shared = _t(inputs[0]), _t(inputs[1])
    if gated:
        shared = torch.sigmoid(_t(inputs[2])) * shared
    outputs[0][:] = (routed + shared).numpy()


@kernel("moe_swiglu_clamp", 4, 1)
def moe_swiglu_clamp(inputs, outputs, ctx, alpha: float, limit: float):
    """GPT-OSS expert activation on the host: inputs = [gate GEMV [I], up GEMV [I], gate bias [I],
    up bias [I]]; ``swiglu_clamp(gate + gate_bias, up + up_bias)`` (``primitives.swiglu_clamp``,
    the bias being the even / odd entries of ``gate_up_proj_bias[e]``)."""
    from nhil.compiler.primitives import swiglu_clamp

    g, u, gb, ub = (_t(a) for a in inputs)
    outputs[0][:] = swiglu_clamp(g + gb, u + ub, alpha, limit).numpy()


@kernel("mla_rope", 4, 2)
def mla_rope(inputs, outputs, ctx, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, rope_interleave: bool = True):
    """Host half of MLA (``lower_mla`` step 1): q [H*(nope+rope)], k_rope [rope], cos/sin [rope]
    -> (q_rot of every head, RoPE'd [H*rope]; shared k_rot RoPE'd [rope]), by
    ``primitives.mla_rope_parts`` (the ``nhil::mla_kv`` reference's own code)."""
    from nhil.compiler.primitives import mla_rope_parts

    q, k_rope, cos, sin = inputs
    row = lambda a: _t(a).reshape(1, 1, -1)  # noqa: E731
    _, q_rot, k_rot = mla_rope_parts(row(q), row(k_rope), row(cos), row(sin), num_heads, qk_nope_head_dim, qk_rope_head_dim, rope_interleave)
    outputs[0][:] = q_rot.reshape(-1).numpy()
    outputs[1][:] = k_rot.reshape(-1).numpy()


@kernel("mla_pack", 4, 2)
def mla_pack(inputs, outputs, ctx, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, width: int):
    """MLA query / key rows (``lower_mla`` step 3): ``qcat_h = [q_abs_h ‖ q_rot_h ‖ 0]`` per head
    and ``kcat = [latent ‖ k_rot ‖ 0]``, each ``width`` wide (r + rope rounded up to the burst)."""
    qabs, qrot, latent, krot = inputs
    r, rope = kv_lora_rank, qk_rope_head_dim
    q = np.zeros((num_heads, width), np.float32)
    q[:, :r] = np.asarray(qabs).reshape(num_heads, r)
    q[:, r : r + rope] = np.asarray(qrot).reshape(num_heads, rope)
    outputs[0][:] = q.reshape(-1)
    outputs[1][:] = 0.0
    outputs[1][:r] = latent
    outputs[1][r : r + rope] = krot


@kernel("aten_graph", (0, None), (1, None))
def aten_graph(inputs, outputs, ctx, ops: list, in_specs: list, out_specs: list):
    """A host ATen region: the exported ops themselves, run in the exported dtype (``nhil.runtime.aten_graph``)."""
    from nhil.runtime import aten_graph as ag

    ag.run(ops, in_specs, out_specs, inputs, outputs)


def _check_aten_graph(n_inputs: int, n_outputs: int, attrs: dict) -> str | None:
    from nhil.runtime import aten_graph as ag

    if len(attrs["in_specs"]) != n_inputs or len(attrs["out_specs"]) != n_outputs:
        return f"aten_graph has {n_inputs} inputs / {n_outputs} outputs but specs for {len(attrs['in_specs'])} / {len(attrs['out_specs'])}"
    return ag.check_spec(attrs["ops"], attrs["in_specs"], attrs["out_specs"])


VALIDATORS["aten_graph"] = _check_aten_graph

from nhil.runtime import host_kv_fp8 as _host_kv_fp8  # noqa: E402,F401 - registers the FP8 KV-cache kernels
from nhil.runtime import host_act_quant as _host_act_quant  # noqa: E402,F401 - registers the W8A8 activation kernels
