"""Bench rows of the simulator's speed (``make bench``; issue 17 item 1).

``reference_speed`` times the per-instruction reference path (``SimTarget(reference=True)``,
the simulator as it was before the fast path) on the first positions of the same greedy
run that ``nhil.bench.bench_model`` times with the fast path, and checks on the way that
both paths give bit-identical logits there; ``sim_rows`` prints them beside PyTorch eager's
time per token from the same run.
"""

from __future__ import annotations

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
         f"x eager per token (goal <= 2.0); {ref['reference_s_per_token'] / ref['fast_s_per_token_same_positions']:.1f}x faster than reference; "
         f"logits bit-identical: {ref['bit_identical']}"),
    ]
    return rows
