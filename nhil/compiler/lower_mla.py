"""Lowering of ``nhil::mla_kv`` (DeepSeek-V2/V3 multi-head latent attention) in absorbed form.

The graph IR (and transformers) runs MLA *expanded*: every step it up-projects the whole
latent cache with ``kv_b_proj`` ([L, r] -> [L, H*(nope+v)]), then runs ordinary attention.
On PIM that would be an L-row GEMM per step. The lowering instead runs the algebraically
equal *absorbed* form of the DeepSeek-V2 paper (arXiv:2405.04434, section 2.1.2-2.1.3:
W^UK is absorbed into W^Q and W^UV into W^O), which is MQA over the compressed latent:

* with ``W_kv_b`` rows of head h split into ``W_UK_h`` [nope, r] and ``W_UV_h`` [v, r],
  score_h(t) = q_nope_h · (W_UK_h c_t) + q_rot_h · k_rot_t
             = (W_UK_hᵀ q_nope_h) · c_t + q_rot_h · k_rot_t, and
  o_h = Σ_t p_h(t) W_UV_h c_t = W_UV_h (Σ_t p_h(t) c_t).

Per decode token and layer (``r`` = kv_lora_rank, ``kd`` = r + rope rounded up to the
burst, buffers fp32 on the host):

1. ``HOST mla_rope``: RoPE of every head's q_rot and of the shared k_rot (interleaved or
   rotate-half, :func:`nhil.compiler.primitives.mla_rope_parts`, the reference's own code).
2. PIM GEMV per head: ``q_abs_h = W_UK_hᵀ q_nope_h`` ([r, nope] matrix in the banks).
3. ``HOST mla_pack``: ``qcat_h = [q_abs_h ‖ q_rot_h ‖ 0]`` and ``kcat = [c ‖ k_rot ‖ 0]`` (kd wide).
4. Attention over the latent cache in the banks (one KV "head"): K rows hold ``kcat_t``
   (``lower_attention`` K layout, append WR_SBK POS_SLOT), V rows hold ``c_t`` transposed
   (r slots, append WR_SBK POS_COL); q·Kᵀ MAC_AB per head, ``masked_softmax`` on the host
   (scale incl. the YaRN mscale), p·V MAC_AB per head -> ``ctx_h`` [r].
5. PIM GEMV per head: ``o_h = W_UV_h ctx_h`` ([v, r] matrix) -> output [H*v] (o_proj follows).

The cache in the banks holds r + rope values per position (the compressed form), not
H*(nope+v). Numerics differ from the expanded graph IR by re-association and bf16
rounding of q_abs / ctx (checked against the fp32 golden like every other model).
"""

from __future__ import annotations

import math

import torch

from nhil.compiler.builder import ZEROS, ProgramBuilder
from nhil.compiler.lower_attention import KvLayout
from nhil.compiler.lowering import LowerCtx, lowering
from nhil.errors import CompileError
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Op


def lower_mla(b: ProgramBuilder, layer: int, bufs: dict, w_name: str, w_kv_b: torch.Tensor, attrs: dict, max_len: int, out: str) -> KvLayout:
    """Emit one MLA decode step in absorbed form (see the module docstring).

    Args:
        b: the program builder.
        layer: attention-layer ordinal (names buffers and matrices).
        bufs: host buffers ``q`` [H*(nope+rope)], ``latent`` [r], ``k_rope`` [rope], ``cos``/``sin`` [rope].
        w_name, w_kv_b: state-dict name and fp32 ``kv_b_proj`` weight [H*(nope+v), r].
        attrs: ``num_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
            ``v_head_dim``, ``scale``, ``rope_interleave``.
        max_len: cache positions L.
        out: output buffer [H*v] (declared here).
    Returns:
        The :class:`KvLayout` of the latent cache (``kv_heads`` 1, ``head_dim`` kd; V rows hold r slots).
    Raises:
        CompileError: inconsistent shapes, or the latent does not fit a row / the global buffer.
    """
    d = b.d
    h, r, nope, rope, v = (int(attrs[k]) for k in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if tuple(w_kv_b.shape) != (h * (nope + v), r):
        raise CompileError(f"mla layer {layer}: kv_b_proj {tuple(w_kv_b.shape)} is not [{h}*({nope}+{v}), {r}]")
    kd = math.ceil((r + rope) / d.lanes) * d.lanes
    if kd > min(d.cols, d.gb_elems):
        raise CompileError(f"mla layer {layer}: latent + rope width {kd} exceeds a row / global buffer of {min(d.cols, d.gb_elems)} on device {d.name}")
    pre = f"mla{layer}"
    qk = nope + rope
    # 1. RoPE on the host
    qrot, krot = b.buffer(f"{pre}.qrot", h * rope), b.buffer(f"{pre}.krot", rope)
    b.host("mla_rope", [bufs["q"], bufs["k_rope"], bufs["cos"], bufs["sin"]], [qrot, krot], num_heads=h, qk_nope_head_dim=nope,
           qk_rope_head_dim=rope, rope_interleave=bool(attrs["rope_interleave"]))
    # 2. q_abs_h = W_UK_h^T q_nope_h (PIM)
    w = w_kv_b.detach().to(torch.float32).view(h, nope + v, r)
    qabs = b.buffer(f"{pre}.qabs", h * r)
    b.invalidate_gb()
    for j in range(h):
        p = b.place_matrix(f"{w_name}.uk_t.{j}", w[j, :nope].t().contiguous())
        b.gemv(p, bufs["q"], qabs, x_off=j * qk, y_off=j * r)
    # 3. pack query / key rows
    qcat, kcat = b.buffer(f"{pre}.qcat", h * kd), b.buffer(f"{pre}.kcat", kd)
    b.host("mla_pack", [qabs, qrot, bufs["latent"], krot], [qcat, kcat], num_heads=h, kv_lora_rank=r, qk_rope_head_dim=rope, width=kd)
    b.invalidate_gb()
    # 4. attention over the latent cache
    S, L = d.slots, max_len
    k_rows = math.ceil(L / S)
    k_base = b.alloc_rows(k_rows)
    rl = math.ceil(L / d.cols)
    groups = math.ceil(r / S)
    v_base = b.alloc_rows(rl * groups)
    kv = KvLayout(layer, k_base, k_rows, v_base, rl, groups, L, 1, kd)
    for c in range(kd // d.lanes):
        b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_SLOT, row=k_base, col=c, imm=0xFFFF, operand=b.operand(kcat, c * d.lanes, d.lanes))
    for u in range(r):
        g, s = divmod(u, S)
        b.emit(Op.WR_SBK, all_ch=False, flags=FLAG_POS_COL, ch=s // d.banks, bank=s % d.banks, row=v_base + g * rl, operand=b.operand(kcat, u, 1))
    nb = kd // d.lanes
    scores = b.buffer(f"{pre}.scores", h * L)
    units = [(j, rr) for j in range(h) for rr in range(k_rows)]
    for u0 in range(0, len(units), d.accumulators):
        batch = units[u0 : u0 + d.accumulators]
        for a, _ in enumerate(batch):
            b.emit(Op.WR_ACC, k=a, n=S, operand=b.operand(ZEROS, 0, S))
        for a, (j, rr) in enumerate(batch):
            b.write_gb(qcat, j * kd, kd)
            b.emit(Op.MAC_AB, row=k_base + rr, col=0, n=nb, k=a)
        for a, (j, rr) in enumerate(batch):
            cnt = min(S, L - rr * S)
            b.emit(Op.RD_ACC, k=a, n=cnt, operand=b.operand(scores, j * L + rr * S, cnt))
    probs = b.buffer(f"{pre}.probs", h * L)
    b.host("masked_softmax", [scores, "$pos"], [probs], num_heads=h, max_len=L, scale=float(attrs["scale"]))
    b.invalidate_gb()
    ctxb = b.buffer(f"{pre}.ctx", h * r)
    jobs = [(j, g, g * S, min(r, (g + 1) * S)) for j in range(h) for g in range(groups)]
    for j0 in range(0, len(jobs), d.accumulators):
        batch = jobs[j0 : j0 + d.accumulators]
        for a, _ in enumerate(batch):
            b.emit(Op.WR_ACC, k=a, n=S, operand=b.operand(ZEROS, 0, S))
        for rc in range(rl):
            t0, t1 = rc * d.cols, min(L, (rc + 1) * d.cols)
            for a, (j, g, lo, hi) in enumerate(batch):
                b.write_gb(probs, j * L + t0, t1 - t0)
                b.emit(Op.MAC_AB, row=v_base + g * rl + rc, n=math.ceil((t1 - t0) / d.lanes), k=a)
        for a, (j, g, lo, hi) in enumerate(batch):
            b.emit(Op.RD_ACC, k=a, col=0, n=hi - lo, operand=b.operand(ctxb, j * r + lo, hi - lo))
    # 5. o_h = W_UV_h ctx_h (PIM)
    b.buffer(out, h * v)
    b.invalidate_gb()
    for j in range(h):
        p = b.place_matrix(f"{w_name}.uv.{j}", w[j, nope:].contiguous())
        b.gemv(p, ctxb, out, x_off=j * r, y_off=j * v)
    return kv


_MLA_POSITIONAL = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scale", "rope_interleave", "q_lora_rank")


@lowering("nhil::mla_kv")
def _mla_kv(cx: LowerCtx, node) -> None:
    """Absorbed MLA: GEMVs and latent-cache attention in PIM, RoPE / softmax on the host (:func:`lower_mla`)."""
    q, lat, kpe, lc, _rc, _cpos, cos, sin, wkv = node.args[:9]
    attrs = dict(zip(_MLA_POSITIONAL, node.args[9:]))
    attrs.setdefault("rope_interleave", True)
    layer = cx.next_attention_layer()
    bufs = {"q": cx.arg(q), "latent": cx.arg(lat), "k_rope": cx.arg(kpe), "cos": cx.arg(cos), "sin": cx.arg(sin)}
    cx.kv_layouts[layer] = lower_mla(cx.b, layer, bufs, cx.const_name(wkv), cx.const(wkv), attrs, int(cx.const(lc).shape[2]), node.name)
