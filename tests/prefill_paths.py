"""Shared by the prefill tests: a prompt run token by token and through its prefill program, on fresh simulators."""

from __future__ import annotations

import numpy as np

from nhil.runtime.executor import Runner
from nhil.runtime.generate import prefill_runner
from nhil.targets.sim import SimTarget


def per_token_and_prefill(prog, tokens, reference=False):
    """Outputs of every prompt token, the bank state and the next decode step's logits, both ways."""
    res = []
    for use_prefill in (False, True):
        t = SimTarget(reference=reference)
        t.open()
        r = Runner(prog, t)
        r.reset()
        if use_prefill:
            pf, why = prefill_runner(r, len(tokens))
            assert pf is not None, why
            outs = [{k: v.copy() for k, v in o.items()} for o in pf.prefill(tokens, 0)]
        else:
            outs = [{k: v.copy() for k, v in r.step(tok, i).items()} for i, tok in enumerate(tokens)]
        nxt = r.step(11, len(tokens))["logits"].copy()
        st = t.state
        res.append((outs, nxt, {int(row): st.mem[:, :, st.row_slot[row]].copy() for row in np.flatnonzero(st.row_slot >= 0)}, dict(st.counts)))
    return res
