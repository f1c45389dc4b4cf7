"""Lowering of recurrent layers: states in bank rows, ``S · C`` on PIM, gates / decays / short convs / norms on the host.

Where each part runs (issue 14; ``docs/isa.md`` section "Recurrent state"):

* **SSM state** (Mamba-2, ``nhil::ssm_state_update``) of ``H`` heads x ``hd`` x ``N``: per
  group ``g`` of heads, a matrix of ``H/G * hd`` rows x ``N`` columns placed like a
  weight (``ProgramBuilder.place_matrix``: row ``o`` in slot ``o % slots`` of row-group
  ``o // slots``), zero at load. The output ``y_h = S_h · C_g`` is then an ordinary
  all-bank GEMV with ``C_g`` broadcast in the global buffer (PIM).
* **State update** ``S <- S * dA + (dt * B) ⊗ x``: each state row is read back
  (``RD_SBK``, one per row), the host computes the new rows in fp32 (``ssm_update``), and
  writes them back (``WR_SBK``, one per burst) before the GEMV. ISA v0 has no in-bank
  scaled update, so the state crosses the external bus twice per token (the timing model
  counts those bytes); an in-place scaled row update would remove that and is not built.
* **Conv state** (``nhil::causal_conv1d_update``) ``[C, K]``: flat in rows of
  channel 0 / bank 0 (``cols`` elements per row), read back, updated by the host short
  convolution (``conv_state_update``), written back.
* ``D`` skip term (``ssm_skip``), the gated RMSNorm (``rms_norm_gated``), dt softplus and
  the decay ``exp(dt * A)``: host, with the reference kernels' torch ops.

Stored states are bf16 (as KV caches); ``nhil.golden.quant_recurrent`` is the device
reference of this mapping.
"""

from __future__ import annotations

import math

import torch

from nhil.compiler.builder import MatrixPlacement, ProgramBuilder
from nhil.compiler.lowering import LowerCtx, lowering
from nhil.errors import CompileError
from nhil.isa.instr import Op


def _row_slot(b: ProgramBuilder, p: MatrixPlacement, o: int) -> tuple[int, int, int]:
    """(channel, bank, row) holding output row ``o`` of placement ``p`` (single input chunk)."""
    width = p.width or b.d.slots
    g, s = divmod(o, width)
    return s // b.d.banks, s % b.d.banks, p.rows[g][0]


def place_flat_state(b: ProgramBuilder, n: int) -> int:
    """Reserve zero rows of channel 0 / bank 0 for a flat state of ``n`` elements; returns the first row."""
    return b.alloc_rows(math.ceil(n / b.d.cols))


def read_flat_state(b: ProgramBuilder, base: int, n: int, buf: str) -> None:
    """``RD_SBK`` of a flat state (``n`` a multiple of the burst) into host buffer ``buf``."""
    d = b.d
    for r0 in range(0, n, d.cols):
        cnt = min(d.cols, n - r0)
        b.emit(Op.RD_SBK, all_ch=False, ch=0, bank=0, row=base + r0 // d.cols, col=0, n=cnt // d.lanes, operand=b.operand(buf, r0, cnt))


def write_flat_state(b: ProgramBuilder, base: int, n: int, buf: str) -> None:
    """``WR_SBK`` of a flat state from host buffer ``buf``, one per burst."""
    d = b.d
    for e in range(0, n, d.lanes):
        r, c = divmod(e, d.cols)
        b.emit(Op.WR_SBK, all_ch=False, ch=0, bank=0, row=base + r, col=c // d.lanes, imm=0xFFFF, operand=b.operand(buf, e, d.lanes))


@lowering("nhil::causal_conv1d_update")
def _conv_update(cx: LowerCtx, node) -> None:
    """Short conv on the host over the conv-state rows (module docstring)."""
    x, state, weight, bias = node.args[:4]
    activation = node.args[4] if len(node.args) > 4 else "silu"
    b, d = cx.b, cx.b.d
    _, c, k = (int(v) for v in cx.const(state).shape)
    n = math.ceil(c * k / d.lanes) * d.lanes
    base = place_flat_state(b, n)
    name = cx.const_name(state)
    rd, new = b.buffer(f"{name}.rd", n), b.buffer(f"{name}.new", n)
    read_flat_state(b, base, n, rd)
    gates = [node.kwargs.get("in_gate"), node.kwargs.get("out_gate")]
    if (gates[0] is None) != (gates[1] is None):
        raise CompileError(f"causal_conv1d_update at {node.name}: in_gate and out_gate come together (LFM2 form) or not at all")
    ins = [cx.arg(x), rd, cx.image(weight)] + ([cx.image(bias)] if bias is not None else []) + [cx.arg(g) for g in gates if g is not None]
    out = cx.out(node)
    b.host("conv_state_update", ins, [out, new], channels=c, kernel_size=k, activation=str(activation), has_bias=bias is not None,
           gated=gates[0] is not None)
    write_flat_state(b, base, n, new)
    cx.__dict__.setdefault("recurrent_states", {})[name] = {"kind": "conv", "rows": [base], "elements": c * k}


@lowering("nhil::ssm_state_update")
def _ssm_update(cx: LowerCtx, node) -> None:
    """Mamba-2 state update (host) + ``S · C`` GEMVs (PIM) over the state rows (module docstring)."""
    x, dt, a_log, B, C, D, dt_bias, state, H, hd, G, N = node.args[:12]
    H, hd, G, N = int(H), int(hd), int(G), int(N)
    b, d = cx.b, cx.b.d
    if N % d.lanes or N > min(d.cols, d.gb_elems):
        raise CompileError(f"SSM state size {N} must be a multiple of the {d.lanes}-lane burst and fit a row / the global buffer ({min(d.cols, d.gb_elems)}) on device {d.name}")
    name = cx.const_name(state)
    rows = H // G * hd
    st = cx.const(state)
    places = [b.place_matrix(f"{name}.g{g}", torch.zeros((rows, N), device=st.device)) for g in range(G)]
    rd, new = b.buffer(f"{name}.rd", H * hd * N), b.buffer(f"{name}.new", H * hd * N)
    for g, p in enumerate(places):  # read every state row back
        for o in range(rows):
            ch, bank, row = _row_slot(b, p, o)
            b.emit(Op.RD_SBK, all_ch=False, ch=ch, bank=bank, row=row, col=0, n=N // d.lanes, operand=b.operand(rd, (g * rows + o) * N, N))
    b.host("ssm_update", [cx.arg(x), cx.arg(dt), cx.arg(B), rd, cx.image(a_log), cx.image(D), cx.image(dt_bias)], [new],
           num_heads=H, head_dim=hd, n_groups=G, state_size=N)
    for g, p in enumerate(places):  # write the new rows back
        for o in range(rows):
            ch, bank, row = _row_slot(b, p, o)
            for c in range(N // d.lanes):
                b.emit(Op.WR_SBK, all_ch=False, ch=ch, bank=bank, row=row, col=c, imm=0xFFFF, operand=b.operand(new, (g * rows + o) * N + c * d.lanes, d.lanes))
    y = b.buffer(f"{node.name}.sc", H * hd)
    for g, p in enumerate(places):  # y_raw = S_g · C_g on PIM
        b.gemv(p, cx.arg(C), y, x_off=g * N, y_off=g * rows)
    out = cx.out(node)
    b.host("ssm_skip", [y, cx.arg(x), cx.image(D)], [out], num_heads=H, head_dim=hd)
    cx.__dict__.setdefault("recurrent_states", {})[name] = {"kind": "ssm", "rows": [r for p in places for rg in p.rows for r in rg],
                                                             "elements": H * hd * N, "heads": H, "head_dim": hd, "groups": G, "state_size": N}


@lowering("nhil::rms_norm_gated")
def _rms_norm_gated(cx: LowerCtx, node) -> None:
    """Gated RMSNorm on the host."""
    x, gate, w, eps, gs = node.args[:5]
    nbg = bool(node.args[5]) if len(node.args) > 5 else False
    out = cx.out(node)
    attrs = {"norm_before_gate": True} if nbg else {}
    cx.b.host("rms_norm_gated", [cx.arg(x), cx.arg(gate), cx.image(w)], [out], eps=float(eps), group_size=int(gs), **attrs)


@lowering("nhil::concat")
def _concat(cx: LowerCtx, node) -> None:
    """Concatenation of activations on the host (gated DeltaNet's q/k/v before the short conv)."""
    out = cx.out(node)
    cx.b.host("concat", [cx.arg(x) for x in node.args[0]], [out])


@lowering("nhil::gated_delta_rule")
def _gated_delta_rule(cx: LowerCtx, node) -> None:
    """Gated DeltaNet: state rows ``Sᵀ`` in banks, ``Sᵀ k̂`` and ``S'ᵀ q̂`` on PIM, gates and the update on the host.

    Layout: per key head ``j`` a matrix of ``rep*dv`` rows (value heads ``j*rep ..``, then ``v``) x ``dk`` columns,
    row ``(h, v)`` = ``S[h, :, v]`` (the state transposed, so both products are broadcast dot products). Per step:
    ``HOST delta_prep`` (q̂, k̂, decay, beta), GEMV ``Sᵀ k̂`` per key head, ``RD_SBK`` of every row, ``HOST
    delta_update`` (``S' = S*decay + delta ⊗ k̂``), ``WR_SBK`` of the new rows, GEMV ``S'ᵀ q̂`` -> the output.
    """
    q, k, v, a, bb, a_log, dt_bias, state, hk, hv, dk, dv = node.args[:12]
    beta_scale = float(node.args[12]) if len(node.args) > 12 else 1.0
    qk_l2norm = bool(node.args[13]) if len(node.args) > 13 else True
    hk, hv, dk, dv = int(hk), int(hv), int(dk), int(dv)
    b, d = cx.b, cx.b.d
    if dk % d.lanes or dk > min(d.cols, d.gb_elems):
        raise CompileError(f"gated DeltaNet key head dim {dk} must be a multiple of the {d.lanes}-lane burst and fit a row / the global buffer on device {d.name}")
    rep, name = hv // hk, cx.const_name(state)
    rows = rep * dv
    st = cx.const(state)
    places = [b.place_matrix(f"{name}.k{j}", torch.zeros((rows, dk), device=st.device)) for j in range(hk)]
    qh, kh, decay, beta = (b.buffer(f"{node.name}.{t}", n) for t, n in (("qhat", hk * dk), ("khat", hk * dk), ("decay", hv), ("beta", hv)))
    b.host("delta_prep", [cx.arg(q), cx.arg(k), cx.arg(a), cx.arg(bb), cx.image(a_log), cx.image(dt_bias)], [qh, kh, decay, beta],
           num_k_heads=hk, head_k_dim=dk, beta_scale=beta_scale, qk_l2norm=qk_l2norm)
    b.invalidate_gb()
    kvm = b.buffer(f"{node.name}.kvm", hv * dv)
    for j, p in enumerate(places):
        b.gemv(p, kh, kvm, x_off=j * dk, y_off=j * rows)
    rd, new = b.buffer(f"{name}.rd", hv * dv * dk), b.buffer(f"{name}.new", hv * dv * dk)
    for j, p in enumerate(places):
        for o in range(rows):
            ch, bank, row = _row_slot(b, p, o)
            b.emit(Op.RD_SBK, all_ch=False, ch=ch, bank=bank, row=row, col=0, n=dk // d.lanes, operand=b.operand(rd, (j * rows + o) * dk, dk))
    b.host("delta_update", [cx.arg(v), kvm, decay, beta, kh, rd], [new], num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    for j, p in enumerate(places):
        for o in range(rows):
            ch, bank, row = _row_slot(b, p, o)
            for c in range(dk // d.lanes):
                b.emit(Op.WR_SBK, all_ch=False, ch=ch, bank=bank, row=row, col=c, imm=0xFFFF,
                       operand=b.operand(new, (j * rows + o) * dk + c * d.lanes, d.lanes))
    out = cx.out(node)
    for j, p in enumerate(places):
        b.gemv(p, qh, out, x_off=j * dk, y_off=j * rows)
    cx.__dict__.setdefault("recurrent_states", {})[name] = {"kind": "delta", "rows": [r for p in places for rg in p.rows for r in rg],
                                                             "elements": hv * dk * dv, "k_heads": hk, "v_heads": hv, "head_k_dim": dk, "head_v_dim": dv}
