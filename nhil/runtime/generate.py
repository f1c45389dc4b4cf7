"""Generation loops on a target: teacher-forced and free-running greedy decoding.

The prompt runs through a prefill program (``nhil.compiler.prefill``: all prompt tokens at once,
each weight row activation serving several tokens) when one is given, else as one decode step
per prompt token; then one decode step per generated token. Both leave the same KV cache and
give the same logits bit for bit. Logits of step ``i`` are those at position ``P-1+i`` (the
prediction of generated token ``i``), matching the golden.
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


def prefill_runner(runner: Runner, tokens: int) -> tuple[Runner | None, str]:
    """A Runner of the prefill program of ``tokens`` prompt tokens for ``runner``'s decode program, on the same
    target and device state (with ``MAC_ABV`` only if the target claims it), or ``(None, reason)`` when the
    program cannot prefill at once (MoE dispatch, recurrent states, more than 255 tokens)."""
    from nhil.compiler.prefill import MAX_TOKENS, PrefillUnsupported, prefill_program
    from nhil.targets.base import unclaimed

    if not 1 < tokens <= MAX_TOKENS:
        return None, f"{tokens} prompt tokens (a prefill program runs 2..{MAX_TOKENS})"
    from nhil.isa.instr import Op

    caps = runner.t.capabilities()
    try:
        prog = prefill_program(runner.p, tokens, extension=Op.MAC_ABV in caps.ops)
    except PrefillUnsupported as e:
        return None, str(e)
    missing = unclaimed(prog, caps)
    if missing:
        return None, f"target {runner.t.name} does not implement {', '.join(missing)}"
    pf = Runner(prog, runner.t)
    pf.attach(runner)
    return pf, ""


def _run(runner: Runner, prompt: list[int], n: int, next_token: Callable[[int, int], int], progress=None, prefill: Runner | None = None) -> StepOutputs:
    runner.reset()
    logits, toks = [], []
    acts: dict[str, list] = {}
    seq = list(prompt)
    pos = 0
    total = len(prompt) + n - 1
    pre: list = []
    if prefill is not None:
        pre = prefill.prefill(seq[: len(prompt)], 0)
    while pos < total:
        out = pre[pos] if pos < len(pre) else runner.step(seq[pos], pos)
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


def run_teacher_forced(runner: Runner, prompt: list[int], golden_tokens: list[int], progress=None, prefill: Runner | None = None) -> StepOutputs:
    """Feed the golden's tokens step by step (one flip cannot cascade); T = len(golden_tokens).
    ``prefill``: a :func:`prefill_runner` of ``len(prompt)`` tokens (else the prompt runs token by token)."""
    return _run(runner, prompt, len(golden_tokens), lambda i, am: golden_tokens[i], progress, prefill)


def run_greedy(runner: Runner, prompt: list[int], n: int, progress=None, prefill: Runner | None = None) -> StepOutputs:
    """Free-running greedy decoding of ``n`` tokens on the target (``prefill`` as in :func:`run_teacher_forced`)."""
    return _run(runner, prompt, n, lambda i, am: am, progress, prefill)
