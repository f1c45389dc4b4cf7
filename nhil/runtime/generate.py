"""Generation loops on a target: teacher-forced and free-running greedy decoding.

Prefill runs as one program step per prompt token (per-token GEMVs, KV cache appended
in PIM memory), then one step per generated token. Logits of step ``i`` are those at
position ``P-1+i`` (the prediction of generated token ``i``), matching the golden.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from nhil.runtime.executor import Runner


@dataclasses.dataclass
class StepOutputs:
    """Results of a run.

    Attributes:
        logits: float32 [T, V], row i predicts token i.
        tokens: argmax of each row (int list, length T).
        acts: name -> float32 [positions, H] per-layer activations at every position run.
    """

    logits: np.ndarray
    tokens: list[int]
    acts: dict[str, np.ndarray]


def _run(runner: Runner, prompt: list[int], n: int, next_token: Callable[[int, int], int], progress=None) -> StepOutputs:
    runner.reset()
    logits, toks = [], []
    acts: dict[str, list] = {}
    seq = list(prompt)
    pos = 0
    total = len(prompt) + n - 1
    while pos < total:
        out = runner.step(seq[pos], pos)
        for k, v in out.items():
            if k.startswith("act."):
                acts.setdefault(k, []).append(v.copy())
        if pos >= len(prompt) - 1:
            lg = out["logits"].copy()
            logits.append(lg)
            am = int(np.argmax(lg))
            toks.append(am)
            if len(seq) == pos + 1:
                seq.append(next_token(len(toks) - 1, am))
        pos += 1
        if progress:
            progress(pos, total)
    return StepOutputs(np.stack(logits) if logits else np.zeros((0, 0), np.float32), toks, {k: np.stack(v) for k, v in acts.items()})


def run_teacher_forced(runner: Runner, prompt: list[int], golden_tokens: list[int], progress=None) -> StepOutputs:
    """Feed the golden's tokens step by step (one flip cannot cascade); T = len(golden_tokens)."""
    return _run(runner, prompt, len(golden_tokens), lambda i, am: golden_tokens[i], progress)


def run_greedy(runner: Runner, prompt: list[int], n: int, progress=None) -> StepOutputs:
    """Free-running greedy decoding of ``n`` tokens on the target."""
    return _run(runner, prompt, n, lambda i, am: am, progress)
