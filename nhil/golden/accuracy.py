"""The accuracy tier: the target against the fp32 eager golden, with near ties told apart.

Per teacher-forced step the logits are checked against the tolerance profile
(``nhil.golden.tolerances``); per decoder layer the residual stream over every position.
Two kinds of difference are not failures of this tier, because noise the tier itself
allows can produce them (the tight tier still demands bits):

* **top-1 near tie**: the target's top-1 token differs from the golden's, every other
  asserted logit metric of the step passes, and the golden's margin between the two
  tokens ``g[golden] - g[target]`` is at most ``2 sigma``, where ``sigma`` = RMS(golden
  logits of the step) x 10^(-S/20) is the per-logit RMS error the profile's logits SQNR
  floor S allows: two logits each moved by the allowed noise in opposite directions
  cross a margin of ``2 sigma``.
* **routing near tie** (MoE): an expert selection that differs from the golden's where
  the golden's own routing reaches the device's experts within the allowed router-logit
  noise (:func:`nhil.golden.routing.routing_differences`). That position's logits step is
  reported as a near tie, and the position is left out of the hidden-state metrics of the
  decoder layer where the selection differed and every layer after it; the other steps
  and positions are judged on their own.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["effective_thresholds", "judge_layers", "judge_steps", "logit_sigma", "token_divergence", "top_differences"]


def logit_sigma(golden_row: np.ndarray, sqnr_floor_db: float) -> float:
    """Per-logit RMS error allowed by an SQNR floor: RMS(golden row) x 10^(-floor/20) (float, logits units)."""
    return float(np.sqrt(np.mean(np.square(golden_row.astype(np.float64))))) * 10.0 ** (-sqnr_floor_db / 20.0)


def top_differences(ref: np.ndarray, got: np.ndarray, k: int = 5) -> list[dict]:
    """The ``k`` largest |ref - got| elements of a [positions, hidden] activation (position, channel, values)."""
    diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    flat = np.argsort(diff, axis=None)[::-1][:k]
    out = []
    for i in flat:
        p, c = np.unravel_index(i, diff.shape)
        out.append({"position": int(p), "channel": int(c), "golden": float(ref[p, c]), "target": float(got[p, c]), "abs_diff": float(diff[p, c])})
    return out


def token_divergence(step: int, ref_logits: np.ndarray, test_logits: np.ndarray, ref_tok: int, test_tok: int, k: int = 5) -> dict:
    """At the first free-running token that differs (same prefix on both sides): is each side's
    token in the other's top-k, and the two logit gaps (a near tie vs a real error)."""
    ref_top = [int(t) for t in np.argsort(ref_logits)[::-1][:k]]
    test_top = [int(t) for t in np.argsort(test_logits)[::-1][:k]]
    return {
        "step": step,
        "golden_token": ref_tok,
        "target_token": test_tok,
        f"target_token_in_golden_top{k}": test_tok in ref_top,
        f"golden_token_in_target_top{k}": ref_tok in test_top,
        "golden_logit_gap": float(ref_logits[ref_tok] - ref_logits[test_tok]),
        "target_logit_gap": float(test_logits[test_tok] - test_logits[ref_tok]),
    }


def effective_thresholds(profile: str, overrides: dict, report: dict, log=None) -> dict:
    """The profile's threshold table with the manifest row's overrides applied; records the
    overrides in ``report["tolerance_overrides"]`` (metric, bound, value, reason, and the
    profile value/reason they replaced).

    Raises:
        SetupError: an override this profile refuses (unknown metric, wrong bound, no reason).
    """
    from nhil.errors import SetupError
    from nhil.golden.tolerances import apply_overrides

    try:
        table = apply_overrides(profile, overrides)
    except ValueError as e:
        raise SetupError(f"expectations manifest: {e}") from None
    rows = []
    for kind, metrics_ in table.items():
        if not isinstance(metrics_, dict):
            continue
        for metric, th in metrics_.items():
            ov = th.get("override") if isinstance(th, dict) else None
            if ov:
                b = ov["profile_bound"]
                rows.append({"metric": f"{kind}.{metric}", "bound": b, "value": th[b], "asserted": th["asserted"], "reason": th["reason"],
                             "profile": profile, "profile_value": ov["profile_value"], "profile_asserted": ov["profile_asserted"], "profile_reason": ov["profile_reason"]})
    if rows:
        report["tolerance_overrides"] = rows
        if log:
            log("tolerance overrides from the manifest: " + "; ".join(f"{r['metric']} {r['bound']} {r['value']:g} (profile {r['profile_value']:g}): {r['reason']}" for r in rows))
    return table


def _floor(thresholds: dict, kind: str, metric: str = "sqnr_db") -> float:
    th = (thresholds.get(kind) or {}).get(metric) or {}
    v = th.get("min")
    return float(v) if v is not None else math.inf


def judge_steps(profile: str, overrides: dict, thresholds: dict, golden_logits: np.ndarray, target_logits: np.ndarray,
                golden_tokens: list[int], prompt_len: int, routing_ties: dict[int, dict] | None = None) -> tuple[list[dict], list[str], list[dict]]:
    """Per-step logits checks of a teacher-forced run (module docstring).

    Args:
        golden_logits / target_logits: float32 [T, V].
        golden_tokens: T golden token ids (teacher-forced inputs).
        routing_ties: position -> routing near-tie record; that position's step is a near tie.

    Returns:
        ``(steps, failures, near_ties)``: per-step rows (``nhil.golden.metrics.compare_logits``
        fields plus ``position``, ``golden_token``, ``target_token``, ``passed`` and, for a near
        tie, ``near_tie`` = {kind, margin, sigma, bound | routing}), the failure strings of the
        failing steps, and the near-tie records.
    """
    from nhil.golden import metrics
    from nhil.golden.tolerances import check, failing

    cmp = metrics.compare_logits(golden_logits, target_logits)
    floor = _floor(thresholds, "logits")
    steps, fails, ties = [], [], []
    for s in cmp["steps"]:
        s = dict(s)
        s["position"] = prompt_len - 1 + s["step"]
        s["golden_token"] = golden_tokens[s["step"]]
        s["target_token"] = s.pop("test_top1")
        v = failing(check(profile, "logits", s, overrides))
        tie = None
        if routing_ties and s["position"] in routing_ties:
            tie = {"kind": "routing", **routing_ties[s["position"]]}
        elif v and all(x.metric == "top1_agree" for x in v) and math.isfinite(floor):
            row = golden_logits[s["step"]]
            margin = float(row[s["golden_token"]]) - float(row[s["target_token"]])
            sigma = logit_sigma(row, floor)
            if margin <= 2.0 * sigma:
                tie = {"kind": "top1", "margin": margin, "sigma": sigma, "bound": 2.0 * sigma}
        if tie is not None:
            tie["step"], tie["position"] = s["step"], s["position"]
            s["near_tie"] = tie
            ties.append(tie)
            s["passed"] = True
        else:
            s["passed"] = not v
            if v:
                fails.append(f"step {s['step']}: " + "; ".join(str(x) for x in v))
        steps.append(s)
    return steps, fails, ties


def judge_layers(profile: str, overrides: dict, golden: dict, target_acts: dict, names: list[str],
                 excluded: dict[int, set[int]] | None = None) -> tuple[list[dict], dict | None]:
    """Per-layer hidden-state checks over every position (module docstring).

    Args:
        golden: golden tensors by name (``act.*`` float32 [positions, H]).
        target_acts: the target's activations by name (float32 [positions run, H]).
        names: activation names in model order.
        excluded: decoder layer index -> positions left out of it (routing near ties).

    Returns:
        ``(rows, first_bad)``: per layer ``{layer, cosine, sqnr_db, max_abs, rel_l2, passed,
        positions_excluded?}``; the first failing layer with its violations and largest
        differences, or None.
    """
    from nhil.golden import metrics
    from nhil.golden.tolerances import check, failing

    rows, first_bad = [], None
    for name in names:
        if name not in target_acts or name not in golden:
            continue
        ref = golden[name].numpy() if hasattr(golden[name], "numpy") else np.asarray(golden[name])
        got = target_acts[name][: ref.shape[0]]
        if got.shape != ref.shape:  # the program captured another value under this name: a failed layer, named
            row = {"layer": name.removeprefix("act."), "cosine": None, "sqnr_db": None, "max_abs": None, "rel_l2": None, "passed": False}
            why = f"the target's activation is {list(got.shape)}, the golden's {list(ref.shape)}: the program captures another value under {name}"
            if first_bad is None:
                first_bad = {"layer": row["layer"], "violations": [why], "top_differences": []}
            rows.append(row)
            continue
        skip: set[int] = set()
        if excluded and name.startswith("act.model.layers."):
            layer = int(name.rsplit(".", 1)[1])
            for first_layer, pos in excluded.items():
                if layer >= first_layer:
                    skip |= pos
        keep = [p for p in range(ref.shape[0]) if p not in skip]
        m = metrics.compare_tensors(ref[keep], got[keep])
        v = failing(check(profile, "hidden", m, overrides))
        row = {"layer": name.removeprefix("act."), "cosine": m["cosine"], "sqnr_db": m["sqnr_db"], "max_abs": m["max_abs"], "rel_l2": m["rel_l2"], "passed": not v}
        if skip:
            row["positions_excluded"] = sorted(skip)
        if v and first_bad is None:
            first_bad = {"layer": row["layer"], "violations": [str(x) for x in v], "top_differences": top_differences(ref[keep], got[keep])}
        rows.append(row)
    return rows, first_bad
