"""The host share of a small model's decode step, before/after the opt-in host passes (issue 17 item 4; ``make bench``).

:func:`host_share_study` compiles a shape-only config (default ``smollm2-135m``, the `llama` model's shape)
with the default pipeline (*before*) and with the opt-in passes added one group at a time
(``host-overlap``; ``ew-swiglu`` + ``ew-residual``; all three = *after*), and times each with the
engine its passes select (:func:`nhil.timing.overlap.engine_for`). Per variant: cycles and tokens/s per
token, the fraction of the table bound (``roofline.pim_row_bound_tokens_per_s``: the step's bytes at
the row-bound bandwidth), the host share (exposed ``HOST.*`` + ``SYNC`` cycles / total) and its two
parts. Then the *after* program with a shorter host hand-off (``host_latency_ns``, an assumption of
the table: 500 ns) and with none, to show what bounds the rest: each remaining SYNC is a gather of
a GEMV's output (scattered one element per bank over the channels) that the next GEMV needs
broadcast in every channel's global buffer, and no AiM-class channel has a path to another one.
The last row is a what-if of such a path (``TimingTable.forward_latency_ns`` = :data:`FORWARD_NS`): the
readbacks no host kernel reads (2 of the 6 SYNCs of a layer: the attention output for ``o_proj`` and the
SwiGLU product for ``down_proj`` once ``ew-swiglu`` runs it on the device) go straight to the next WR_GB;
the 4 others still feed RoPE, softmax and two RMSNorms on the host.
"""

from __future__ import annotations

import time

from nhil.timing.report import GPU_HBM_GBS, analyze

VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("default pipeline (before)", ()),
    ("+ host-overlap", ("host-overlap",)),
    ("+ ew-swiglu + ew-residual", ("ew-swiglu", "ew-residual")),
    ("+ all three (after)", ("ew-swiglu", "ew-residual", "host-overlap")),
)
HANDOFF_NS = (100.0, 0.0)  # hand-off latencies of the sensitivity rows (the table assumes 500 ns)
FORWARD_NS = 0.0  # the what-if forward path's latency beyond the RD_ACC / WR_GB bursts the program already times
FORWARD_LABEL = "after, pure-gather SYNCs forwarded on the device (what-if), hand-off 500 ns"


def _row(label: str, passes: list[str], rep: dict, seconds: float) -> dict:
    ex = rep["exposed_cycles_by_kind"]
    host = sum(v for k, v in ex.items() if k.startswith("HOST"))
    bound = rep["roofline"]["pim_row_bound_tokens_per_s"]
    return {"variant": label, "passes": passes, "cycles_per_token": rep["cycles_per_token"], "tokens_per_s": rep["tokens_per_s"],
            "table_bound_tokens_per_s": bound, "of_bound": rep["tokens_per_s"] / bound if bound else 0.0,
            "host_and_sync_fraction": rep["host_and_sync_fraction"], "sync_cycles": ex.get("SYNC", 0), "host_kernel_cycles": host,
            "syncs": rep["instructions_by_kind"].get("SYNC", 0), "host_calls": sum(v for k, v in rep["instructions_by_kind"].items() if k.startswith("HOST")),
            "host_overlap": rep["host_overlap"], "seconds": seconds}


BENCH_CACHE_LENS = (16, 128)  # 16: the `llama` bench row's cache (the 5,263 of 35,718 tok/s); 128: the ablation's


def host_share_study(config: str = "smollm2-135m", device: str = "aim-like", max_cache_len: int = 128, gpu_gbs: float = GPU_HBM_GBS,
                     breakdown: bool = False) -> dict:
    """Rows of the study (module docstring): ``{"config", "max_cache_len", "rows": [{variant, passes, cycles_per_token, tokens_per_s,
    table_bound_tokens_per_s, of_bound, host_and_sync_fraction, sync_cycles, host_kernel_cycles, syncs, host_calls,
    host_overlap, seconds}]}``; the last rows are the *after* program at hand-off latencies :data:`HANDOFF_NS`.
    With ``breakdown``, also ``"breakdown": {"before", "after"}``: :func:`nhil.timing.breakdown.step_breakdown` of the
    first and the last variant's program (cycles by cause, and the caps with one cause made free)."""
    from nhil.compiler.pipeline import DEFAULT_PASSES, compile_shapes
    from nhil.timing.table import timing_for

    rows = []
    after = before = None
    for label, extra in VARIANTS:
        passes = list(DEFAULT_PASSES) + list(extra)
        t0 = time.perf_counter()
        prog = compile_shapes(config, device=device, passes=passes, max_cache_len=max_cache_len)
        rows.append(_row(label, passes, analyze(prog, gpu_gbs=gpu_gbs), time.perf_counter() - t0))
        after = prog
        before = before or prog
    what_ifs = [(f"after, hand-off {ns:.0f} ns (assumed 500)", {"host_latency_ns": ns}) for ns in HANDOFF_NS]
    for label, change in what_ifs + [(FORWARD_LABEL, {"forward_latency_ns": FORWARD_NS})]:
        t0 = time.perf_counter()
        T = timing_for(after.device).replace(**change)
        rows.append(_row(label, rows[-1]["passes"], analyze(after, table=T, gpu_gbs=gpu_gbs), time.perf_counter() - t0))
    out = {"config": config, "max_cache_len": max_cache_len, "rows": rows}
    if breakdown:
        from nhil.timing.breakdown import step_breakdown

        out["breakdown"] = {"before": step_breakdown(before), "after": step_breakdown(after)}
    return out


def host_share_table_rows(study: dict) -> list[tuple[str, str, str, str]]:
    """``make bench`` rows (stage, value, ratio, note): tokens/s, fraction of the table bound, host share per variant."""
    out = []
    for r in study["rows"]:
        out.append((f"host share (L={study['max_cache_len']}): {r['variant']}", f"{r['tokens_per_s']:,.0f} tok/s ({r['cycles_per_token']:,} cyc)", f"{r['of_bound']:.3f}",
                    f"of table bound {r['table_bound_tokens_per_s']:,.0f} tok/s; host+SYNC {r['host_and_sync_fraction']:.3f} "
                    f"(SYNC {r['sync_cycles']:,} cyc x{r['syncs']}, host kernels {r['host_kernel_cycles']:,} cyc x{r['host_calls']})"))
    if "breakdown" in study:
        from nhil.timing.breakdown import breakdown_table_rows

        for which, b in study["breakdown"].items():
            out.extend(breakdown_table_rows(b, f"L={study['max_cache_len']}, {which}"))
    return out
