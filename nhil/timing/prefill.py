"""Modelled prefill: the prefill program's time (``nhil.compiler.prefill``) against the prompt run token by token.

``prefill_timing(decode, tokens)`` times the prefill program of ``tokens`` prompt tokens
from position 0 with the timing engine (the prefill extension's ``MAC_ABV``: one row
activation, ``V`` x the MAC bursts, ``docs/timing-model.md``) and compares it with the
same prompt as ``tokens`` decode steps (each step timed at its own position would cost
``tokens`` engine runs; the decode step is timed once at the middle position ``tokens // 2``
and multiplied, which the attention part's linear growth in the position makes exact to
first order). The time to first token (TTFT) is the prefill time: the last prompt token's
logits are the first generated token's prediction.

GPU reference at the same prompt: ``max(weight bytes / HBM bandwidth, 2 x MACs / peak FLOP/s)``
with an H100 SXM's 3.35 TB/s and 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet), i.e. a roofline,
not a measured GPU.
"""

from __future__ import annotations

import time

from nhil.timing.engine import TimingEngine
from nhil.timing.report import controller_for
from nhil.timing.table import timing_for

GPU_BF16_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak (datasheet)
GPU_HBM_GBS = 3350.0


def prefill_timing(decode, tokens: int, gpu_gbs: float = GPU_HBM_GBS, gpu_flops: float = GPU_BF16_FLOPS) -> dict:
    """Modelled prefill of ``tokens`` prompt tokens (module docstring) as a JSON-able dict.

    Args:
        decode: a decode-step Program (real or shape-only) on a device with or without the prefill extension.
        tokens: prompt length (1..255).
    Returns:
        ``tokens``, ``vectors``, ``prefill_cycles``, ``ttft_ms``, ``prefill_tokens_per_s``,
        ``per_token_cycles`` (the prompt as decode steps), ``speedup_vs_per_token``, ``host_and_sync_fraction``
        of the prefill, the GPU roofline's ``gpu_ttft_ms`` and ``engine_seconds``.
    Raises:
        PrefillUnsupported: the program has MoE dispatch or recurrent states (``nhil.compiler.prefill``).
    """
    from nhil.compiler.prefill import prefill_program

    d = decode.device
    T = timing_for(d)
    inorder = controller_for(decode)
    t0 = time.perf_counter()
    pf = prefill_program(decode, tokens)
    eng = TimingEngine(d, T, program=pf, inorder=inorder)
    st = eng.run_program(pos=0)
    cyc = st.cycles
    dec = TimingEngine(d, T, program=decode, inorder=inorder).run_program(pos=tokens // 2).cycles
    engine_s = time.perf_counter() - t0
    host = sum(v for k, v in st.exposed_by_kind.items() if k.startswith("HOST") or k == "SYNC")
    sec = cyc * T.tck_ns * 1e-9
    weight_bytes = sum(2 * p for p in decode.info.get("linear_sizes", [])) or _weight_bytes(decode)
    macs = weight_bytes / 2 * tokens
    gpu_s = max(weight_bytes / (gpu_gbs * 1e9), 2 * macs / gpu_flops)
    return {
        "model": decode.info.get("model", "?"),
        "tokens": tokens,
        "vectors": pf.info["prefill"]["vectors"],
        "prefill_instructions": len(pf.instrs),
        "prefill_cycles": cyc,
        "ttft_ms": sec * 1e3,
        "prefill_tokens_per_s": tokens / sec if sec else 0.0,
        "per_token_cycles": dec * tokens,
        "speedup_vs_per_token": dec * tokens / cyc if cyc else 0.0,
        "host_and_sync_fraction": host / cyc if cyc else 0.0,
        "gpu_ttft_ms": gpu_s * 1e3,
        "gpu_prefill_tokens_per_s": tokens / gpu_s,
        "engine_seconds": engine_s,
    }


def _weight_bytes(program) -> int:
    """bf16 bytes of the weight matrices (placements recorded by the lowering, else the used rectangle of each row)."""
    q = program.info.get("quant", {})
    if q.get("weight_bytes"):
        return int(q["weight_bytes"])
    use = program.info.get("row_use")
    if use:
        return sum(2 * a * b for a, b in use.values())
    return 0


PREFILL_CONFIGS = (("smollm2-135m", 64), ("llama3-8b", 16))  # (shape-only config, prompt tokens): the 8B at 16 keeps the engine near 2 min


def bench_prefill(configs=PREFILL_CONFIGS, gpu_gbs: float = GPU_HBM_GBS) -> list[dict]:
    """:func:`prefill_timing` of each shape-only config (``nhil.compiler.shape_only``, aim-like, KV cache of 128)."""
    from nhil.compiler.pipeline import compile_shapes

    return [prefill_timing(compile_shapes(name, max_cache_len=128), tokens, gpu_gbs=gpu_gbs) for name, tokens in configs]


def prefill_rich_table(rows: list[dict]):
    """A ``rich`` table of :func:`bench_prefill` results."""
    from rich.table import Table

    t = Table(title="Modelled prefill (timing model, aim-like with the prefill extension: 16 tokens per row activation)")
    for c in ("config", "prompt", "TTFT", "prefill tok/s", "x prompt as decode steps", "host+SYNC share", "GPU roofline TTFT", "instructions"):
        t.add_column(c, justify="right" if c not in ("config",) else "left")
    for r in rows:
        t.add_row(r["model"], str(r["tokens"]), f"{r['ttft_ms']:.2f} ms", f"{r['prefill_tokens_per_s']:,.0f}", f"{r['speedup_vs_per_token']:.2f}",
                  f"{r['host_and_sync_fraction']:.3f}", f"{r['gpu_ttft_ms']:.3f} ms", f"{r['prefill_instructions']:,}")
    return t
