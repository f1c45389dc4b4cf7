"""Lowering of decode attention over a KV cache kept in the banks (AttAcc/CENT mapping).

KV layout for one layer (``docs/isa.md`` section "KV-cache layout"), ``S = slots``
(channels x banks), ``L`` = max cache length, ``Hkv`` KV heads of ``hd`` elements:

* **K**: position ``t`` lives in slot ``t % S`` of row ``K_base + t // S``; within the
  row, columns ``[h*hd, (h+1)*hd)`` hold ``k_t`` of KV head ``h``. q·Kᵀ for query head
  ``j`` is then one all-bank MAC_AB over the ``hd/16`` bursts of its KV head with
  ``q_j`` written to the same columns of the global buffer: one score per slot.
* **V** is stored transposed: element ``(h, d)`` of ``v_t`` lives in slot
  ``u = h*hd + d`` (group ``u // S``), row ``V_base + group*RL + t // cols``, column
  ``t % cols`` (``RL = ceil(L / cols)``). p·V is then a GEMV: the softmax row ``p_j``
  goes to the global buffer and one MAC_AB gives all ``hd`` outputs of the head.
* Appends are WR_SBK bursts with position-relative flags: K uses ``POS_SLOT`` (slot and
  row from the position), V uses ``POS_COL`` (column burst, lane mask and row from the
  position). The host runtime binds them per step; devices see plain addresses.

Scores of positions beyond the current one are masked on the host (softmax gives an
exact 0), so stale cache contents never reach the output; the cache rows start zeroed.
Softmax (with its scale and causal mask) runs on the host, as in CENT/AttAcc/NeuPIMs.
"""

from __future__ import annotations

import dataclasses
import math

from nhil.errors import CompileError
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Op
from nhil.compiler.builder import ZEROS, ProgramBuilder
from nhil.isa.program import BankImage
from nhil.compiler.lowering import LowerCtx, lowering


@dataclasses.dataclass
class KvLayout:
    """Rows reserved for one layer's KV cache (see the module docstring)."""

    layer: int
    k_base: int
    k_rows: int
    v_base: int
    v_rows_per_group: int
    v_groups: int
    max_len: int
    kv_heads: int
    head_dim: int


def place_kv(b: ProgramBuilder, layer: int, max_len: int, kv_heads: int, head_dim: int, fp8_v_scales=None) -> KvLayout:
    """Reserve zero-filled rows for one layer's K and Vᵀ caches (``fp8_v_scales`` [kv_heads]: an fp8 cache,
    ``nhil.numerics.kv_fp8``: Vᵀ rows of ``P`` positions whose 4-byte header holds the slot's head scale).

    Raises:
            CompileError: head_dim not a multiple of the burst, or KV heads wider than a row.
    """
    d = b.d
    if fp8_v_scales is not None:
        return _place_kv_fp8(b, layer, max_len, kv_heads, head_dim, fp8_v_scales)
    if head_dim % d.lanes:
        raise CompileError(f"head_dim {head_dim} is not a multiple of the {d.lanes}-lane burst; attention cannot be mapped on device {d.name}")
    if kv_heads * head_dim > min(d.cols, d.gb_elems):
        raise CompileError(f"{kv_heads} KV heads x {head_dim} = {kv_heads * head_dim} elements exceed a row/global buffer of {min(d.cols, d.gb_elems)} on device {d.name}")
    k_rows = math.ceil(max_len / d.slots)
    k_base = b.alloc_rows(k_rows)
    rl = math.ceil(max_len / d.cols)
    groups = math.ceil(kv_heads * head_dim / d.slots)
    v_base = b.alloc_rows(rl * groups)
    return KvLayout(layer, k_base, k_rows, v_base, rl, groups, max_len, kv_heads, head_dim)


def _place_kv_fp8(b: ProgramBuilder, layer: int, max_len: int, kv_heads: int, head_dim: int, v_scales) -> KvLayout:
    import numpy as np

    from nhil.numerics.formats import FP8_BLOCK
    from nhil.numerics.kv_fp8 import v_positions_per_row

    d = b.d
    if head_dim not in FP8_BLOCK:
        raise CompileError(f"--kv-cache fp8: head_dim {head_dim} has no fp8-e4m3-b<hd> K-row format (head_dim in {sorted(FP8_BLOCK)})")
    if kv_heads * (head_dim + 4) > 2 * d.cols:
        raise CompileError(f"--kv-cache fp8: {kv_heads} KV heads x ({head_dim} codes + 4 scale bytes) exceed a {2 * d.cols}-byte row of device {d.name}")
    k_rows = math.ceil(max_len / d.slots)
    k_base = b.alloc_rows(k_rows)
    rl = math.ceil(max_len / v_positions_per_row(d.cols, d.lanes))
    groups = math.ceil(kv_heads * head_dim / d.slots)
    v_base = b.alloc_rows(rl * groups, zero=False)
    hdr = np.zeros((d.slots, d.cols), np.uint16)
    for g in range(groups):
        for s in range(d.slots):
            u = g * d.slots + s
            if u < kv_heads * head_dim:
                hdr[s, :2] = np.asarray([v_scales[u // head_dim]], "<f4").view("<u2")
        img = hdr.reshape(d.channels, d.banks, d.cols).copy()
        b.bank_images.extend(BankImage(v_base + g * rl + r, img) for r in range(rl))
        hdr[:] = 0
    return KvLayout(layer, k_base, k_rows, v_base, rl, groups, max_len, kv_heads, head_dim)


def lower_bias(b: ProgramBuilder, acc: str, bias_name: str, bias, out: str, n: int) -> None:
    """Linear bias: ``out = acc + bias`` as a host kernel after the GEMV's RD_ACC (fp32).

    Chosen over preloading the accumulators with WR_ACC because the GEMV emitter
    (``ProgramBuilder.gemv``) zeroes its accumulators itself and is shared with the
    quantized-weight lowering; a host add of one vector per biased projection is cheap.
    """
    b.buffer(acc, n)
    b.host_image(bias_name, bias)
    b.host("add", [acc, bias_name], [out])


def lower_decode_attention(b: ProgramBuilder, kv: KvLayout, q: str, k: str, v: str, out: str, num_heads: int, scale: float, name: str,
                           window: int | None = None, softcap: float | None = None, sinks: str | None = None,
                           kv_fp8: tuple[str, str] | None = None) -> None:
    """Emit KV append, q·Kᵀ (PIM), masked softmax (host), p·V (PIM) for one decode token.

    Buffers: ``q`` [num_heads*hd], ``k``/``v`` [kv_heads*hd] (k already RoPE'd), ``out``
    [num_heads*hd] (heads concatenated). ``name`` prefixes the scratch buffers.
    ``window`` (sliding window W: keys ``pos-W < j <= pos``) and ``softcap`` (logit
    soft-cap ``c*tanh(s/c)``) are attributes of the host softmax; the PIM part is the same.
    ``sinks``: host image of the per-head sink logits [num_heads] (GPT-OSS), an extra
    softmax input (its column is dropped after the softmax).
    ``kv_fp8``: host images of the (k, v) scales [kv_heads]: the cache holds E4M3 codes
    (``nhil.numerics.kv_fp8``): k / v quantized on the host, K rows written as raw words,
    Vᵀ appends as byte writes; the MACs read K as ``fp8-e4m3-b<hd>`` and Vᵀ as ``fp8-e4m3``.
    """
    d = b.d
    hd, hkv, L, S = kv.head_dim, kv.kv_heads, kv.max_len, d.slots
    per_row = d.cols
    k_fmt = v_fmt = None
    # -- KV append (positions bound at run time)
    if kv_fp8 is not None:
        from nhil.numerics.formats import FP8_BLOCK, FP8_E4M3
        from nhil.numerics.kv_fp8 import v_positions_per_row

        per_row, k_fmt, v_fmt = v_positions_per_row(d.cols, d.lanes), FP8_BLOCK[hd], FP8_E4M3
        nw = hkv * (hd + 4) // 2
        kw, vq = b.buffer(f"{name}.k_fp8", nw), b.buffer(f"{name}.v_fp8", hkv * hd)
        b.raw_buffers.update((kw, vq))
        b.host("kv_fp8_k", [k, kv_fp8[0]], [kw], head_dim=hd)
        b.host("kv_fp8_v", [v, kv_fp8[1]], [vq], head_dim=hd)
        for c in range(math.ceil(nw / d.lanes)):
            cnt = min(d.lanes, nw - c * d.lanes)
            b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_SLOT, row=kv.k_base, col=c, imm=(1 << cnt) - 1, operand=b.operand(kw, c * d.lanes, cnt))
        for u in range(hkv * hd):
            g, s = divmod(u, S)
            b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_COL, ch=s // d.banks, bank=s % d.banks, row=kv.v_base + g * kv.v_rows_per_group, k=3, operand=b.operand(vq, u, 1))
    else:
        append_k(b, kv, k)
        append_v(b, kv, v)
    if k_fmt is not None:
        b.want_wfmt(k_fmt.code, k_fmt.name)
    scores = b.buffer(f"{name}.scores", num_heads * L)
    attention_scores(b, kv, q, scores, num_heads)
    b.want_wfmt(0)
    # -- softmax on the host
    probs = b.buffer(f"{name}.probs", num_heads * L)
    extra = {}
    if window is not None:
        extra["window"] = int(window)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if sinks is not None:
        extra["sinks"] = True
    b.host("masked_softmax", [scores, "$pos"] + ([sinks] if sinks is not None else []), [probs], num_heads=num_heads, max_len=L, scale=float(scale), **extra)
    b.invalidate_gb()
    attention_values(b, kv, probs, out, num_heads, v_fmt=v_fmt, per_row=per_row)


@lowering("nhil::attention_kv")
def _attention_kv(cx: LowerCtx, node) -> None:
    """Decode attention over the static KV cache: KV rows placed here (:func:`place_kv`), then :func:`lower_decode_attention`."""
    q, k, v, kc, _vc, _cpos, hq, hkv, scale = node.args[:9]
    window, softcap = (list(node.args[9:]) + [None, None])[:2]
    kshape = cx.const(kc).shape  # [B, Hkv, L, hd]
    layer = cx.next_attention_layer()
    fp8 = cx.quant is not None and getattr(cx.quant, "kv_cache", "bf16") == "fp8"
    ks, vs = cx.quant.kv_scales(layer, int(hkv)) if fp8 else (None, None)
    kv = place_kv(cx.b, layer, int(kshape[2]), int(hkv), int(kshape[3]), fp8_v_scales=vs)
    cx.kv_layouts[layer] = kv
    out = cx.out(node)
    sinks = node.kwargs.get("sinks")
    if sinks is not None:  # GPT-OSS per-head sink logits: a host image read by the host softmax
        sinks = cx.image(sinks)
    kv_fp8 = (cx.b.host_image(f"attn{layer}.k_scale", ks), cx.b.host_image(f"attn{layer}.v_scale", vs)) if fp8 else None
    lower_decode_attention(cx.b, kv, cx.arg(q), cx.arg(k), cx.arg(v), out, int(hq), float(scale), name=f"attn{layer}", window=window, softcap=softcap,
                           sinks=sinks, kv_fp8=kv_fp8)


# ---------------------------------------------------------------- the steps of decode attention
# (lower_decode_attention runs them in order; eager attention's nhil::attention_scores / attention_values
# run them around its host-ATen score transform)

def append_k(b: ProgramBuilder, kv: KvLayout, k: str) -> None:
    """K append: ``k`` [Hkv*hd] into slot ``pos % S`` of row ``K_base + pos // S`` (WR_SBK, POS_SLOT)."""
    d = b.d
    for c in range(kv.kv_heads * kv.head_dim // d.lanes):
        b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_SLOT, row=kv.k_base, col=c, imm=0xFFFF, operand=b.operand(k, c * d.lanes, d.lanes))


def append_v(b: ProgramBuilder, kv: KvLayout, v: str) -> None:
    """Vᵀ append: element ``u`` of ``v`` into slot ``u % S``, column ``pos`` (WR_SBK, POS_COL)."""
    d = b.d
    for u in range(kv.kv_heads * kv.head_dim):
        g, s = divmod(u, d.slots)
        b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_COL, ch=s // d.banks, bank=s % d.banks, row=kv.v_base + g * kv.v_rows_per_group, operand=b.operand(v, u, 1))


def attention_scores(b: ProgramBuilder, kv: KvLayout, q: str, scores: str, num_heads: int) -> None:
    """``scores[j*L + t] = q_j · k_t`` for every query head j and cache position t (one MAC per head per K row)."""
    d = b.d
    hd, hkv, L, S = kv.head_dim, kv.kv_heads, kv.max_len, d.slots
    rep = num_heads // hkv
    nb = hd // d.lanes
    units = [(j, r) for j in range(num_heads) for r in range(kv.k_rows)]
    for u0 in range(0, len(units), d.accumulators):
        batch = units[u0 : u0 + d.accumulators]
        for a, _ in enumerate(batch):
            b.emit(Op.WR_ACC, k=a, n=S, operand=b.operand(ZEROS, 0, S))
        for a, (j, r) in enumerate(batch):
            h = j // rep
            b.write_gb(q, j * hd, hd, col=h * nb)
            b.emit(Op.MAC_AB, row=kv.k_base + r, col=h * nb, n=nb, k=a)
        for a, (j, r) in enumerate(batch):
            cnt = min(S, L - r * S)
            b.emit(Op.RD_ACC, k=a, n=cnt, operand=b.operand(scores, j * L + r * S, cnt))


def attention_values(b: ProgramBuilder, kv: KvLayout, probs: str, out: str, num_heads: int, v_fmt=None, per_row: int | None = None) -> None:
    """``out_j = p_j · Vᵀ`` rows of head j's slots (``probs`` [num_heads*L] in the global buffer, one GEMV per head).

    ``v_fmt`` / ``per_row``: an fp8 Vᵀ cache's MAC format and positions per row (default bf16, ``cols``)."""
    d = b.d
    per_row = d.cols if per_row is None else per_row
    hd, hkv, L, S = kv.head_dim, kv.kv_heads, kv.max_len, d.slots
    rep = num_heads // hkv
    jobs = []
    for j in range(num_heads):
        h = j // rep
        u0, u1 = h * hd, (h + 1) * hd
        for g in range(u0 // S, (u1 - 1) // S + 1):
            lo, hi = max(u0, g * S), min(u1, (g + 1) * S)
            jobs.append((j, g, lo, hi))
    for j0 in range(0, len(jobs), d.accumulators):
        batch = jobs[j0 : j0 + d.accumulators]
        for a, _ in enumerate(batch):
            b.emit(Op.WR_ACC, k=a, n=S, operand=b.operand(ZEROS, 0, S))
        if v_fmt is not None:
            b.want_wfmt(v_fmt.code, v_fmt.name)
        for rc in range(kv.v_rows_per_group):
            t0, t1 = rc * per_row, min(L, (rc + 1) * per_row)
            for a, (j, g, lo, hi) in enumerate(batch):
                b.write_gb(probs, j * L + t0, t1 - t0)
                b.emit(Op.MAC_AB, row=kv.v_base + g * kv.v_rows_per_group + rc, n=math.ceil((t1 - t0) / d.lanes), k=a)
        b.want_wfmt(0)
        for a, (j, g, lo, hi) in enumerate(batch):
            h = j // rep
            b.emit(Op.RD_ACC, k=a, col=lo - g * S, n=hi - lo, operand=b.operand(out, j * hd + (lo - h * hd), hi - lo))


def _eager_kv(cx: LowerCtx, cache_node) -> KvLayout | None:
    """The KV layout of an eager attention layer, placed by its ``attention_scores`` (the scores
    and values of one layer come in that order in the graph)."""
    pending = cx.__dict__.setdefault("_eager_pending", [])
    return pending.pop(0) if pending else None


@lowering("nhil::attention_scores")
def _attention_scores(cx: LowerCtx, node) -> None:
    """Eager attention, first half: KV rows placed, K append, q·Kᵀ for every cache position (PIM)
    into the node's [Hq*L] buffer (``nhil.compiler.primitives_attention``)."""
    from nhil.errors import CompileError

    q, k, kc, _cpos, hq, hkv = node.args
    if cx.quant is not None and getattr(cx.quant, "kv_cache", "bf16") not in (None, "bf16"):
        raise CompileError(f"nhil::attention_scores at {node.name}: eager attention keeps a bf16 KV cache; kv_cache={cx.quant.kv_cache} is not supported for it")
    kshape = cx.const(kc).shape  # [B, Hkv, L, hd]
    layer = cx.next_attention_layer()
    kv = place_kv(cx.b, layer, int(kshape[2]), int(hkv), int(kshape[3]))
    cx.kv_layouts[layer] = kv
    cx.__dict__.setdefault("_eager_pending", []).append(kv)
    out = cx.out(node)
    append_k(cx.b, kv, cx.arg(k))
    attention_scores(cx.b, kv, cx.arg(q), out, int(hq))


@lowering("nhil::attention_values")
def _attention_values(cx: LowerCtx, node) -> None:
    """Eager attention, second half: V append, p·V (PIM) with the host-ATen probabilities."""
    from nhil.errors import CompileError

    probs, v, vc, _cpos, hq, hkv = node.args
    kv = _eager_kv(cx, vc)
    if kv is None or tuple(cx.const(vc).shape[1:]) != (kv.kv_heads, kv.max_len, kv.head_dim):
        raise CompileError(f"nhil::attention_values {node.name} has no matching nhil::attention_scores before it")
    out = cx.out(node)
    append_v(cx.b, kv, cx.arg(v))
    cx.b.invalidate_gb()
    attention_values(cx.b, kv, cx.arg(probs), out, int(hq))
