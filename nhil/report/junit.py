"""JUnit XML for verify reports and sweeps (one testcase per run, properties for seed, target, ...)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

FAIL_OUTCOMES = {"MISMATCH", "XPASS"}
ERROR_OUTCOMES = {"COMPILE_FAIL", "LOAD_FAIL", "LINK_FAIL", "RUN_FAIL", "TIMEOUT", "CRASH", "INCOMPLETE"}


def junit_xml(reports: list[dict], suite: str = "nhil") -> str:
    """JUnit XML text: a testcase per report named ``model/target/quant``; MISMATCH and XPASS
    are failures, stage failures (COMPILE_FAIL ...) are errors, SKIPPED is skipped. Properties:
    seed, target, model, quant, outcome, reproducer, stage timings, link/target counters."""
    ts = ET.Element("testsuite", name=suite, tests=str(len(reports)))
    n_fail = n_err = n_skip = 0
    total = 0.0
    for r in reports:
        t = sum(float(v) for v in (r.get("timings") or {}).values() if isinstance(v, (int, float)))
        total += t
        name = f"{r.get('model')}/{r.get('target')}/{r.get('quant', 'bf16')}"
        tc = ET.SubElement(ts, "testcase", classname=f"nhil.verify.{r.get('model')}", name=name, time=f"{t:.3f}")
        props = ET.SubElement(tc, "properties")
        flat = {
            "seed": r.get("seed"),
            "target": r.get("target"),
            "model": r.get("model"),
            "quant": r.get("quant", "bf16"),
            "outcome": r.get("outcome"),
            "expected": r.get("expected"),
            "reproducer": r.get("reproducer"),
        }
        for k, v in (r.get("timings") or {}).items():
            flat[f"time.{k}"] = v
        for k, v in _flatten(r.get("target_stats") or {}, "stats").items():
            flat[k] = v
        for k, v in flat.items():
            if v is not None:
                ET.SubElement(props, "property", name=str(k), value=str(v))
        outcome = r.get("outcome")
        msg = str(r.get("error") or "; ".join(c["name"] + ": " + c["detail"] for c in r.get("checks", []) if not c.get("passed")))
        if outcome in FAIL_OUTCOMES:
            n_fail += 1
            ET.SubElement(tc, "failure", message=f"{outcome}: {msg}"[:2000]).text = f"reproduce: {r.get('reproducer')}"
        elif outcome in ERROR_OUTCOMES:
            n_err += 1
            ET.SubElement(tc, "error", message=f"{outcome}: {msg}"[:2000]).text = f"reproduce: {r.get('reproducer')}"
        elif str(outcome).startswith("SKIPPED"):
            n_skip += 1
            ET.SubElement(tc, "skipped", message=str(r.get("error") or outcome))
    ts.set("failures", str(n_fail))
    ts.set("errors", str(n_err))
    ts.set("skipped", str(n_skip))
    ts.set("time", f"{total:.3f}")
    return ET.tostring(ts, encoding="unicode", xml_declaration=True)


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
    return out


def write_junit(path: Path, reports: list[dict], suite: str = "nhil") -> None:
    """Write :func:`junit_xml` atomically."""
    from nhil.util import atomic_write_text

    atomic_write_text(path, junit_xml(reports, suite))
