"""Bench rows of the simulator's speed (``make bench``; issue 17 item 1).

``reference_speed`` times the per-instruction reference path (``SimTarget(reference=True)``,
the simulator as it was before the fast path) on the first positions of the same greedy
run that ``nhil.bench.bench_model`` times with the fast path, and checks on the way that
both paths give bit-identical logits there; ``sim_rows`` prints them beside PyTorch eager's
time per token from the same run.
"""

from __future__ import annotations

import os
import time

import numpy as np


def reference_speed(prog, prompt_ids: list[int], tokens: int, positions: int = 4) -> dict:
    """Seconds per decode step of the reference path over the first ``positions`` positions, and bit identity vs the fast path.

    Args:
        prog: the decode-step Program the bench simulates.
        prompt_ids: the prompt token ids (the positions fed are prompt tokens, then greedy tokens of the fast path).
        tokens: decoded tokens of the bench run (bounds ``positions``).
        positions: how many positions to time on the reference path (it is ~2-4x slower per step).
    Returns:
        ``{"positions", "reference_s_per_token", "fast_s_per_token_same_positions", "bit_identical"}``
        (fast and reference timed one after the other on the same positions).
    """
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    n = max(1, min(positions, len(prompt_ids) + tokens - 1))
    seq = list(prompt_ids)
    out: dict = {"positions": n}
    logits = {}
    for ref in (False, True):
        r = Runner(prog, SimTarget(reference=ref))
        r.reset()
        got = []
        t0 = time.perf_counter()
        for pos in range(n):
            o = r.step(seq[pos], pos)
            got.append(o["logits"].copy())
            if pos + 1 == len(seq):
                seq.append(int(np.argmax(got[-1])))
        dt = (time.perf_counter() - t0) / n
        out["reference_s_per_token" if ref else "fast_s_per_token_same_positions"] = dt
        logits[ref] = np.stack(got)
    out["bit_identical"] = bool(np.array_equal(logits[True].view(np.uint32), logits[False].view(np.uint32)))
    return out


def sim_rows(r: dict) -> list[tuple[str, str, str, str]]:
    """Table rows (stage, value, ratio, note) for a ``bench_model`` result that holds ``sim_reference``."""
    ref = r.get("sim_reference")
    if not ref:
        return []
    eager = r["eager_s_per_token"]
    rows = [
        ("simulate per token, reference path (before)", f"{ref['reference_s_per_token']:.3f} s", f"{ref['reference_s_per_token'] / eager:.1f}",
         f"x eager per token; first {ref['positions']} positions, SimTarget(reference=True)"),
        ("simulate per token, fast path, same positions", f"{ref['fast_s_per_token_same_positions']:.3f} s", f"{ref['fast_s_per_token_same_positions'] / eager:.1f}",
         f"x eager per token; a new Runner (its binding plans built in these steps: the goal row is 'warm'); "
         f"{ref['reference_s_per_token'] / ref['fast_s_per_token_same_positions']:.1f}x faster than reference; "
         f"logits bit-identical: {ref['bit_identical']}"),
    ]
    return rows


def prefill_speed(name: str = "llama", tokens: int = 64) -> dict:
    """Simulator wall time of a ``tokens``-token prompt: the prefill program vs the same prompt token by token,
    beside PyTorch eager's prefill (one forward over the prompt with a KV cache), in the same run.

    Returns:
        ``{"tokens", "transform_s", "prefill_s", "prefill_warm_s", "per_token_s", "eager_prefill_s", "bit_identical",
        "instructions", "per_token_instructions"}``; ``prefill_s`` is the first call (it builds the runtime's binding
        plans and the simulator's GEMV-run tables), ``prefill_warm_s`` a second call of the same runner after a
        reset (plans built: what a serving loop pays per prompt); ``bit_identical``: every prompt token's logits
        (both calls) and the next decode step's logits equal between the two paths.
    """
    import torch

    from nhil.compiler import pipeline
    from nhil.compiler.prefill import prefill_program
    from nhil.models import get_model
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    b = get_model(name)
    vocab = int(b.model.config.vocab_size)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, vocab, tokens)]
    prog = pipeline.compile(b, "aim-like", max_cache_len=tokens + 16, model_name=name).program
    out: dict = {"tokens": tokens, "per_token_instructions": len(prog.instrs) * tokens}
    logits = {}
    for use in (False, True):
        t = SimTarget()
        t.open()
        r = Runner(prog, t)
        r.reset()
        if use:
            t0 = time.perf_counter()
            pf = Runner(prefill_program(prog, tokens), t)
            pf.attach(r)
            out["transform_s"] = time.perf_counter() - t0
            out["instructions"] = len(pf.p.instrs)
            t0 = time.perf_counter()
            first = [o["logits"].copy() for o in pf.prefill(ids, 0)]
            out["prefill_s"] = time.perf_counter() - t0
            r.reset()
            t0 = time.perf_counter()
            got = [o["logits"].copy() for o in pf.prefill(ids, 0)]
            out["prefill_warm_s"] = time.perf_counter() - t0
            same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(first, got))
        else:
            t0 = time.perf_counter()
            got = [r.step(tok, i)["logits"].copy() for i, tok in enumerate(ids)]
            out["per_token_s"] = time.perf_counter() - t0
        got.append(r.step(ids[0], tokens)["logits"].copy())
        logits[use] = np.stack(got)
    out["bit_identical"] = bool(same and np.array_equal(logits[True].view(np.uint32), logits[False].view(np.uint32)))
    from transformers import DynamicCache

    with torch.no_grad():
        x = torch.tensor([ids])
        best = float("inf")
        for _ in range(3):  # best of 3 (the first call warms up)
            cache = DynamicCache(config=b.model.config)
            t0 = time.perf_counter()
            b.model(input_ids=x, past_key_values=cache, use_cache=True, cache_position=torch.arange(tokens))
            best = min(best, time.perf_counter() - t0)
    out["eager_prefill_s"] = best
    return out


def prefill_rows(r: dict) -> list[tuple[str, str, str, str]]:
    """Bench rows of :func:`prefill_speed`, once (on the ``llama`` model result)."""
    if r.get("model") != "llama" or os.environ.get("NHIL_BENCH_PREFILL", "1") == "0":
        return []
    p = r["prefill"] = prefill_speed("llama", 64)
    e = p["eager_prefill_s"]
    return [
        (f"simulate prefill of {p['tokens']} tokens, prefill program", f"{p['prefill_s']:.2f} s", f"{p['prefill_s'] / e:.1f}",
         f"x eager prefill ({e:.3f} s, one forward; goal <= 3.0); first call (builds binding plans); +{p['transform_s']:.1f} s "
         f"to build the program; {p['instructions']:,} instructions"),
        (f"simulate prefill of {p['tokens']} tokens, prefill program, warm", f"{p['prefill_warm_s']:.2f} s", f"{p['prefill_warm_s'] / e:.1f}",
         "x eager prefill (goal <= 3.0); second call after a reset: plans built, as a serving loop runs"),
        (f"simulate prefill of {p['tokens']} tokens, token by token (before)", f"{p['per_token_s']:.2f} s", f"{p['per_token_s'] / e:.1f}",
         f"x eager prefill; {p['per_token_s'] / p['prefill_s']:.2f}x the prefill program's time; logits bit-identical: {p['bit_identical']}"),
    ]
