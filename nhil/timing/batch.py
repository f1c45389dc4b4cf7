"""Batched decode in the timing model: B sequences sharing each weight-row activation (issue 17 item 5).

The engine (``nhil.timing.engine``) times one decode step of one sequence. For a batch of
``B`` sequences decoded together, this module scales that step's measured cycles by an
analytical model of what batching changes, so B = 1 reproduces the engine exactly:

* **Weight GEMVs**: a weight row, once activated, serves all B tokens: the row stays open
  for ``B x n`` MAC bursts instead of ``n``. Its cost is the all-bank row-stream formula of
  ``docs/timing-model.md`` with ``B*n`` bursts, ``TimingTable.mac_row_cycles(B*n)``
  (ACT/PRE paid once). The engine's exposed ``MAC_AB.gemv`` cycles at B = 1 are scaled by
  ``sum rc(B*n) / sum rc(n)`` over the step's weight MACs. This assumes the device holds B
  activation vectors and B accumulator sets per bank (the multi-vector extension issue 17
  item 2 asks for; ISA v0 has one global buffer and 4 accumulators), and that each token's
  WR_GB streams behind the previous token's MACs (external bus nBL = bank nCCD here).
* **MoE experts** (layers between ``HOST moe_route`` and the combine): with top-k of E
  experts chosen uniformly and independently per token, a layer activates on average
  ``A(B) = E (1 - (1 - k/E)^B)`` distinct experts, each serving ``m = B k / A`` tokens; the
  expert MACs of the B = 1 stream (k experts) scale by ``(A/k) * rc(m*n) / rc(n)``.
* **Attention** reads each sequence's own KV cache: its MAC cycles scale by B.
* **Other device work** (WR_GB, RD_ACC, WR_ACC exposed cycles: per-token vectors): x B.
* **Host**: each kernel call costs ``host_op_ns`` once per step plus its bytes x B;
  SYNC hand-offs stay one per barrier (the batch shares the step's hand-offs).

The GPU roofline at the same batch reads the weights once per step (dense weights + the
``A(B)`` active experts) plus B KV caches at ``gpu_gbs``, and is bounded by compute at
``gpu_tflops`` (2 FLOPs per weight per token); the faster of the two limits does not
apply, the slower does: ``tokens/s = B / max(bytes/BW, flops/peak)``. Defaults: H100 SXM
(3.35 TB/s HBM3, 989 TFLOPS dense bf16, NVIDIA's data sheet).
"""

from __future__ import annotations

BATCHES = (1, 2, 4, 8, 16, 32)
GPU_TFLOPS = 989.0


def _stream_classes(program) -> list[tuple[str, int, int]]:
    """(class, row, bursts) of every MAC in the step: ``dense``, ``expert`` (between moe_route and the combine) or ``attn``."""
    from nhil.isa.instr import Op
    from nhil.timing.engine import kv_row_set

    kv = kv_row_set(program)
    out = []
    in_moe = False
    for ins in program.instrs:
        if ins.op is Op.HOST:
            k = program.host_ops[ins.imm].kernel
            if k == "moe_route":
                in_moe = True
            elif k in ("moe_combine", "moe_dispatch"):
                in_moe = False
        elif ins.op in (Op.MAC_AB, Op.MAC_SB):
            cls = "attn" if ins.row in kv else ("expert" if in_moe else "dense")
            out.append((cls, ins.row, ins.n))
    return out


def _moe_shape(program) -> tuple[int, int]:
    """(experts per layer E, routed per token k) of a program with MoE layers, else (0, 0)."""
    for h in program.host_ops:
        if h.kernel == "moe_route":
            k = int(h.attrs.get("top_k", 0))
            e = int(h.attrs.get("num_experts", 0))
            if not e:  # shape-only programs: the router GEMV's output count
                e = program.buffers.get(h.inputs[0], 0)
            return e, k
    return 0, 0


def active_experts(B: int, E: int, k: int) -> float:
    """Expected distinct experts one MoE layer activates for B tokens each routing to k of E uniformly: ``E (1 - (1 - k/E)^B)``."""
    return E * (1.0 - (1.0 - k / E) ** B) if E else 0.0


def batch_table(program, batches=BATCHES, gpu_gbs: float = 3350.0, gpu_tflops: float = GPU_TFLOPS, table=None, report: dict | None = None) -> dict:
    """Modelled decode tokens/s at each batch size beside the GPU roofline (see the module docstring).

    Args:
        program: a decode-step Program (shape-only or real).
        batches: batch sizes B.
        gpu_gbs: GPU HBM bandwidth, GB/s; gpu_tflops: GPU dense bf16 compute, TFLOP/s.
        table: timing table (default: the device preset's).
        report: ``nhil.timing.report.analyze(program)`` if already computed (B = 1; reordering controller).
    Returns:
        ``{"model", "experts", "top_k", "rows": [{"batch", "cycles_per_step", "pim_tokens_per_s", "gpu_tokens_per_s",
        "gpu_bound" ("HBM" | "compute"), "pim_vs_gpu", "active_experts", "cycles" and "share": {gemv, attn, other, host, sync}}],
        "pim_stops_winning_at"}`` (first B with PIM slower than the GPU, or None).
    """
    from nhil.timing.report import analyze
    from nhil.timing.table import timing_for

    T = table or timing_for(program.device)
    rep = report or analyze(program, table=T, gpu_gbs=gpu_gbs)
    ex = rep["exposed_cycles_by_kind"]
    cyc1 = rep["cycles_per_token"]
    gemv1 = ex.get("MAC_AB.gemv", 0) + ex.get("MAC_SB.gemv", 0)
    attn1 = ex.get("MAC_AB.attn", 0) + ex.get("MAC_SB.attn", 0)
    sync1 = ex.get("SYNC", 0)
    host1 = sum(v for k, v in ex.items() if k.startswith("HOST"))
    other1 = cyc1 - gemv1 - attn1 - sync1 - host1
    n_host = sum(v for k, v in rep["instructions_by_kind"].items() if k.startswith("HOST"))
    host_fixed = min(host1, n_host * T.host_op_ns / T.tck_ns)
    E, k = _moe_shape(program)
    macs = _stream_classes(program)
    rc = T.mac_row_cycles
    base = sum(rc(n) for c, _, n in macs if c != "attn") or 1
    # bytes for the GPU roofline: each weight row's useful bytes once, dense vs the k experts of the stream
    row_use = program.info.get("row_use") or {}
    d = program.device
    seen: set[int] = set()
    dense_b = expert_b = 0
    for c, row, n in macs:
        if c == "attn" or row in seen:
            continue
        seen.add(row)
        u = row_use.get(row) or row_use.get(str(row))
        nbytes = u[0] * u[1] * 2 if u else d.slots * n * d.lanes * 2
        if c == "expert":
            expert_b += nbytes
        else:
            dense_b += nbytes
    kv_b = rep["kv_bytes"]
    rows = []
    stop = None
    for B in batches:
        A = active_experts(B, E, k) if E else 0.0
        scaled = 0.0
        for c, _, n in macs:
            if c == "dense":
                scaled += rc(B * n)
            elif c == "expert":
                m = B * k / A
                scaled += (A / k) * rc(max(1, round(m * n)))
        gemv = gemv1 * scaled / base
        attn = attn1 * B
        other = other1 * B
        host = host_fixed + (host1 - host_fixed) * B
        cyc = gemv + attn + other + host + sync1
        pim = B / (cyc * T.tck_ns * 1e-9)
        wbytes = dense_b + (expert_b / k * A if E else 0.0)
        t_mem = (wbytes + B * kv_b) / (gpu_gbs * 1e9)
        t_cmp = 2.0 * B * (dense_b + (expert_b if E else 0.0)) / 2 / (gpu_tflops * 1e12)  # 2 FLOPs per weight (bf16: bytes/2 weights) per token
        gpu = B / max(t_mem, t_cmp)
        row = {"batch": B, "cycles_per_step": round(cyc), "pim_tokens_per_s": pim, "gpu_tokens_per_s": gpu, "gpu_bound": "HBM" if t_mem >= t_cmp else "compute",
               "pim_vs_gpu": pim / gpu, "active_experts": A, "cycles": {"gemv": gemv, "attn": attn, "other": other, "host": host, "sync": sync1},
               "share": {"gemv": gemv / cyc, "attn": attn / cyc, "other": other / cyc, "host": host / cyc, "sync": sync1 / cyc}}
        rows.append(row)
        if stop is None and row["pim_vs_gpu"] < 1.0:
            stop = B
    return {"model": rep["model"], "experts": E, "top_k": k, "gpu_gbs": gpu_gbs, "gpu_tflops": gpu_tflops, "engine_cycles_b1": cyc1, "rows": rows, "pim_stops_winning_at": stop}


BENCH_CONFIGS = ("llama3-8b", "mixtral-8x7b")


def bench_batch(configs=BENCH_CONFIGS, gpu_gbs: float = 3350.0) -> list[dict]:
    """``batch_table`` of each shape-only config (``nhil.compiler.shape_only``), for ``make bench``."""
    from nhil.compiler.shape_only import compile_shape_only

    return [batch_table(compile_shape_only(c, max_cache_len=128), gpu_gbs=gpu_gbs) for c in configs]


def batch_rich_table(results: list[dict]):
    """The bench's batch table (rich ``Table``): per config and B, PIM vs GPU tokens/s and the step's shares."""
    from rich.table import Table

    t = Table(title="batched decode (timing model, docs/timing-model.md 'Batch'): B sequences share each weight-row activation; GPU roofline at the same B")
    for col in ("config", "B", "PIM tok/s", "GPU tok/s", "GPU bound", "PIM / GPU", "active experts", "gemv", "attn", "other dev", "host", "SYNC"):
        t.add_column(col)
    for r in results:
        for i, row in enumerate(r["rows"]):
            s = row["share"]
            t.add_row(r["model"] if i == 0 else "", str(row["batch"]), f"{row['pim_tokens_per_s']:,.0f}", f"{row['gpu_tokens_per_s']:,.0f}", row["gpu_bound"],
                      f"{row['pim_vs_gpu']:.2f}", f"{row['active_experts']:.1f}" if r["experts"] else "-",
                      f"{s['gemv']:.2f}", f"{s['attn']:.2f}", f"{s['other']:.2f}", f"{s['host']:.2f}", f"{s['sync']:.2f}")
        t.add_row("", "", "", "", "", f"PIM stops winning at B = {r['pim_stops_winning_at']}" if r["pim_stops_winning_at"] else "PIM wins at every B", "", "", "", "", "", "")
    return t
