"""Expectations manifest: expected outcome per model x target x quant (``expectations.yaml``).

Format (YAML, loaded with ``yaml.safe_load``)::

    schema: 1
    expectations:
      - {model: llama, target: sim, quant: bf16, expect: PASS, reason: "main job"}
      - {model: llama, target: rtl, quant: bf16, expect: PASS, nightly: true, reason: "..."}
      - model: llama
        target: sim
        quant: bf16
        expect: PASS
        reason: "..."
        tolerance:                      # per-row threshold overrides (optional)
          logits.sqnr_db: {min: 20, reason: "why this row may be looser/stricter"}

``expect`` is an outcome (PASS, MISMATCH, COMPILE_FAIL, ...). A run whose expectation
is a failure but which passes is **XPASS** and counts as a failure (update the
manifest: ``nhil sweep --update-manifest``). Entries without an expectation are PASS by
default. ``nightly: true`` rows run only in ``make nightly``. ``owner`` (optional) names
who answers for the row in the bring-up checklist (``nhil checklist``).

``faults`` (optional, fpga rows) is a link fault spec for the board emulator
(``byte_flip=0.01,byte_drop=0.002,seed=1``; ``nhil/targets/fpga/faults.py``) and ``board``
(optional) names a board of the boards file (``nhil/boards.py``): such a row is its own
*variant* of model x target x quant (:func:`row_variant`), with its own expectation,
so the fault runs are rows like the rest (``make verify ... FPGA_FAULTS=...`` finds it).

``tolerance`` overrides single thresholds of the row's tolerance profile
(:mod:`nhil.golden.tolerances`): keys ``<kind>.<metric>`` (``logits.sqnr_db``,
``hidden.cosine``, ``run.top1_rate``, ...), each with the profile's bound (``min`` or
``max``), a required ``reason`` and optionally ``asserted``. ``nhil verify`` applies them
and the report shows each override beside the profile value it replaced; an override
without a reason or naming an unknown kind/metric is refused when the manifest is loaded
(:class:`~nhil.errors.SetupError` naming the entry and the fix). ``--update-manifest``
keeps overrides, reasons and the file's leading comment.
"""

from __future__ import annotations

import os
from pathlib import Path

from nhil.errors import SetupError

DEFAULT_PATH = Path(os.environ.get("NHIL_EXPECTATIONS", "expectations.yaml"))


def load(path: Path = DEFAULT_PATH) -> list[dict]:
    """Entries of the manifest ([] if the file does not exist).

    Raises:
        SetupError: not valid YAML, an entry without model/target, or an invalid
            ``tolerance`` override (no reason, unknown kind/metric, bad bound).
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
        if r.get("faults"):
            from nhil.targets.fpga.faults import FaultSpec

            if r["target"] != "fpga":
                raise SetupError(f"{path}: entry {i} ({r['model']}/{r['target']}): faults apply to the fpga target's link only; remove `faults` or set target: fpga")
            try:
                FaultSpec.parse(str(r["faults"]))
            except SetupError as e:
                raise SetupError(f"{path}: entry {i} ({r['model']}/{r['target']}): bad faults {r['faults']!r}: {e}") from None
        if "tolerance" in r:
            from nhil.golden.tolerances import validate_overrides

            try:
                validate_overrides(r["tolerance"], where=f"{path}: entry {i} ({r['model']}/{r['target']}/{r['quant']})")
            except ValueError as e:
                raise SetupError(str(e)) from None
    return rows


def row_variant(row: dict) -> str:
    """The variant of a manifest row or a report beyond model x target x quant: ``""`` for
    a plain row, else ``faults=<spec>`` and/or ``board=<name>`` joined by ``;``."""
    parts = []
    if row.get("faults"):
        parts.append(f"faults={row['faults']}")
    if row.get("board"):
        parts.append(f"board={row['board']}")
    return ";".join(parts)


def env_variant(target: str) -> str:
    """The variant a plain ``nhil verify`` run has from its environment (``FPGA_FAULTS``,
    ``FPGA_BOARD``; fpga target only), so ``make verify ... FPGA_FAULTS=...`` finds the fault row."""
    if target != "fpga":
        return ""
    return row_variant({"faults": os.environ.get("FPGA_FAULTS", ""), "board": os.environ.get("FPGA_BOARD", "")})


def lookup(model: str, target: str, quant: str = "bf16", path: Path = DEFAULT_PATH, variant: str | None = None) -> dict | None:
    """The manifest entry for this combination (and ``variant``, :func:`row_variant`; None:
    the one of the environment, :func:`env_variant`), or None."""
    want = env_variant(target) if variant is None else variant
    for r in load(path):
        if r["model"] == model and r["target"] == target and r["quant"] == quant and row_variant(r) == want:
            return r
    return None


def quant_of(report: dict) -> str:
    """The quant recipe of a report (``report['quant']`` is a string in sweep rows and a
    ``{"recipe": ...}`` dict in verify reports; absent means bf16)."""
    q = report.get("quant", "bf16")
    if isinstance(q, dict):
        q = q.get("recipe", "bf16")
    return str(q or "bf16")


def tolerance_overrides(model: str, target: str, quant: str = "bf16", path: Path = DEFAULT_PATH) -> dict:
    """The ``tolerance`` overrides of this combination's manifest entry ({} if none).

    Raises:
        SetupError: the manifest is invalid (see :func:`load`).
    """
    e = lookup(model, target, quant, path)
    return dict(e.get("tolerance") or {}) if e else {}


def apply_expectation(report: dict, path: Path = DEFAULT_PATH) -> None:
    """Set ``report['expected']``/``['as_expected']``; turn an unexpected PASS into XPASS."""
    try:
        e = lookup(report.get("model"), report.get("target"), quant_of(report), path, report.get("variant"))
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
    """Rewrite the manifest so each result's combination expects the outcome it just had (atomic).

    Every other field of an existing entry (reason, nightly, tokens, device, tolerance
    overrides) is kept, and so is the file's leading comment block.
    """
    import yaml

    from nhil.util import atomic_write_text

    rows = load(path)
    header = ""
    if Path(path).exists():
        lines = Path(path).read_text().splitlines(keepends=True)
        for line in lines:
            if not line.lstrip().startswith("#"):
                break
            header += line
    index = {(r["model"], r["target"], r["quant"], row_variant(r)): r for r in rows}
    for res in results:
        key = (res["model"], res["target"], quant_of(res), res.get("variant") or "")
        out = res["outcome"] if res["outcome"] != "XPASS" else "PASS"
        if key in index:
            index[key]["expect"] = out
        else:
            index[key] = {"model": key[0], "target": key[1], "quant": key[2], "expect": out, "reason": "recorded by --update-manifest"}
            index[key].update({k: res[k] for k in ("faults", "board") if res.get(k)})
            rows.append(index[key])
    atomic_write_text(path, header + yaml.safe_dump({"schema": 1, "expectations": rows}, sort_keys=False, width=1000))
