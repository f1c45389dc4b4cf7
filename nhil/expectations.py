"""Expectations manifest: expected outcome per model x target x quant (``expectations.yaml``).

Format (YAML, loaded with ``yaml.safe_load``)::

    schema: 1
    expectations:
      - {model: llama, target: sim, quant: bf16, expect: PASS, reason: "main job"}
      - {model: llama, target: rtl, quant: bf16, expect: PASS, nightly: true, reason: "..."}

``expect`` is an outcome (PASS, MISMATCH, COMPILE_FAIL, ...). A run whose expectation
is a failure but which passes is **XPASS** and counts as a failure (update the
manifest: ``nhil sweep --update-manifest``). Entries without an expectation are PASS by
default. ``nightly: true`` rows run only in ``make nightly``.
"""

from __future__ import annotations

import os
from pathlib import Path

from nhil.errors import SetupError

DEFAULT_PATH = Path(os.environ.get("NHIL_EXPECTATIONS", "expectations.yaml"))


def load(path: Path = DEFAULT_PATH) -> list[dict]:
    """Entries of the manifest ([] if the file does not exist).

    Raises:
        SetupError: not valid YAML, or an entry without model/target.
    """
    import yaml

    if not Path(path).exists():
        return []
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise SetupError(f"{path} is not valid YAML: {e}") from None
    rows = data.get("expectations") or []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "model" not in r or "target" not in r:
            raise SetupError(f"{path}: entry {i} needs at least model and target: {r!r}")
        r.setdefault("quant", "bf16")
        r.setdefault("expect", "PASS")
    return rows


def lookup(model: str, target: str, quant: str = "bf16", path: Path = DEFAULT_PATH) -> dict | None:
    """The manifest entry for this combination, or None."""
    for r in load(path):
        if r["model"] == model and r["target"] == target and r["quant"] == quant:
            return r
    return None


def apply_expectation(report: dict, path: Path = DEFAULT_PATH) -> None:
    """Set ``report['expected']``/``['as_expected']``; turn an unexpected PASS into XPASS."""
    try:
        e = lookup(report.get("model"), report.get("target"), report.get("quant", "bf16"), path)
    except SetupError as err:
        report["expectation_error"] = str(err)
        return
    expected = e["expect"] if e else "PASS"
    report["expected"] = expected
    if e and e.get("reason"):
        report["expected_reason"] = e["reason"]
    if report.get("outcome") == "PASS" and expected != "PASS":
        report["outcome"] = "XPASS"
        report["error"] = f"expected {expected} ({report.get('expected_reason', 'no reason given')}) but the run passed: update the manifest"
    report["as_expected"] = report.get("outcome") == expected


def update(results: list[dict], path: Path = DEFAULT_PATH) -> None:
    """Rewrite the manifest so each result's combination expects the outcome it just had (atomic)."""
    import yaml

    from nhil.util import atomic_write_text

    rows = load(path)
    index = {(r["model"], r["target"], r["quant"]): r for r in rows}
    for res in results:
        key = (res["model"], res["target"], res.get("quant", "bf16"))
        out = res["outcome"] if res["outcome"] != "XPASS" else "PASS"
        if key in index:
            index[key]["expect"] = out
        else:
            index[key] = {"model": key[0], "target": key[1], "quant": key[2], "expect": out, "reason": "recorded by --update-manifest"}
            rows.append(index[key])
    atomic_write_text(path, yaml.safe_dump({"schema": 1, "expectations": rows}, sort_keys=False))
