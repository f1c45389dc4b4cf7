"""Landscape summary: totals per bucket, blockers ranked by how many architectures each unlocks, tables.

A *blocker* is one unraised pattern named without the family: the module class with the
family prefix of the architecture's causal-LM class removed (``BloomAttention`` in
``bloom`` -> ``Attention``; ``Conv1D`` stays) and the first ATen op that did not match, e.g.
``Attention: aten.view.default``. An architecture is *unlocked* by a blocker when that is
its only blocker, so the ranking (unlocks, then appearances) says which capability
brings the most architectures to PASS next.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

__all__ = ["summarize", "write_report", "blocker_keys", "BUCKETS"]

BUCKETS = ("PASS", "MISMATCH", "COMPILE_FAIL", "EXPORT_FAIL", "LOAD_FAIL", "CONFIG", "TIMEOUT", "RUN_FAIL", "CRASH")
_PREFIX = re.compile(r"^(.*?)(?:For[A-Z]\w*|LMHeadModel|WithLMHead|Decoder|Model)$")


def _family_prefix(cls: str) -> str:
    m = _PREFIX.match(cls or "")
    return m.group(1) if m else ""


def _role(module_cls: str, arch_cls: str, module_path: str) -> str:
    pre = _family_prefix(arch_cls)
    if module_cls and pre and module_cls.startswith(pre) and len(module_cls) > len(pre) and module_cls[len(pre)].isupper():
        return module_cls[len(pre):]
    if module_cls:
        return module_cls
    return re.sub(r"\.\d+", ".N", module_path) or "(top level)"


def short_source(src: str) -> str:
    """``.../site-packages/transformers/models/x/modeling_x.py:12`` -> ``transformers/models/x/modeling_x.py:12``."""
    i = src.find("transformers/")
    return src[i:] if i >= 0 else src


def _key(u: dict, row: dict) -> str:
    return f"{_role(u.get('class', ''), row.get('class', ''), u.get('module', ''))}: {u.get('op', '?')}"


def blocker_keys(row: dict) -> list[str]:
    """Distinct blockers of a COMPILE_FAIL row in first-seen order (see the module docstring)."""
    keys: list[str] = []
    for u in row.get("unraised") or []:
        k = _key(u, row)
        if k not in keys:
            keys.append(k)
    if not keys and row.get("bucket") == "COMPILE_FAIL" and row.get("error", "").startswith("weights not on PIM"):
        keys.append("weights not on PIM")
    return keys


def summarize(rows: list[dict], wall_s: float = 0.0, subset=None, note: str | None = None) -> dict:
    """Totals, ranked blockers and the rows (JSON-ready); ``note`` is printed under the header."""
    totals = Counter(r["bucket"] for r in rows)
    appears: Counter = Counter()
    unlocks: Counter = Counter()
    example: dict[str, dict] = {}
    for r in rows:
        ks = blocker_keys(r) if r["bucket"] == "COMPILE_FAIL" else []
        r["blockers"] = ks
        for k in ks:
            appears[k] += 1
            if k not in example:
                u = next((u for u in r.get("unraised") or [] if _key(u, r) == k), {})
                example[k] = {"arch": r["arch"], "module": u.get("module", ""), "source": short_source(u.get("source", "")), "reason": u.get("reason", "")[:160]}
        if len(ks) == 1:
            unlocks[ks[0]] += 1
    ranked = sorted(appears, key=lambda k: (-unlocks[k], -appears[k], k))
    blockers = [{"blocker": k, "unlocks": unlocks[k], "appears_in": appears[k],
                 "archs": sorted(r["arch"] for r in rows if k in r.get("blockers", [])), **example[k]} for k in ranked]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import transformers
    import torch

    return {
        "measured": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit, "transformers": transformers.__version__, "torch": torch.__version__,
        "subset": list(subset) if subset else None, "wall_s": round(wall_s, 1), "note": note,
        "totals": {b: totals.get(b, 0) for b in BUCKETS if totals.get(b, 0) or b in ("PASS", "CRASH")} | {"rows": len(rows)},
        "blockers": blockers, "rows": rows,
    }


def _cause(r: dict) -> str:
    if r["bucket"] == "PASS":
        return f"top-1 {r.get('top1', '?')}, worst layer SQNR {r.get('worst_layer_sqnr_db', '?')} dB"
    u = (r.get("unraised") or [None])[0]
    if u:
        more = f" (+{len(r['blockers']) - 1} more blockers)" if len(r.get("blockers", [])) > 1 else ""
        return f"`{u['op']}` in `{u['module']}` ({u.get('class') or '?'}) at `{short_source(u['source'])}`: {u['reason'][:100]}{more}"
    return (r.get("error") or "").replace("\n", " ").replace("|", "\\|")[:220]


def render_markdown(s: dict) -> str:
    """The ``docs/landscape.md`` text of a summary."""
    lines = ["# Landscape: every causal-LM architecture of the installed transformers on the nhil stack", ""]
    scope = f"a subset of {len(s['rows'])} architectures (`--only`)" if s.get("subset") else f"all {len(s['rows'])} causal-LM architectures"
    lines += [f"Measured {s['measured']} at commit `{s['commit']}` (transformers {s['transformers']}, torch {s['torch']}) by "
              f"`nhil landscape` over {scope}, {s['wall_s'] / 60:.1f} min wall. Each row: the architecture's config class "
              "with every size field shrunk to the tiny shape (hidden 64, 2 layers, vocab 256; `nhil/landscape/tiny_config.py`), "
              "seeded weights, `nhil verify --model <config.json> --target sim --tokens 8` in its own process. "
              "PASS = raised bit-exactly, simulator within the bf16 profile, and every weight matrix on PIM (column PIM). "
              "Buckets and blockers: `nhil/landscape/row.py`, `nhil/landscape/report.py`.", ""]
    if s.get("note"):
        lines += [s["note"], ""]
    lines += ["## Totals", "", "| " + " | ".join(s["totals"]) + " |", "|" + "---|" * len(s["totals"]),
              "| " + " | ".join(str(v) for v in s["totals"].values()) + " |", ""]
    lines += ["## Blockers, ranked by the architectures each would unlock", "",
              "unlocks = architectures for which it is the only blocker; appears in = architectures that hit it.", "",
              "| blocker | unlocks | appears in | example (module, source) | architectures |", "|---|---|---|---|---|"]
    for b in s["blockers"][:40]:
        lines.append(f"| {b['blocker']} | {b['unlocks']} | {b['appears_in']} | {b['arch']}: `{b['module']}` at `{b['source']}` | {', '.join(b['archs'][:12])}{' ...' if len(b['archs']) > 12 else ''} |")
    lines += ["", "## Rows", "", "| architecture | class | bucket | PIM | cause | s |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        pim = f"{100 * r['pim']['share']:.0f}%" if r.get("pim") else "-"
        lines.append(f"| {r['arch']} | {r.get('class', '')} | {r['bucket']} | {pim} | {_cause(r)} | {r.get('seconds', '')} |")
    return "\n".join(lines) + "\n"


def write_report(summary: dict, output: Path) -> None:
    """Write ``<output>.md`` and ``<output>.json`` (each a temp file, then rename)."""
    from nhil.util import atomic_write_text

    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    atomic_write_text(output.with_suffix(".md"), render_markdown(summary))
