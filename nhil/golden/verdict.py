"""What a verify run found, in words: near ties and the two tiers' verdict (the report's ``divergence_summary``)."""

from __future__ import annotations

__all__ = ["asserted_any", "summary_words", "tie_words"]


def asserted_any(thresholds: dict, kind: str) -> bool:
    """Is any threshold of ``kind`` asserted (False: the accuracy of that kind is not judged)?"""
    return any(isinstance(v, dict) and v.get("asserted", True) for v in (thresholds.get(kind) or {}).values())


def tie_words(t: dict) -> str:
    """A near-tie record (``nhil.golden.accuracy``) as a parenthesised phrase."""
    if t.get("kind") == "routing":
        return f"(expert selection at layer {t.get('layer')}: golden {t.get('golden_experts')} vs device {t.get('device_experts')}, router gap {t.get('gap', 0):.3g} within noise {t.get('sigma', 0):.3g})"
    return f"(top-1/top-2 margin {t['margin']:.3g} <= 2 sigma = {t['bound']:.3g})"


def summary_words(R: dict) -> str:
    """What happened, in words (the report's first-divergence block)."""
    tight = R.get("tight") or {}
    fd = tight.get("first_difference")
    parts = []
    if fd:
        at = f"decode step {fd['step']} (position {fd['position']})" if "step" in fd else f"position {fd['position']}"
        parts.append(f"The target does not compute what the compiler meant: at {at} its {fd['tensor']} element {fd['element']} is {fd['target']!r} "
                     f"({fd['target_bits']}) where the device-numerics reference gives {fd['reference']!r} ({fd['reference_bits']}); "
                     f"{fd['elements_differing']} element(s) of that row differ. Everything before it is bit-identical.")
    elif tight:
        parts.append(f"The target is bit-identical to the device-numerics reference ({tight.get('elements_compared', 0):,} values).")
    for t in R.get("near_ties") or []:
        parts.append(f"Step {t['step']} is a near tie {tie_words(t)}: not an accuracy failure; the tight tier still compares its bits.")
    fdl = R.get("first_divergent_layer")
    if fdl:
        parts.append(f"Against fp32, {fdl['layer']} is the first layer over tolerance ({'; '.join(fdl['violations'])}).")
    if R.get("accuracy_not_judged"):
        parts.append(f"Accuracy against fp32 is reported but not judged: {R['accuracy_not_judged']}.")
    return " ".join(parts)
