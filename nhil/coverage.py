"""Per-architecture coverage: what exports, raises, lowers and verifies, measured now.

``coverage_table()`` runs, for every registered tiny model (the zoo plus ``llama-tiny``):

1. ``torch.export`` of the prefill graph (prompt of 9 tokens) and of the static-KV-cache
   decode step (``max_cache_len`` 16);
2. raising of both in non-strict mode (``raise_graph(strict=False)``; when nothing is left
   unraised the bit-exactness check runs too) -> the ``nhil::*`` primitives and the ATen
   ops left unraised (root causes, not their downstream "input not raised" entries);
3. lowering of the decode graph to a PIM program (``nhil.compiler.pipeline.lower``: the default pipeline);
4. ``verify`` on the ``sim`` target (8 tokens, fp32 eager golden, teacher-forced +
   free-running greedy), recording outcome, top-1 agreement and worst SQNR.

rtl / fpga columns are "not run" unless asked for (``targets=``, ``--targets sim,rtl,fpga``);
a target whose ``capabilities()`` lack something the program needs shows "not claimed (...)":
the coverage table never reports a target as passing that was not run or not claimed.
``quants=`` (``--quant q8_0,mxfp4``) verifies the rtl / fpga columns once more per quant recipe,
for the models of ``quant_models=`` (``--quant-models``, default: the MoE families
``MOE_MODELS``, whose expert sub-programs then run quantized); each such run is added to the
cell as ``<recipe>: <outcome>``.

``python -m nhil.coverage --write docs/architectures.md`` regenerates the docs table.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_MODELS = ("llama-tiny", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3",
                  "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "mamba2", "lfm2", "olmo_hybrid")
MOE_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


@dataclasses.dataclass
class CoverageRow:
    """One architecture's status. Strings are ``ok`` / ``FAIL: ...`` / ``not run`` / ``-``."""

    model: str
    export_prefill: str = "not run"
    export_decode: str = "not run"
    raise_prefill: str = "not run"
    raise_decode: str = "not run"
    primitives: dict = dataclasses.field(default_factory=dict)
    unraised: list = dataclasses.field(default_factory=list)
    lower: str = "not run"
    sim: str = "not run"
    sim_detail: str = ""
    rtl: str = "not run"
    fpga: str = "not run"
    quant_runs: dict = dataclasses.field(default_factory=dict)  # target -> {recipe: outcome} (rtl/fpga, ``quants=``)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _short(e: BaseException, n: int = 160) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def _unraised_ops(raised) -> list[str]:
    ops = []
    for u in raised.unraised:
        if "not raised" in u.reason:
            continue
        name = u.op.removeprefix("aten.")
        entry = f"{name} ({u.module_path.split('.')[-1] or 'model'})"
        if entry not in ops:
            ops.append(entry)
    return ops


def _raise_status(ep, kind: str, row: CoverageRow) -> tuple[str, object]:
    from nhil.compiler import raise_graph

    try:
        raised = raise_graph(ep, kind, strict=False, check=False)
    except Exception as e:  # noqa: BLE001 - recorded in the table
        return f"FAIL: {_short(e)}", None
    if raised.unraised:
        return f"partial ({len(_unraised_ops(raised))} ops unraised)", raised
    try:
        raise_graph(ep, kind)  # strict + bit-exactness check
    except Exception as e:  # noqa: BLE001
        return f"FAIL: {_short(e)}", raised
    return "ok (bit-exact)", raised


def _verify_cell(row: CoverageRow, name: str, target: str, quant: str, tokens: int, wd: Path) -> str:
    """``verify`` of ``name`` on ``target`` with the ``quant`` recipe -> the cell text (sim: also ``row.sim_detail``)."""
    from nhil.verify import VerifyOptions, verify

    rep = verify(VerifyOptions(model=name, target=target, tokens=tokens, quant=quant, goldens_dir=wd / "goldens", runs_dir=wd / "runs"))
    steps = rep.get("steps") or []
    out = rep["outcome"]
    if out == "SKIPPED":  # the target's capabilities() do not claim something the program needs
        out = "not claimed (" + (rep.get("error") or "").split("does not implement ", 1)[-1].split(" (")[0] + ")"
    elif target != "sim":
        checks = rep.get("checks") or []
        same = any(c["name"].startswith("bit_identical") and c["passed"] for c in checks)
        why = [rep.get("error") or ", ".join(c["name"] for c in checks if not c["passed"])] if out != "PASS" else []
        out += f" ({'; '.join([w[:100] for w in why if w] + (['bit-identical to sim'] if same else []))})" if why or same else ""
    if target == "sim" and quant == "bf16":
        top1 = sum(bool(s.get("top1_agree")) for s in steps)
        sq = min((s["sqnr_db"] for s in steps if s.get("sqnr_db") is not None), default=float("nan"))
        row.sim_detail = f"top-1 {top1}/{len(steps)}, worst SQNR {sq:.1f} dB" if steps else (rep.get("error") or "")[:160]
    return out


def coverage_row(name: str, targets: tuple[str, ...] = ("sim",), tokens: int = 8, workdir: Path | None = None,
                 quants: tuple[str, ...] = (), quant_models: tuple[str, ...] = MOE_MODELS) -> CoverageRow:
    """Measure one registered model (see the module docstring)."""
    import torch

    from nhil.compiler import export_decode, export_prefill, pipeline
    from nhil.isa import DEVICE_PRESETS
    from nhil.models import get_model

    row = CoverageRow(name)
    t0 = time.perf_counter()
    model = get_model(name).model
    try:
        ep = export_prefill(model, torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)))
        row.export_prefill = "ok"
        row.raise_prefill, _ = _raise_status(ep, "prefill", row)
    except Exception as e:  # noqa: BLE001
        row.export_prefill = f"FAIL: {_short(e)}"
        row.raise_prefill = "-"
    raised = None
    try:
        ep, _ = export_decode(model, 16)
        row.export_decode = "ok"
        row.raise_decode, raised = _raise_status(ep, "decode", row)
    except Exception as e:  # noqa: BLE001
        row.export_decode = f"FAIL: {_short(e)}"
        row.raise_decode = "-"
    if raised is not None:
        row.primitives = dict(raised.counts)
        row.unraised = _unraised_ops(raised)
    if raised is not None and raised.gm is not None and not raised.unraised:
        try:
            pipeline.lower(raised, DEVICE_PRESETS["aim-like"], model_name=name)  # the default pipeline's lowering + passes
            row.lower = "ok"
        except Exception as e:  # noqa: BLE001
            row.lower = f"FAIL: {_short(e)}"
    else:
        row.lower = "-" if raised is None else "no (ops unraised)"
    wd = Path(workdir or tempfile.mkdtemp(prefix="nhil-coverage-"))
    for target in targets:
        if row.lower != "ok":
            setattr(row, target, "-")
            continue
        setattr(row, target, _verify_cell(row, name, target, "bf16", tokens, wd))
        if target != "sim" and name in quant_models:
            for q in quants:
                row.quant_runs.setdefault(target, {})[q] = _verify_cell(row, name, target, q, tokens, wd)
    row.seconds = round(time.perf_counter() - t0, 1)
    return row


def coverage_table(models: tuple[str, ...] = DEFAULT_MODELS, targets: tuple[str, ...] = ("sim",), tokens: int = 8,
                   quants: tuple[str, ...] = (), quant_models: tuple[str, ...] = MOE_MODELS) -> list[dict]:
    """Rows (dicts, see :class:`CoverageRow`) for ``models``, measured now (``quants``: see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="nhil-coverage-") as wd:
        return [coverage_row(m, targets, tokens, Path(wd), quants, quant_models).as_dict() for m in models]


def target_cell(r: dict, target: str) -> str:
    """The rtl / fpga cell of row ``r``: the bf16 outcome, then ``<recipe>: <outcome>`` per quantized run."""
    extra = (r.get("quant_runs") or {}).get(target) or {}
    return "; ".join([r[target] if not extra else f"bf16: {r[target]}"] + [f"{q}: {v}" for q, v in extra.items()])


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def render_markdown(rows: list[dict], stamp: str | None = None, commit: str | None = None) -> str:
    """The table of ``docs/architectures.md``."""
    stamp = stamp or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = commit or _commit()
    out = [
        "| model | export prefill / decode | raise prefill / decode | nhil primitives (decode) | ATen ops left unraised | lowers | sim | rtl | fpga |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prims = ", ".join(f"{k.removeprefix('nhil::')}×{v}" for k, v in r["primitives"].items()) or "-"
        unr = ", ".join(r["unraised"]) or "none"
        sim = r["sim"] + (f" ({r['sim_detail']})" if r["sim_detail"] else "")
        out.append(f"| {r['model']} | {r['export_prefill']} / {r['export_decode']} | {r['raise_prefill']} / {r['raise_decode']} | {prims} | {unr} | {r['lower']} | {sim} | {target_cell(r, 'rtl')} | {target_cell(r, 'fpga')} |")
    ran = [t for t in ("sim", "rtl", "fpga") if any(r[t] != "not run" for r in rows)]
    qs = list(dict.fromkeys(q for r in rows for runs in (r.get("quant_runs") or {}).values() for q in runs))
    qarg = f" --quant {','.join(qs)}" if qs else ""
    return (f"Measured {stamp} at commit `{commit}` by `nhil models --coverage --targets {','.join(ran) or 'sim'}{qarg}` "
            "(tiny seeded configs, 8 decoded tokens).\n\n" + "\n".join(out) + "\n")


def format_rows(rows: list[dict]) -> str:
    """Plain-text table for the terminal."""
    lines = [f"{'model':12s} {'export p/d':10s} {'raise decode':34s} {'lower':18s} sim"]
    for r in rows:
        ex = f"{'ok' if r['export_prefill'] == 'ok' else 'FAIL'}/{'ok' if r['export_decode'] == 'ok' else 'FAIL'}"
        lines.append(f"{r['model']:12s} {ex:10s} {r['raise_decode'][:34]:34s} {r['lower'][:18]:18s} {r['sim']} {r['sim_detail']}")
        for t in ("rtl", "fpga"):
            if r[t] != "not run":
                lines.append(f"{'':12s} {t}: {target_cell(r, t)}")
        if r["unraised"]:
            lines.append(f"{'':12s} unraised: {', '.join(r['unraised'])[:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--targets", default="sim", help="comma-separated targets to verify on (sim,rtl,fpga); others stay 'not run'")
    ap.add_argument("--quant", default="", help="comma-separated quant recipes to verify the rtl/fpga columns with as well")
    ap.add_argument("--quant-models", default=",".join(MOE_MODELS), help="models the --quant runs are for (default: the MoE families)")
    ap.add_argument("--write", type=Path, help="rewrite the generated table in this markdown file (docs/architectures.md)")
    a = ap.parse_args(argv)
    split = lambda v: tuple(x for x in v.split(",") if x)  # noqa: E731
    rows = coverage_table(split(a.models), split(a.targets), quants=split(a.quant), quant_models=split(a.quant_models))
    print(format_rows(rows))
    if a.write:
        write_doc(a.write, rows)


BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


def write_doc(path: Path, rows: list[dict]) -> None:
    """Replace the text between the coverage markers of ``path`` with a fresh table."""
    text = path.read_text() if path.exists() else f"# Architectures\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + render_markdown(rows) + END + tail)


if __name__ == "__main__":
    main()
