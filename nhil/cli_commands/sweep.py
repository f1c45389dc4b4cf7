"""``nhil sweep``, ``nhil checklist``, ``nhil evidence``: the manifest's matrix and the bring-up checklist."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from nhil.cli_commands.common import _checked, _fail
from nhil.errors import NhilError


def sweep_cmd(
    models_: Optional[str] = typer.Option(None, "--models", help="comma-separated; default: every manifest row"),
    targets_: Optional[str] = typer.Option(None, "--targets"),
    quants: Optional[str] = typer.Option(None, "--quants"),
    nightly: bool = typer.Option(False, help="include rows marked nightly"),
    seed: int = typer.Option(0, help="run seed (combined with each row's id)"),
    timeout: float = typer.Option(3600, help="seconds per row before it is TIMEOUT"),
    update_manifest: bool = typer.Option(False, "--update-manifest", help="record this sweep's outcomes as the new expectations"),
    row_ids: Optional[str] = typer.Option(None, "--rows", help="comma-separated row ids (model-target-quant[-variant], as in the checklist); with --nightly any row"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run the rows as Ray tasks: auto (start a local Ray instance, stop it at the end) or a cluster ADDRESS"),
    ray_cpus: Optional[int] = typer.Option(None, "--ray-cpus", help="with --ray auto: CPUs of the local instance (default: all)"),
) -> None:
    """Run models x targets x quants (rows of expectations.yaml, filtered); matrix + JUnit in runs/sweeps/<time>/."""
    try:
        from nhil import expectations
        from nhil.sweep import sweep

        from nhil.args import check_sweep_names

        _checked(check_sweep_names, models_, targets_, quants)
        rows = expectations.load()
        if not nightly:
            rows = [r for r in rows if not r.get("nightly")]
        for opt, key in ((models_, "model"), (targets_, "target"), (quants, "quant")):
            if opt:
                allowed = {x.strip() for x in opt.split(",")}
                rows = [r for r in rows if r[key] in allowed]
        if row_ids:
            from nhil.sweep import select_rows

            try:
                rows = select_rows(rows, row_ids)
            except ValueError as e:
                from nhil.errors import SetupError

                raise SetupError(f"--rows: {e}") from None
        if models_ and targets_:
            have = {(r["model"], r["target"], r["quant"]) for r in rows}
            for m in models_.split(","):
                for t in targets_.split(","):
                    for q in (quants or "bf16").split(","):
                        if (m.strip(), t.strip(), q.strip()) not in have:
                            rows.append({"model": m.strip(), "target": t.strip(), "quant": q.strip(), "expect": "PASS"})
        if ray:
            from nhil.cluster.ray_sweep import ray_sweep

            out, results = ray_sweep(rows, seed, timeout_s=timeout, address=ray, local_cpus=ray_cpus)
        else:
            out, results = sweep(rows, seed, timeout_s=timeout)
        typer.echo((out / "matrix.md").read_text())
        typer.echo(f"report: {out / 'report.html'}")
        if update_manifest:
            expectations.update(results)
            typer.echo("expectations.yaml updated")
        if any(not r.get("as_expected") for r in results) and not update_manifest:
            raise typer.Exit(1)
    except NhilError as e:
        _fail(e)


def checklist(output: Optional[Path] = typer.Option(None, "-o", help="write OUTPUT.md, OUTPUT.html and OUTPUT.json (default: Markdown to stdout)"),
              rows: bool = typer.Option(False, "--rows", help="the older per-row table of the latest sweep instead of the gates")) -> None:
    """Render the staged bring-up checklist: gates in order, each passed only by evidence from this commit."""
    try:
        from nhil import expectations

        if rows:
            from nhil.report.row_checklist import checklist_markdown, latest_results, latest_summary

            sys.stdout.write(checklist_markdown(expectations.load(), latest_results(), latest_summary()))
            return
        from nhil.report.checklist import build_checklist, render_markdown, write_checklist

        data = build_checklist(expectations.load())
        if output:
            for p in write_checklist(data, output):
                typer.echo(f"wrote {p}")
        else:
            sys.stdout.write(render_markdown(data))
    except NhilError as e:
        _fail(e)


def evidence(output: Path = typer.Option(Path("runs/evidence/tests.json"), "-o")) -> None:
    """Run the unit and single-program tests behind checklist gates 1-2 and record their outcomes with the commit."""
    from nhil.report.checklist import run_evidence

    ev = run_evidence(output)
    bad = [n for n, c in ev["cases"].items() if c["outcome"] not in ("passed",)]
    typer.echo(f"wrote {output}: {len(ev['cases'])} cases, {len(bad)} not passed, commit {ev['git_commit']}")
