"""Report writers: atomic text/JSON files, Markdown for a verify report, a console summary.

A verify report is a dict (JSON-safe after :func:`write_json`) with keys:

* ``outcome``: ``PASS``, ``MISMATCH``, ``COMPILE_FAIL``, ... (see ``nhil.errors``);
* ``model``, ``target``: names; ``reproducer``: one-line command that reruns it;
* ``checks``: list of ``{name, passed, detail}``;
* ``steps``: per decode step ``{step, position, golden_token, target_token, cosine,
  sqnr_db, kl, max_abs, top1_agree}`` (kl in nats, sqnr in dB);
* ``layers``: per layer ``{layer, cosine, sqnr_db, max_abs, passed}``;
* ``first_divergent_layer``: layer name/index or ``None``;
* ``timings``: stage -> seconds;
* ``thresholds``: the tolerance table used, e.g. a profile of
  ``nhil.golden.tolerances.PROFILES`` (kind -> metric -> {min|max, asserted, reason}),
  with the manifest row's overrides applied (an overridden threshold has an
  ``override`` dict holding the profile value it replaced);
* ``tolerance_overrides``: per override ``{metric, bound, value, asserted, reason,
  profile, profile_value, profile_asserted, profile_reason}``.

Any key may be missing; the renderer shows what is there. Numbers may be floats or the
``"inf"``/``"nan"`` strings of :func:`nhil.golden.metrics.json_safe`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from nhil.util import atomic_write_text  # noqa: E402  (re-exported: atomic temp-file + rename)

__all__ = ["atomic_write_text", "write_json", "render_markdown", "print_summary", "sqnr_bars"]


def _json_safe(obj: Any) -> Any:
    from nhil.golden.metrics import json_safe

    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return json_safe(obj)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented strict JSON atomically (see :func:`atomic_write_text`).

    Non-finite floats become ``"inf"``/``"-inf"``/``"nan"``, numpy scalars/arrays become
    Python values, paths become strings.

    Raises:
        TypeError: an object JSON cannot encode.
        OSError: the directory is not writable.
    """
    atomic_write_text(path, json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n")


def _num(v: Any, digits: int = 6) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, int):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return _cell(v)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:.{digits}g}"


def _cos(v: Any) -> str:
    """A cosine with enough digits to differ from 1 (and ``1 - cos`` beside it)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return _num(v)
    if math.isnan(f) or math.isinf(f):
        return _num(f)
    return "1 (exact)" if f == 1.0 else f"{f:.10f} (1-cos {1.0 - f:.3g})"


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def sqnr_bars(layers: list[dict[str, Any]], width: int = 40, full_scale_db: float = 60.0) -> str:
    """ASCII bar chart of per-layer SQNR: one line per layer, ``#`` per (full_scale_db/width) dB.

    ``inf`` (bit-exact) draws a full bar; NaN or missing draws ``?``; failing layers are
    marked ``<- FAIL``.
    """
    lines = []
    for d in layers:
        v = d.get("sqnr_db")
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if math.isnan(f):
            bar, txt = "?", "nan"
        else:
            n = width if f >= full_scale_db else max(0, int(round(f / full_scale_db * width)))
            bar, txt = "#" * n, ("inf" if math.isinf(f) and f > 0 else f"{f:.1f}")
        mark = "  <- FAIL" if d.get("passed") is False else ""
        lines.append(f"{str(d.get('layer', '?')):>14} |{bar:<{width}}| {txt:>6} dB{mark}")
    return "\n".join(lines)


def _threshold_rows(th: dict[str, Any], prefix: str = "") -> list[list[str]]:
    rows = []
    for k, v in th.items():
        if not isinstance(v, dict):
            continue
        if "reason" in v and ("min" in v or "max" in v):
            bound = f">= {_num(v['min'])}" if "min" in v else f"<= {_num(v['max'])}"
            ov = v.get("override")
            if isinstance(ov, dict):
                bound += f" (override; profile {'>=' if ov.get('profile_bound') == 'min' else '<='} {_num(ov.get('profile_value'))})"
            rows.append([_cell(prefix + k), bound, "asserted" if v.get("asserted", True) else "observe-only", _cell(v["reason"])])
        else:
            rows += _threshold_rows(v, prefix + k + ".")
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    """Markdown text of a verify report (layout in the module docstring).

    Sections (each only when its key is present): header with outcome/model/target and
    the reproducer, checks, per-step logits table, per-layer table with an ASCII SQNR
    bar chart and the first divergent layer, thresholds with reasons, timings (s).
    """
    out: list[str] = []
    outcome = report.get("outcome", "UNKNOWN")
    out.append(f"# nhil verify: {outcome}")
    out.append("")
    out.append(f"- model: `{report.get('model', '?')}`")
    out.append(f"- target: `{report.get('target', '?')}`")
    for key, label in (("quant", "weights"), ("device", "device"), ("prompt", "prompt"), ("golden_text", "golden continuation"), ("target_text", "target continuation")):
        v = report.get(key)
        if isinstance(v, dict):
            v = v.get("name")
        if v is not None:
            out.append(f"- {label}: `{v!r}`" if key.endswith("text") or key == "prompt" else f"- {label}: `{v}`")
    if report.get("expected"):
        out.append(f"- expected outcome: `{report['expected']}`")
    if report.get("reproducer"):
        out += ["- reproducer:", "", "```", str(report["reproducer"]), "```"]
    out.append("")
    if report.get("error"):
        out += ["## Error", "", "```", str(report["error"]), "```", ""]
    mm = report.get("cross_target_first_mismatch")
    if mm:
        out += ["## First difference from the simulator", ""]
        out += _table(["field", "value"], [[_cell(k), _cell(v)] for k, v in mm.items()])
        out.append("")

    from nhil.report.tiers import tier_sections

    out += tier_sections(report)
    checks = report.get("checks") or []
    if checks:
        out += ["## Checks", ""]
        out += _table(
            ["check", "result", "detail"],
            [[_cell(c.get("name", "")), "pass" if c.get("passed") else "**FAIL**", _cell(c.get("detail", ""))] for c in checks],
        )
        out.append("")

    steps = report.get("steps") or []
    if steps:
        out += ["## Per-step logits (teacher forcing, accuracy tier vs fp32)", ""]
        gtxt, ttxt = report.get("golden_token_text") or [], report.get("target_token_text") or []

        def tok(ids_key: Any, texts: list, i: int) -> str:
            t = _cell(ids_key if ids_key is not None else "-")
            return f"{t} `{texts[i]!r}`" if i < len(texts) else t

        out += _table(
            ["step", "position", "golden token", "target token", "cosine", "SQNR dB", "KL (nats)", "max abs", "top-1 agree"],
            [
                [
                    _num(s.get("step")), _num(s.get("position")), tok(s.get("golden_token"), gtxt, i),
                    tok(s.get("target_token"), ttxt, i), _cos(s.get("cosine")), _num(s.get("sqnr_db"), 4),
                    _num(s.get("kl"), 4), _num(s.get("max_abs"), 4),
                    "near tie" if s.get("near_tie") else _num(s.get("top1_agree")),
                ]
                for i, s in enumerate(steps)
            ],
        )
        out.append("")

    layers = report.get("layers") or []
    if layers:
        out += ["## Per-layer hidden states", ""]
        out += _table(
            ["layer", "cosine", "SQNR dB", "max abs", "pass"],
            [
                [_cell(d.get("layer", "?")), _cos(d.get("cosine")), _num(d.get("sqnr_db"), 4), _num(d.get("max_abs"), 4),
                 "pass" if d.get("passed") else ("**FAIL**" if d.get("passed") is False else "-")]
                for d in layers
            ],
        )
        out += ["", "SQNR per layer (dB, `#` = 1.5 dB, full bar >= 60 dB):", "", "```", sqnr_bars(layers), "```", ""]
        for png in report.get("plots") or []:
            out += [f"![{png}]({png})", ""]
    if "first_divergent_layer" in report:
        fdl = report["first_divergent_layer"]
        if fdl is None:
            out += ["First divergent layer: none", ""]
        elif not isinstance(fdl, dict):
            out += [f"First divergent layer: **{fdl}**", ""]
        else:
            out += [f"First divergent layer: **{fdl.get('layer')}**: {'; '.join(fdl.get('violations', []))}", ""]
            tops = fdl.get("top_differences") or []
            if tops:
                out += _table(["position", "channel", "golden", "target", "abs diff"], [[_num(t["position"]), _num(t["channel"]), _num(t["golden"], 6), _num(t["target"], 6), _num(t["abs_diff"], 4)] for t in tops])
                out.append("")
    ftd = report.get("first_divergent_token")
    if ftd:
        out += ["## First divergent token (free-running)", ""]
        out += _table(["field", "value"], [[_cell(k), _cell(v)] for k, v in ftd.items()])
        out.append("")

    ovs = report.get("tolerance_overrides") or []
    if ovs:
        out += ["## Tolerance overrides (expectations manifest)", ""]
        out += _table(
            ["metric", "override", "reason", "profile value replaced", "profile reason"],
            [[_cell(o.get("metric")), f"{'>=' if o.get('bound') == 'min' else '<='} {_num(o.get('value'))}" + ("" if o.get("asserted", True) else " (observe-only)"),
              _cell(o.get("reason", "")), f"{'>=' if o.get('bound') == 'min' else '<='} {_num(o.get('profile_value'))} in {_cell(o.get('profile', '?'))}", _cell(o.get("profile_reason", ""))]
             for o in ovs],
        )
        out.append("")
    th = report.get("thresholds") or {}
    if th:
        out += ["## Thresholds", ""]
        if isinstance(th.get("description"), str):
            out += [th["description"], ""]
        rows = _threshold_rows(th)
        if rows:
            out += _table(["metric", "bound", "kind", "reason"], rows)
        out.append("")

    stats = report.get("target_stats") or {}
    if stats:
        out += ["## Target counters", "", "```", json.dumps(stats, indent=1, default=str)[:4000], "```", ""]

    timings = report.get("timings") or {}
    if timings:
        out += ["## Timings", ""]
        out += _table(["stage", "seconds"], [[_cell(k), _num(v, 4)] for k, v in timings.items()])
        total = sum(float(v) for v in timings.values() if isinstance(v, (int, float)))
        out += [f"| **total** | {total:.4g} |", ""]
    return "\n".join(out).rstrip() + "\n"


def print_summary(report: dict[str, Any], file: TextIO | None = None) -> None:
    """Print a short rich table (outcome, model, target, failed checks, worst step/layer,
    first divergent layer, total time, reproducer unless PASS) to ``file`` (default stderr)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stderr, highlight=False)
    outcome = str(report.get("outcome", "UNKNOWN"))
    colour = "green" if outcome in ("PASS", "XPASS") else ("yellow" if outcome.startswith("SKIPPED") else "red")
    t = Table(title=f"nhil verify: [{colour}]{outcome}[/{colour}]", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    t.add_row("model", str(report.get("model", "?")))
    t.add_row("target", str(report.get("target", "?")))
    checks = report.get("checks") or []
    failed = [c.get("name", "?") for c in checks if not c.get("passed")]
    t.add_row("checks", f"{len(checks) - len(failed)}/{len(checks)} passed" + (f" (failed: {', '.join(map(str, failed))})" if failed else ""))

    def _f(v: Any) -> float:
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan

    steps = report.get("steps") or []
    if steps:
        worst = min(steps, key=lambda s: (_f(s.get("sqnr_db")) if not math.isnan(_f(s.get("sqnr_db"))) else -math.inf))
        agree = sum(1 for s in steps if s.get("top1_agree"))
        t.add_row("steps", f"{agree}/{len(steps)} top-1 agree; worst SQNR {_num(worst.get('sqnr_db'), 4)} dB at step {worst.get('step')}; "
                  f"max KL {_num(max((_f(s.get('kl')) for s in steps), default=math.nan), 4)} nats")
    layers = report.get("layers") or []
    if layers:
        worst = min(layers, key=lambda d: (_f(d.get("sqnr_db")) if not math.isnan(_f(d.get("sqnr_db"))) else -math.inf))
        t.add_row("layers", f"{sum(1 for d in layers if d.get('passed'))}/{len(layers)} pass; worst SQNR {_num(worst.get('sqnr_db'), 4)} dB at {worst.get('layer')}")
    if "first_divergent_layer" in report:
        t.add_row("first divergent layer", str(report["first_divergent_layer"]))
    timings = report.get("timings") or {}
    if timings:
        t.add_row("time", f"{sum(_f(v) for v in timings.values() if not math.isnan(_f(v))):.2f} s")
    if outcome != "PASS" and report.get("reproducer"):
        t.add_row("reproduce", str(report["reproducer"]))
    console.print(t)
