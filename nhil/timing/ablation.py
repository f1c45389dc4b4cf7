"""Pass ablation and device-parameter study on shape-only configs (``docs/timing-model.md``).

* :func:`ablation`: the decode step of a config compiled with the naive baseline (no
  scheduling pass), each pass of ``nhil.compiler.schedule.PIPELINE`` added cumulatively,
  and the full pipeline with each pass removed; per variant: modelled cycles/token,
  tokens/s, and the GEMV bandwidths side by side (achieved, device peak, timing-bound
  best) with their fractions.
* :func:`device_study`: the full pipeline on device/timing variants (row size 2/4/8 KB and
  dual row buffers timed by the engine; bank-group interleaving from the row formula, see
  :func:`nhil.timing.report.device_param_study`), gain vs the AiM-like preset.
"""

from __future__ import annotations

import dataclasses
import time

from nhil.timing.report import GPU_HBM_GBS, analyze

ABLATION_CONFIGS = ("smollm2-135m", "llama3-8b")  # `llama` (SmolLM2-135M) and a Llama-3-8B-sized config


def pass_sets() -> list[tuple[str, list[str]]]:
    """(label, enabled passes): baseline, each pass added cumulatively (the last is the full pipeline), each removed from the full pipeline."""
    from nhil.compiler.schedule import PIPELINE

    P = list(PIPELINE)
    out = [("baseline (no pass)", [])]
    out += [(f"+ {P[i]}" + (" = full pipeline" if i == len(P) - 1 else ""), P[: i + 1]) for i in range(len(P))]
    out += [(f"full - {n}", [q for q in P if q != n]) for n in P]
    return out


def _row(label: str, passes: list[str], rep: dict, seconds: float) -> dict:
    g = rep["gemv"]
    return {
        "variant": label,
        "passes": passes,
        "cycles_per_token": rep["cycles_per_token"],
        "tokens_per_s": rep["tokens_per_s"],
        "achieved_gbs": g["achieved_gbs"],
        "peak_gbs": g["peak_gbs"],
        "best_gbs": g["best_gbs"],
        "achieved_of_peak": g["achieved_of_peak"],
        "achieved_of_best": g["achieved_of_best"],
        "best_of_peak": g["best_of_peak"],
        "host_and_sync_fraction": rep["host_and_sync_fraction"],
        "acts": rep["acts"],
        "controller": rep["controller"],
        "seconds": seconds,
    }


EXTRAPOLATE_LAYERS = 8  # configs with more layers time bank-spread-off variants from 1- and 2-layer programs


def _layers_extrapolated(cfg, passes: list[str], device: str, max_cache_len: int, gpu_gbs: float) -> dict:
    """Report of ``cfg`` under ``passes`` from its 1- and 2-layer versions: every figure ``f(L) = f(1) + (L-1)(f(2) - f(1))``.

    The layers of a decode step have the same shapes and instruction stream, so cycles,
    GEMV cycles/bytes and host cycles are linear in the layer count up to refresh phase.
    Used for variants whose full program is too large to time here (naive placement
    without ``bank-spread``: 32x the instructions; Llama-3-8B: ~4M instructions).
    """
    from nhil.compiler.pipeline import compile_shapes

    reps = [analyze(compile_shapes(dataclasses.replace(cfg, num_hidden_layers=n), device=device, passes=passes, max_cache_len=max_cache_len), gpu_gbs=gpu_gbs) for n in (1, 2)]
    L = cfg.num_hidden_layers

    def lin(f):
        a, b = f(reps[0]), f(reps[1])
        return a + (L - 1) * (b - a)

    r1 = reps[1]
    cyc = int(round(lin(lambda r: r["cycles_per_token"])))
    host = lin(lambda r: r["host_and_sync_fraction"] * r["cycles_per_token"])
    g_cyc = lin(lambda r: r["gemv"]["cycles"])
    g_bytes = lin(lambda r: r["gemv"]["useful_bytes"])
    T_ns = 1e9 / r1["tokens_per_s"] / r1["cycles_per_token"]  # tCK in ns
    ach = g_bytes / (g_cyc * T_ns)
    g = dict(r1["gemv"], cycles=g_cyc, useful_bytes=g_bytes, achieved_gbs=ach, achieved_of_peak=ach / r1["gemv"]["peak_gbs"], achieved_of_best=ach / r1["gemv"]["best_gbs"])
    return dict(r1, cycles_per_token=cyc, tokens_per_s=1e9 / (cyc * T_ns), host_and_sync_fraction=host / cyc, gemv=g, acts=int(round(lin(lambda r: r["acts"]))), extrapolated_from_layers=[1, 2])


def ablation(config: str, max_cache_len: int = 128, gpu_gbs: float = GPU_HBM_GBS, device: str = "aim-like") -> dict:
    """Time ``config`` (a ``nhil.compiler.shape_only.CONFIGS`` name) under every :func:`pass_sets` variant.

    Variants without ``bank-spread`` of configs with more than :data:`EXTRAPOLATE_LAYERS`
    layers are timed by :func:`_layers_extrapolated` (row ``how``); the full pipeline is
    timed both ways and the relative difference is ``extrapolation_error``.

    Returns:
        ``{"config", "device", "rows": [per-variant dict (see :func:`_row`)], "extrapolation_error"}``;
        cycles are command-clock cycles, bandwidths GB/s over the GEMV segments.
    """
    from nhil.compiler.pipeline import compile_shapes
    from nhil.compiler.schedule import PIPELINE
    from nhil.compiler.shape_only import CONFIGS

    cfg = CONFIGS[config]
    big = cfg.num_hidden_layers > EXTRAPOLATE_LAYERS
    rows = []
    dev = None
    for label, passes in pass_sets():
        t0 = time.perf_counter()
        if big and "bank-spread" not in passes:
            rep, how = _layers_extrapolated(cfg, passes, device, max_cache_len, gpu_gbs), "extrapolated (1, 2 layers)"
        else:
            prog = compile_shapes(config, device=device, passes=passes, max_cache_len=max_cache_len)
            dev = prog.device.name
            rep, how = analyze(prog, gpu_gbs=gpu_gbs), "measured"
        rows.append(dict(_row(label, passes, rep, time.perf_counter() - t0), how=how))
    err = None
    if big:
        full = next(r for r in rows if r["passes"] == list(PIPELINE))
        ex = _layers_extrapolated(cfg, list(PIPELINE), device, max_cache_len, gpu_gbs)
        err = ex["cycles_per_token"] / full["cycles_per_token"] - 1.0
    return {"config": config, "device": dev, "max_cache_len": max_cache_len, "rows": rows, "extrapolation_error": err}


def row_size_device(row_bytes: int, base: str = "aim-like"):
    """The AiM-like device with ``row_bytes`` rows (same capacity per bank) and a global buffer of one row (so a GEMV chunk fills a row)."""
    from nhil.isa.device import DEVICE_PRESETS

    b = DEVICE_PRESETS[base]
    if row_bytes == b.row_bytes:
        return b
    return dataclasses.replace(b, name=f"{b.name} row{row_bytes // 1024}k", row_bytes=row_bytes, gb_bytes=row_bytes, rows=b.rows * b.row_bytes // row_bytes)


def device_study(config: str = "llama3-8b", max_cache_len: int = 128, gpu_gbs: float = GPU_HBM_GBS) -> dict:
    """Full pipeline on device variants; each row: modelled tokens/s, GEMV achieved/best/peak, all-bank row bound, gain vs the preset.

    Row sizes 2/4/8 KB and dual row buffers (``TimingTable.row_buffers = 2``) are compiled
    and timed (``measured``); bank-group interleaving scales the preset's measured GEMV
    time by the ratio of the row bounds (``formula``,
    :func:`nhil.timing.report.device_param_study`): with all-bank MACs every bank still pays
    ACT+PRE per row, so its bound is the preset's.
    """
    from nhil.compiler.pipeline import compile_shapes
    from nhil.timing.table import timing_for

    rows = []
    base = None
    for rb in (2048, 4096, 8192):
        d = row_size_device(rb)
        prog = compile_shapes(config, device=d, max_cache_len=max_cache_len)
        rep = analyze(prog, gpu_gbs=gpu_gbs)
        T = timing_for(d)
        r = {"variant": f"row {rb // 1024} KB" + (" (AiM-like preset)" if rb == 2048 else f", GB {rb // 1024} KB"), "how": "measured",
             "tokens_per_s": rep["tokens_per_s"], "cycles_per_token": rep["cycles_per_token"], "row_bound": T.row_bound_fraction(d.bursts_per_row),
             "achieved_gbs": rep["gemv"]["achieved_gbs"], "best_gbs": rep["gemv"]["best_gbs"], "peak_gbs": rep["gemv"]["peak_gbs"],
             "achieved_of_best": rep["gemv"]["achieved_of_best"], "gemv_cycles": rep["gemv"]["cycles"]}
        if base is None:
            base = (r, rep)
        rows.append(r)
    b, brep = base
    d = row_size_device(2048)
    T2 = timing_for(d).replace(name="aim-like dual-row-buffer", row_buffers=2)
    prog = compile_shapes(config, device=d, max_cache_len=max_cache_len)
    rep = analyze(prog, table=T2, gpu_gbs=gpu_gbs)
    rows.append({"variant": "dual row buffers (2 KB rows)", "how": "measured", "tokens_per_s": rep["tokens_per_s"], "cycles_per_token": rep["cycles_per_token"], "row_bound": T2.row_bound_fraction(d.bursts_per_row),
                 "achieved_gbs": rep["gemv"]["achieved_gbs"], "best_gbs": rep["gemv"]["best_gbs"], "peak_gbs": rep["gemv"]["peak_gbs"], "achieved_of_best": rep["gemv"]["achieved_of_best"], "gemv_cycles": rep["gemv"]["cycles"]})
    study = brep["device_params"]
    for key, label in (("bank_group_interleave", "bank-group interleaving (2 KB rows)"),):
        frac = study[key]
        g_cyc = b["gemv_cycles"] * b["row_bound"] / frac
        cyc = b["cycles_per_token"] - b["gemv_cycles"] + g_cyc
        rows.append({"variant": label, "how": "formula", "tokens_per_s": b["tokens_per_s"] * b["cycles_per_token"] / cyc, "cycles_per_token": int(round(cyc)), "row_bound": frac,
                     "achieved_gbs": b["achieved_gbs"] * frac / b["row_bound"], "best_gbs": b["best_gbs"] * frac / b["row_bound"], "peak_gbs": b["peak_gbs"], "achieved_of_best": b["achieved_of_best"], "gemv_cycles": int(round(g_cyc))})
    for r in rows:
        r["gain"] = r["tokens_per_s"] / b["tokens_per_s"]
        r["bound_gain"] = r["row_bound"] / b["row_bound"]
    return {"config": config, "max_cache_len": max_cache_len, "rows": rows}
