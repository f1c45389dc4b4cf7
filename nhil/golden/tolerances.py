"""Tolerance profiles: profile -> kind of compared tensor -> metric -> threshold.

Edit :data:`PROFILES` to tune numbers; everything else reads it. Each threshold is a
dict with exactly one bound (``"min"`` or ``"max"``), ``asserted`` (True: a violation
fails the run; False: observe-only, reported but never failing) and ``reason`` (why this
number, so the next person to tune it knows what it stands for).

Kinds:
    ``logits``: one teacher-forced decode step, logits [V] of the target vs the fp32
        golden; metrics as produced per step by :func:`nhil.golden.metrics.compare_logits`
        (``cosine``, ``sqnr_db``, ``kl``, ``max_abs``, ``top1_agree``).
    ``hidden``: one decoder layer's output hidden states [P+T-1, H] (residual stream);
        metrics as produced by :func:`nhil.golden.metrics.compare_tensors`.

Derivation of the placeholder numbers of ``bf16-act-fp32-acc`` (to be tuned after
measuring SmolLM2-135M on the simulator):
    * bf16 has an 8-bit significand (7 stored bits + the implicit one): machine epsilon
      (spacing at 1.0) is 2^-7 = ``torch.finfo(torch.bfloat16).eps``, and round-to-nearest
      has per-element relative error <= 2^-8 (the unit roundoff; the brief's "2^-8
      epsilon, <= 2^-9 per element" is one bit optimistic). So one rounding has SQNR
      >= 20 log10(2^8) = 48.2 dB in the worst case; the typical value, with the error
      uniform within half an ulp, is 55.6 dB, measured on normal, uniform and log-normal
      data (``metrics.sqnr_db`` docstring).
    * Independent roundings add noise power: n roundings of similar size cost
      10 log10(n) dB; ~30 layers x several rounded activations each (norm out, q/k/v,
      attention out, MLP in/out, residual add) is ~200 roundings -> ~23 dB lost, and
      error amplification through attention softmax and SiLU costs more; so 25-40 dB at
      the last layer is the expected band and 20 dB is the alarm line.
    * For uncorrelated noise, cosine = 1 / sqrt(1 + 10^(-SQNR/10)) ~ 1 - 0.5*10^(-SQNR/10):
      20 dB -> 0.995, 25 dB -> 0.9984, 30 dB -> 0.9995.
    * For small logit noise of variance s^2 per entry, KL(P||Q) ~ s^2/2 * (1 - sum p^2)
      <= s^2/2; logits with std ~3 at 25 dB SQNR have s^2 ~ 0.03 -> KL <= 0.015 nats.

Per-row overrides (``tolerance:`` in ``expectations.yaml``, see :mod:`nhil.expectations`):
``{"<kind>.<metric>": {"min"|"max": number, "asserted": bool (optional), "reason": str}}``
replaces one threshold of the row's profile. The bound must be the profile's own bound
(``min`` stays ``min``), the reason is required, and the metric must exist in the
profile; :func:`validate_overrides` / :func:`apply_overrides` refuse anything else. The
overridden threshold keeps the replaced one under ``"override"`` (``profile_bound``,
``profile_value``, ``profile_asserted``, ``profile_reason``) so reports can show both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["PROFILES", "Violation", "apply_overrides", "check", "failing", "thresholds", "validate_overrides"]

PROFILES: dict[str, dict[str, Any]] = {
    "bf16-act-fp32-acc": {
        "description": (
            "PIM datapath: bf16 weights, bf16 activations, fp32 accumulation, compared with "
            "the fp32 PyTorch eager golden (accuracy tier, not bit-exact)."
        ),
        "logits": {
            "cosine": {
                "min": 0.998, "asserted": True,
                "reason": "uncorrelated noise at ~27 dB SQNR gives cosine 0.999; 0.998 ~ 24 dB (bf16 after ~30 layers: 25-40 dB)",
            },
            "sqnr_db": {
                "min": 25.0, "asserted": True,
                "reason": "one bf16 rounding ~55 dB; ~200 roundings over 30 layers cost ~23 dB -> expect >= 25-30 dB on logits; "
                "measured 2026-11-29 on the simulator: SmolLM2-135M worst step 33.0 dB (median ~42), llama-tiny worst 38.4 dB",
            },
            "kl": {
                "max": 0.02, "asserted": True,
                "reason": "KL ~ s^2/2 for logit noise variance s^2; logits std ~3 at 25 dB -> s^2 ~ 0.03 -> <= 0.015 nats (+margin)",
            },
            "top1_agree": {
                "min": 1.0, "asserted": True,
                "reason": "under teacher forcing both sides see the same prefix, so greedy tokens must agree at every step "
                "(a genuine near-tie would show up as a KL/SQNR pass with a top-1 failure: inspect, then relax per model)",
            },
            "max_abs": {
                "max": 1.0, "asserted": False,
                "reason": "observe-only: a plain atol fails on large-dynamic-range logits (anchors §10); 1.0 = logit range ~30 x 2^-8 "
                "per rounding ~0.12, x~8 growth over 30 layers",
            },
        },
        "hidden": {
            "cosine": {
                "min": 0.995, "asserted": True,
                "reason": "cosine 0.995 ~ 20 dB uncorrelated noise: the alarm line below the 25-40 dB expected after 30 bf16 layers",
            },
            "sqnr_db": {
                "min": 30.0, "asserted": True,
                "reason": "one bf16 rounding ~55 dB; ~30 layers of accumulated rounding expect 25-40 dB; measured 2026-11-29 on the "
                "simulator: SmolLM2-135M worst layer 43.6 dB (model.layers.10), llama-tiny 41.1 dB; 30 dB leaves >10 dB margin and "
                "still catches a single wrong GEMV (a swapped or unrounded operand costs far more). Llama residual streams hold a "
                "few massive-activation channels that dominate both SQNR and cosine",
            },
            "rel_l2": {
                "max": 0.1, "asserted": False,
                "reason": "observe-only: rel_l2 = 10^(-SQNR/20), 0.1 <=> 20 dB (same information as sqnr_db, reported for readers)",
            },
            "pcc": {
                "min": 0.99, "asserted": False,
                "reason": "observe-only: PCC is blind to scale/offset (tt-metal#22994); kept for comparison with tt-* reports",
            },
            "max_abs": {
                "max": math.inf, "asserted": False,
                "reason": "observe-only: no meaningful absolute bound on the residual stream (massive activations reach 100s)",
            },
        },
    },
}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One metric outside its threshold.

    Attributes:
        profile, kind: where the threshold came from.
        metric: metric name (``cosine``, ``sqnr_db``, ``kl``, ...).
        value: measured value (float; NaN when the metric is NaN or was not measured).
        bound: ``"min"`` or ``"max"``.
        threshold: the bound's number.
        asserted: True if this violation fails the run; False for observe-only metrics.
        reason: the threshold's documented reason.
        overridden: True if the threshold came from a per-row override (expectations.yaml).
    """

    profile: str
    kind: str
    metric: str
    value: float
    bound: str
    threshold: float
    asserted: bool
    reason: str
    overridden: bool = False

    def __str__(self) -> str:
        op = ">=" if self.bound == "min" else "<="
        tag = ("" if self.asserted else " (observe-only)") + (" (override)" if self.overridden else "")
        return f"{self.kind}.{self.metric} = {self.value:.6g}, needs {op} {self.threshold:g}{tag}: {self.reason}"


def thresholds(profile: str, kind: str, overrides: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The threshold table of ``profile``/``kind`` (metric -> {min|max, asserted, reason}),
    with the per-row ``overrides`` (module docstring) applied when given.

    Raises:
        ValueError: unknown profile or kind (the message lists the known ones), or an
            invalid override (see :func:`apply_overrides`).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown tolerance profile {profile!r}; known: {', '.join(sorted(PROFILES))} (nhil/golden/tolerances.py)")
    table = apply_overrides(profile, overrides) if overrides else PROFILES[profile]
    kinds = {k: v for k, v in table.items() if isinstance(v, dict)}
    if kind not in kinds:
        raise ValueError(f"tolerance profile {profile!r} has no kind {kind!r}; known: {', '.join(sorted(kinds))}")
    return kinds[kind]


# run-level metrics of the quantized profiles (nhil.compiler.quantize.tolerance_profile)
_RUN_METRICS = ("top1_rate", "greedy_match")


def _known_metrics(profile: str | None) -> dict[str, set[str]]:
    """kind -> metric names of ``profile``; for None, the union over every registered
    profile plus the run-level metrics of quantized profiles (registered lazily)."""
    out: dict[str, set[str]] = {"run": set(_RUN_METRICS)} if profile is None else {}
    for name, prof in PROFILES.items():
        if profile is not None and name != profile:
            continue
        for kind, table in prof.items():
            if isinstance(table, dict):
                out.setdefault(kind, set()).update(table)
    return out


def validate_overrides(overrides: Any, profile: str | None = None, where: str = "tolerance") -> dict[str, dict[str, Any]]:
    """Check the syntax of per-row tolerance overrides (module docstring); return them normalised.

    Args:
        overrides: the row's ``tolerance:`` mapping ``{"kind.metric": {min|max, asserted?, reason}}``.
        profile: check metric names and bounds against this profile; None: against every
            kind/metric any profile defines (the manifest is read before the profile is known).
        where: prefix of error messages (e.g. ``"expectations.yaml: entry 3"``).

    Returns:
        ``{"kind.metric": {"min"|"max": float, "reason": str[, "asserted": bool]}}``.

    Raises:
        ValueError: not a mapping, a key not of the form ``kind.metric``, an unknown kind
            or metric (the message lists the known ones), no reason, both or neither of
            min/max, a non-numeric bound, a bound the profile does not use for that metric,
            or an unknown field.
    """
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: tolerance overrides must be a mapping like {{logits.sqnr_db: {{min: 20, reason: \"...\"}}}}, got {overrides!r}")
    known = _known_metrics(profile)
    src = f"profile {profile!r}" if profile else "any tolerance profile"
    out: dict[str, dict[str, Any]] = {}
    for key, ov in overrides.items():
        kind, _, metric = str(key).partition(".")
        if not metric:
            raise ValueError(f"{where}: tolerance override {key!r} must be named <kind>.<metric>, e.g. logits.sqnr_db")
        if kind not in known:
            raise ValueError(f"{where}: tolerance override {key!r}: unknown kind {kind!r} in {src}; known: {', '.join(sorted(known))}")
        if metric not in known[kind]:
            raise ValueError(f"{where}: tolerance override {key!r}: unknown metric {metric!r} for {kind} in {src}; known: {', '.join(sorted(known[kind]))}")
        if not isinstance(ov, dict):
            raise ValueError(f"{where}: tolerance override {key!r} must be a mapping with min or max and a reason, got {ov!r}")
        extra = set(ov) - {"min", "max", "asserted", "reason"}
        if extra:
            raise ValueError(f"{where}: tolerance override {key!r} has unknown field(s) {', '.join(sorted(extra))}; allowed: min, max, asserted, reason")
        reason = ov.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{where}: tolerance override {key!r} needs a reason (why this row may use a different threshold): add reason: \"...\"")
        bounds = [b for b in ("min", "max") if b in ov]
        if len(bounds) != 1:
            raise ValueError(f"{where}: tolerance override {key!r} needs exactly one of min or max, got {bounds or 'neither'}")
        b = bounds[0]
        try:
            value = float(ov[b])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: tolerance override {key!r}: {b} must be a number, got {ov[b]!r}") from None
        if math.isnan(value):
            raise ValueError(f"{where}: tolerance override {key!r}: {b} must not be NaN")
        if profile is not None:
            th = PROFILES[profile][kind][metric]
            pb = "min" if "min" in th else "max"
            if b != pb:
                raise ValueError(f"{where}: tolerance override {key!r} sets {b}, but profile {profile!r} bounds this metric by {pb}: use {pb}")
        if "asserted" in ov and not isinstance(ov["asserted"], bool):
            raise ValueError(f"{where}: tolerance override {key!r}: asserted must be true or false, got {ov['asserted']!r}")
        norm = {b: value, "reason": reason.strip()}
        if "asserted" in ov:
            norm["asserted"] = ov["asserted"]
        out[f"{kind}.{metric}"] = norm
    return out


def apply_overrides(profile: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``PROFILES[profile]`` with per-row ``overrides`` applied (module docstring).

    Each overridden threshold becomes ``{min|max, asserted, reason, "override": {profile_bound,
    profile_value, profile_asserted, profile_reason}}``; ``asserted`` defaults to the
    profile's.

    Raises:
        ValueError: unknown profile, or an override :func:`validate_overrides` refuses
            for this profile.
    """
    import copy

    if profile not in PROFILES:
        raise ValueError(f"unknown tolerance profile {profile!r}; known: {', '.join(sorted(PROFILES))} (nhil/golden/tolerances.py)")
    table = copy.deepcopy(PROFILES[profile])
    for key, ov in validate_overrides(overrides or {}, profile, where=f"tolerance overrides for profile {profile!r}").items():
        kind, metric = key.split(".", 1)
        old = table[kind][metric]
        pb = "min" if "min" in old else "max"
        table[kind][metric] = {
            pb: ov[pb],
            "asserted": ov.get("asserted", bool(old.get("asserted", True))),
            "reason": ov["reason"],
            "override": {"profile_bound": pb, "profile_value": old[pb], "profile_asserted": bool(old.get("asserted", True)), "profile_reason": old.get("reason", "")},
        }
    return table


def _as_float(v: Any) -> float:
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    try:
        return float(v)  # also parses the JSON-safe "inf"/"-inf"/"nan" strings of nhil.golden.metrics
    except (TypeError, ValueError):
        return math.nan


def check(profile: str, kind: str, metrics: dict[str, Any], overrides: dict[str, Any] | None = None) -> list[Violation]:
    """Compare measured ``metrics`` with the thresholds of ``profile``/``kind`` (with the
    per-row ``overrides`` of the module docstring applied, when given).

    Args:
        profile: a key of :data:`PROFILES`, e.g. ``"bf16-act-fp32-acc"``.
        kind: ``"logits"`` (one step) or ``"hidden"`` (one layer).
        metrics: metric name -> value (float, bool for ``top1_agree``, or the JSON-safe
            strings ``"inf"``/``"nan"``). A metric the profile names but ``metrics``
            lacks, or a NaN value, counts as a violation (never a silent pass).

    Returns:
        violations in the profile's metric order, observe-only ones included (their
        ``asserted`` is False; use :func:`failing` to keep the asserted ones).

    Raises:
        ValueError: unknown profile or kind, or an invalid override.
    """
    out: list[Violation] = []
    for name, th in thresholds(profile, kind, overrides).items():
        value = _as_float(metrics.get(name))
        bound = "min" if "min" in th else "max"
        limit = float(th[bound])
        ok = (value >= limit) if bound == "min" else (value <= limit)  # NaN compares False -> violation
        if not ok:
            out.append(Violation(profile, kind, name, value, bound, limit, bool(th.get("asserted", True)), str(th["reason"]), "override" in th))
    return out


def failing(violations: list[Violation]) -> list[Violation]:
    """The asserted violations only (the ones that turn a run into MISMATCH)."""
    return [v for v in violations if v.asserted]
