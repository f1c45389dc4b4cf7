"""Markdown sections of a verify report for its two tiers, kept apart.

* "What happened": the report's ``divergence_summary`` in words;
* "Tight tier: target vs compiler semantics": bit identity with the device-numerics
  reference, and where the first bits differ (step or position, tensor, element, both
  values with their IEEE-754 bits);
* "Near ties": top-1 flips and MoE expert selections within the accuracy tier's noise
  (margin, sigma, layer, experts);
* "Where it ran": PIM primitives, host primitives, host ATen ops, PIM share of weights and MACs.
* "Compiled with": the scheduling passes and whether each changed the program.

Used by :func:`nhil.report.writer.render_markdown`.
"""

from __future__ import annotations

from typing import Any


def tier_sections(report: dict[str, Any]) -> list[str]:
    """Markdown lines of the sections listed in the module docstring (empty when the report has none)."""
    from nhil.report.writer import _cell, _table  # the report's own table helpers

    out: list[str] = []
    if report.get("divergence_summary"):
        out += ["## What happened", "", str(report["divergence_summary"]), ""]
    tight = report.get("tight")
    if isinstance(tight, dict):
        out += ["## Tight tier: target vs compiler semantics (device-numerics reference, bit for bit)", ""]
        fd = tight.get("first_difference")
        if not fd:
            out += [f"PASS: {tight.get('logits_steps')} steps of logits and {int(tight.get('tensors_compared', 1)) - 1} activations at every position, "
                    f"{int(tight.get('elements_compared', 0)):,} values, bit-identical.", ""]
        else:
            out += ["**FAIL**: the target differs from what the compiler meant. First difference:", ""]
            out += _table(["field", "value"], [[_cell(k), _cell(v)] for k, v in fd.items()])
            out.append("")
    ties = report.get("near_ties") or []
    if ties:
        out += ["## Near ties (accuracy tier: reported, not failed)", ""]
        rows = []
        for t in ties:
            if t.get("kind") == "routing":
                what = f"expert selection at layer {t.get('layer')} ({t.get('module')}): golden {t.get('golden_experts')} vs device {t.get('device_experts')}"
                size = f"router-logit gap {float(t.get('gap', 0)):.4g}, noise sigma {float(t.get('sigma', 0)):.4g}"
            else:
                what = "top-1 token flip"
                size = f"golden margin {float(t['margin']):.4g} <= 2 sigma = {float(t['bound']):.4g}"
            rows.append([_cell(t.get("step")), _cell(t.get("position")), _cell(what), _cell(size)])
        out += _table(["step", "position", "what", "size"], rows)
        out.append("")
    routing = [r for r in report.get("routing_differences") or [] if not r.get("near_tie")]
    if routing:
        out += ["## Expert selections that differ beyond the noise", ""]
        out += _table(["position", "layer", "golden experts", "device experts", "gap", "sigma"],
                      [[_cell(r["position"]), _cell(r["layer"]), _cell(r["golden_experts"]), _cell(r["device_experts"]), f"{r['gap']:.4g}", f"{r['sigma']:.4g}"] for r in routing])
        out.append("")
    if report.get("accuracy_not_judged"):
        out += ["## Accuracy not judged", "", str(report["accuracy_not_judged"]), ""]
    out += _placement_section(report.get("placement"))
    pf = report.get("prefill")
    if pf:
        out += ["## Prefill (`nhil.compiler.prefill`)", ""]
        if pf.get("mode") == "program":
            out += [f"The {pf['tokens']}-token prompt ran as one prefill program ({pf['instructions']:,} instructions; "
                    f"{pf['decode_instructions_x_tokens']:,} as {pf['tokens']} decode steps), up to {pf['vectors']} tokens per "
                    f"weight-row activation; its logits and activations are in the tiers above.", ""]
        else:
            out += [f"Token by token: {pf.get('reason')}.", ""]
    log = report.get("pass_log") or []
    if log:
        out += ["## Compiled with (scheduling passes, `nhil.compiler.pipeline`)", ""]
        out += _table(["pass", "stage", "changed the program", "instructions"],
                      [[_cell(p["name"]), _cell(p["stage"]), "-" if p.get("changed") is None else ("yes" if p["changed"] else "no"),
                        "-" if p.get("instrs_before") is None else f"{p['instrs_before']} -> {p['instrs_after']}"] for p in log])
        out.append("")
    return out


def _placement_section(pl: dict | None) -> list[str]:
    """"Where it ran": PIM primitives, host primitives, host ATen ops, PIM share of weights and MACs (``nhil.compiler.placement``)."""
    if not pl:
        return []
    from nhil.report.writer import _table

    def counts(d: dict) -> str:
        return ", ".join(f"{k} x{v}" for k, v in d.items()) or "none"

    w, m = pl.get("weights") or {}, pl.get("macs") or {}
    rows = [["PIM primitives", counts(pl.get("pim", {}))], ["host primitives", counts(pl.get("host_primitives", {}))],
            ["host ATen (exported ops, run as exported)", counts(pl.get("host_aten", {}))]]
    if w:
        rows.append(["weights on PIM", f"{w.get('share', 0):.1%} of {w.get('matrix_params', 0):,} matrix elements"
                     + (f"; on the host: {', '.join(w['host_matrices'])}" if w.get("host_matrices") else "")])
    if m:
        rows.append(["MACs per token on PIM", f"{m.get('pim_share', 0):.2%} ({m.get('pim', 0):,} on PIM, {m.get('host', 0):,} on the host)"])
    return ["## Where it ran (`nhil.compiler.placement`)", ""] + _table(["part", "what"], rows) + [""]
