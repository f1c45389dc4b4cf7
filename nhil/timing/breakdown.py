"""Where a decode step's cycles go, against its table bound (issue 17 item 4; ``make bench`` host-share rows,
``docs/timing-model.md`` "Step breakdown").

:func:`step_breakdown` times one decode step of a program (the engine its passes select,
``nhil.timing.overlap.engine_for``) and gives two views:

* **additive** (``rows``): the step's exposed cycles (``nhil.timing.engine``: how far each
  instruction pushed the end of the timeline; they sum to the total) grouped by cause. The
  exposed cycles of the weight MACs are split three ways: the column-command cycles their
  useful weight bursts take at ``nCCD`` per burst (what the step needs at the peak column rate), the same for
  padding bursts (slots of an all-bank MAC that hold no weights: a 576-output GEMV on 512 slots uses
  64 slots of its second row group), and the rest (row opening/closing: nRCDRDMAC / nRP / nRAS / nRC / nFAW /
  nRRD, refresh, and waits for the global buffer or an accumulator). The rest can be negative
  when MAC bursts hide under other work; the rows still sum to the total.
* **counterfactual** (``what_if``): the step re-timed with one cause made free (table
  values set to their floor), alone and combined: no hand-off latency, no host kernel time,
  free row timing, no refresh, and all of them. Each row is a cap: what this program on
  this device reaches if that cost vanished and nothing else changed. They do not add up.

The bound (``bound_cycles``) is ``nhil.timing.report``'s: the step's useful bytes (weights +
KV) at the row-bound bandwidth (``TimingTable.row_bound_fraction``) of every bank.
"""

from __future__ import annotations

from nhil.isa.program import Program
from nhil.timing.report import analyze
from nhil.timing.table import TimingTable, timing_for

FREE_ROWS = dict(nRCDRD=1, nRCDWR=1, nRCDRDMAC=1, nRCDRDCP=1, nRCDWRCP=1, nRP=1, nRAS=1, nRC=1, nRRD=1, nFAW=1)
FREE_HOST = dict(host_op_ns=0.0, host_gbs=1e18)
WHAT_IF: tuple[tuple[str, dict], ...] = (
    ("no hand-off latency", dict(host_latency_ns=0.0)),
    ("no host kernel time", FREE_HOST),
    ("no hand-off, no host time (device only)", dict(host_latency_ns=0.0, **FREE_HOST)),
    ("free row timing (ACT/PRE: tRCD tRP tRAS tRC tRRD tFAW = 1)", FREE_ROWS),
    ("device only + free row timing", dict(host_latency_ns=0.0, **FREE_HOST, **FREE_ROWS)),
    ("device only + free rows + no refresh", dict(host_latency_ns=0.0, **FREE_HOST, **FREE_ROWS, nREFI=1 << 40)),
)


def _groups(ex: dict) -> dict[str, int]:
    g = {"SYNC hand-off": ex.get("SYNC", 0), "host kernels": sum(v for k, v in ex.items() if k.startswith("HOST"))}
    g["weight MACs (GEMV)"] = sum(v for k, v in ex.items() if k.endswith(".gemv"))
    g["attention MACs (KV rows)"] = sum(v for k, v in ex.items() if k.endswith(".attn"))
    for k in ("WR_GB", "RD_ACC", "WR_ACC", "WR_SBK"):
        g[k] = ex.get(k, 0)
    g["EWMUL / EWADD / AF"] = sum(ex.get(k, 0) for k in ("EWMUL", "EWADD", "AF"))
    g["other"] = sum(ex.values()) - sum(g.values())
    return g


def step_breakdown(program: Program, table: TimingTable | None = None) -> dict:
    """Cycle breakdown of one decode step of ``program`` (module docstring).

    Returns:
        ``{"cycles", "bound_cycles", "tokens_per_s", "bound_tokens_per_s", "of_bound", "rows": [{cause, cycles, of_step,
        of_bound}], "what_if": [{case, cycles, tokens_per_s, of_bound}]}``; cycles are command-clock cycles (``tck_ns``)
        per token, ``of_bound`` = bound cycles / cycles (tokens/s as a fraction of the bound). The weight-MAC row is
        replaced by its three parts (``weight MACs: ...``).
    """
    d = program.device
    T = table or timing_for(d)
    rep = analyze(program, table=T)
    cyc = rep["cycles_per_token"]
    bound_tps = rep["roofline"]["pim_row_bound_tokens_per_s"]
    bound = cyc * rep["tokens_per_s"] / bound_tps if bound_tps else 0.0
    burst_bytes = 2 * d.lanes
    per_ch = d.channels * d.banks * burst_bytes  # bytes one all-bank all-channel burst cycle streams
    useful = rep["gemv"]["useful_bytes"] / per_ch * T.nCCD
    padding = (rep["gemv"]["mac_bytes"] - rep["gemv"]["useful_bytes"]) / per_ch * T.nCCD
    g = _groups(rep["exposed_cycles_by_kind"])
    mac = g.pop("weight MACs (GEMV)")
    parts = {"weight MACs: useful bursts at nCCD": useful, "weight MACs: padding bursts at nCCD": padding,
             "weight MACs: rest (ACT/PRE timing, refresh, GB/accumulator waits)": mac - useful - padding}
    rows = [{"cause": k, "cycles": v, "of_step": v / cyc, "of_bound": v / bound if bound else 0.0} for k, v in {**parts, **g}.items()]
    what = []
    for case, kw in WHAT_IF:
        r = analyze(program, table=T.replace(**kw))
        what.append({"case": case, "cycles": r["cycles_per_token"], "tokens_per_s": r["tokens_per_s"], "of_bound": r["tokens_per_s"] / bound_tps if bound_tps else 0.0})
    return {"cycles": cyc, "bound_cycles": bound, "tokens_per_s": rep["tokens_per_s"], "bound_tokens_per_s": bound_tps,
            "of_bound": rep["tokens_per_s"] / bound_tps if bound_tps else 0.0, "rows": rows, "what_if": what}


def breakdown_table_rows(b: dict, label: str) -> list[tuple[str, str, str, str]]:
    """``make bench`` rows (stage, value, ratio, note) of :func:`step_breakdown`: per cause its cycles and share of the step,
    then the what-if caps (tokens/s, fraction of the bound)."""
    out = [(f"step breakdown ({label})", f"{b['cycles']:,} cyc", f"{b['of_bound']:.3f}", f"of bound; bound = {b['bound_cycles']:,.0f} cyc/token")]
    for r in b["rows"]:
        out.append((f"  {r['cause']}", f"{r['cycles']:,.0f} cyc", f"{r['of_step']:.3f}", f"of the step; {r['of_bound']:.2f}x the bound's cycles"))
    for w in b["what_if"]:
        out.append((f"  cap if {w['case']}", f"{w['tokens_per_s']:,.0f} tok/s ({w['cycles']:,} cyc)", f"{w['of_bound']:.3f}", "of table bound"))
    return out
