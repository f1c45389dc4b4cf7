"""Performance report of a program on its device: cycles, bandwidths, bounds, tokens/s, rooflines.

Figures (``docs/timing-model.md``):

* ``cycles_per_token``: one decode step (the program run once), command-clock cycles;
  ``tokens_per_s`` = 1 / (cycles x tCK).
* ``gemv``: over the device segments that only run weight GEMVs (between barriers):
  achieved bandwidth (useful weight bytes / their cycles; padding slots and columns are
  not useful), the device's peak internal bandwidth, and the *timing-bound best* for the
  same bytes: every row activated once and fully used, GB writes and readbacks hidden,
  so ``bytes / (slots x row_bytes)`` rows each taking ``mac_row_cycles(bursts_per_row)``.
* ``roofline``: bytes the step must read (useful weights + KV cache of the compiled
  length) divided by: the PIM peak internal bandwidth; the same with the table's row
  bound; the device's external bandwidth (a host reading the same memory through its
  pins); a GPU's HBM bandwidth (parameter). The PIM speed-up is modelled tokens/s over
  the external-bandwidth-bound and the GPU-bound tokens/s.
"""

from __future__ import annotations

from nhil.isa.program import Program
from nhil.timing.overlap import HostOverlapEngine, engine_for
from nhil.timing.table import TimingTable, peak_external_gbs, peak_internal_gbs, timing_for

GPU_HBM_GBS = 3350.0  # H100 SXM HBM3, the default GPU baseline (parameter)


def kv_bytes(program: Program) -> int:
    """Bytes of the KV cache one decode step reads (K and V of the compiled length, bf16)."""
    total = 0
    for kv in (program.info.get("kv_layout") or {}).values():
        total += 2 * 2 * kv["max_len"] * kv["kv_heads"] * kv["head_dim"]
    return total


def recurrent_state_bytes(program: Program) -> dict:
    """Per-token traffic of the recurrent states of hybrid layers (``info["recurrent_state"]``, ``lower_recurrent``).

    Returns ``{"layers", "state_bytes", "round_trip_bytes"}``: the bf16 state bytes (conv + SSM / delta-rule),
    and the bytes the host read-modify-write moves over the external bus per token (each state read once with
    ``RD_SBK`` and written once with ``WR_SBK``: 2 x state bytes). The PIM products against the states are GEMV
    segments and counted there.
    """
    st = program.info.get("recurrent_state") or {}
    sb = sum(2 * int(v["elements"]) for v in st.values())
    return {"layers": len(st), "state_bytes": sb, "round_trip_bytes": 2 * sb}


def controller_for(program: Program) -> bool:
    """``inorder`` for a program: in order iff it went through a ``pipeline.PassManager`` without ``gb-overlap`` (``nhil.compiler.schedule``)."""
    ps = program.info.get("passes")
    return ps is not None and "gb-overlap" not in ps


def analyze(program: Program, table: TimingTable | None = None, pos: int | None = None, gpu_gbs: float = GPU_HBM_GBS, inorder: bool | None = None,
            overlap: bool | None = None) -> dict:
    """Time one decode step of ``program`` and derive the report (a JSON-able dict).

    ``inorder=None`` takes the controller from the program's scheduling passes
    (:func:`controller_for`); ``overlap=None`` times host kernels overlapped with
    independent device work iff the passes hold ``host-overlap``
    (:func:`nhil.timing.overlap.overlap_for`); ``table`` defaults to the device preset's.
    """
    d = program.device
    if inorder is None:
        inorder = controller_for(program)
    T = table or timing_for(d)
    if pos is None:
        pos = max(0, int(program.info.get("max_cache_len", 1)) // 2)
    eng = engine_for(program, d, T, inorder=inorder, overlap=overlap)
    st = eng.run_program(pos=pos)
    cyc = st.cycles
    sec = cyc * T.tck_ns * 1e-9
    peak = peak_internal_gbs(d, T)
    ext = peak_external_gbs(d, T)
    row_frac = T.row_bound_fraction(d.bursts_per_row)
    g = [s for s in eng.segments if s.kind == "gemv"]
    g_cyc = sum(s.cycles for s in g)
    g_bytes = sum(s.useful_bytes for s in g)
    g_bank_bursts = sum(s.bank_bursts for s in g)
    best_cyc = g_bytes / (d.slots * d.row_bytes) * T.mac_row_cycles(d.bursts_per_row)
    g_ns = g_cyc * T.tck_ns
    ach = g_bytes / g_ns if g_ns else 0.0
    best_gbs = g_bytes / (best_cyc * T.tck_ns) if best_cyc else 0.0
    weights = sum(s.useful_bytes for s in eng.segments)
    kvb = kv_bytes(program)
    step_bytes = weights + kvb
    ns = cyc * T.tck_ns
    host = sum(v for k, v in st.exposed_by_kind.items() if k.startswith("HOST") or k == "SYNC")
    rep = {
        "model": program.info.get("model", "?"),
        "device": d.name,
        "channels": d.channels,
        "timing_table": T.name,
        "controller": "in-order" if inorder else "reordering",
        "host_overlap": isinstance(eng, HostOverlapEngine),
        "pos": pos,
        "passes": program.info.get("passes"),
        "cycles_per_token": cyc,
        "us_per_token": ns / 1e3,
        "tokens_per_s": 1.0 / sec if sec else 0.0,
        "host_and_sync_fraction": host / cyc if cyc else 0.0,
        "exposed_cycles_by_kind": dict(sorted(st.exposed_by_kind.items(), key=lambda kv: -kv[1])),
        "exposed_cycles_by_layer": dict(st.exposed_by_layer),
        "instructions_by_kind": dict(st.count_by_kind),
        "acts": st.acts,
        "refs": st.refs,
        "gemv": {
            "segments": len(g),
            "cycles": g_cyc,
            "useful_bytes": g_bytes,
            "mac_bytes": g_bank_bursts * 2 * d.lanes,
            "achieved_gbs": ach,
            "peak_gbs": peak,
            "best_gbs": best_gbs,
            "row_bound_fraction": row_frac,
            "achieved_of_peak": ach / peak if peak else 0.0,
            "achieved_of_best": ach / best_gbs if best_gbs else 0.0,
            "best_of_peak": best_gbs / peak if peak else 0.0,
        },
        "step_bytes": step_bytes,
        "weight_bytes": weights,
        "kv_bytes": kvb,
        "recurrent_state": recurrent_state_bytes(program),
        "achieved_step_gbs": step_bytes / ns if ns else 0.0,
        "roofline": {
            "pim_peak_tokens_per_s": peak * 1e9 / step_bytes if step_bytes else 0.0,
            "pim_row_bound_tokens_per_s": peak * row_frac * 1e9 / step_bytes if step_bytes else 0.0,
            "external_gbs": ext,
            "external_bound_tokens_per_s": ext * 1e9 / step_bytes if step_bytes else 0.0,
            "gpu_hbm_gbs": gpu_gbs,
            "gpu_bound_tokens_per_s": gpu_gbs * 1e9 / step_bytes if step_bytes else 0.0,
        },
    }
    r = rep["roofline"]
    r["speedup_vs_external"] = rep["tokens_per_s"] / r["external_bound_tokens_per_s"] if r["external_bound_tokens_per_s"] else 0.0
    r["speedup_vs_gpu"] = rep["tokens_per_s"] / r["gpu_bound_tokens_per_s"] if r["gpu_bound_tokens_per_s"] else 0.0
    rep["device_params"] = device_param_study(T, d)
    return rep


def device_param_study(T: TimingTable, d) -> dict:
    """What lifts the all-bank row bound (``docs/timing-model.md``), as the bound fraction of peak."""
    b = d.bursts_per_row
    base = T.row_bound_fraction(b)
    out = {"row_bytes_%d" % d.row_bytes: base}
    for rb in (4096, 8192):
        out[f"row_bytes_{rb}"] = T.row_bound_fraction(rb // (2 * d.lanes))
    # dual row buffers: the next row is activated (and the previous precharged) while the
    # current one streams (TimingTable.row_buffers; the engine models it)
    out["dual_row_buffers"] = T.replace(row_buffers=2).row_bound_fraction(b)
    # bank-group interleaving with all-bank MACs: every bank still pays ACT+PRE per row
    out["bank_group_interleave"] = base
    return out
