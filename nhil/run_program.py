"""``nhil run``: run a given ``.pimb`` (or a handoff bundle) on a target and check it against its golden.

The backend engineer's loop: no model, no compiler, no hub. Inputs are the golden's prompt ids
and tokens (teacher-forced, one step per position); the logits of every step are compared with
the golden's within the tolerance profile (``nhil.golden.tolerances``, the same checks as
``nhil verify``), the top-1 tokens exactly, and on a non-sim target every SYNC and readback bit
for bit with the simulator (lockstep). A bundle folder (``nhil compile --bundle``) carries the
program, its golden and ``BUNDLE.json``; its recorded sha256s are checked too, so an edited
program is a MISMATCH that says so. Outcomes and the report folder are verify's
(``docs/outcomes.md``): ``runs/<stamp>-run-<program>-<target>/report.{json,md}``, ``junit.xml``.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np

from nhil.errors import NhilError

PROFILE = "bf16-act-fp32-acc"


def resolve_inputs(path: Path, golden: Path | None) -> tuple[Path, Path, dict | None]:
    """(program file, golden file, BUNDLE.json or None) for a bundle folder or a ``.pimb`` + golden.

    Raises:
        nhil.args.UsageError: no such file, a folder without BUNDLE.json, or a ``.pimb`` without ``--golden``.
    """
    from nhil.args import UsageError

    path = Path(path)
    if path.is_dir():
        man_path = path / "BUNDLE.json"
        if not man_path.is_file():
            raise UsageError(f"{path} is a folder without BUNDLE.json: give a handoff bundle (`nhil compile --bundle`) or a .pimb file")
        try:
            manifest = json.loads(man_path.read_text())
        except ValueError as e:
            raise UsageError(f"{man_path} is not JSON ({e}); recreate the bundle with `nhil compile --bundle`") from None
        return path / "program.pimb", Path(golden) if golden else path / "golden.safetensors", manifest
    if not path.is_file():
        raise UsageError(f"no program {path}: give a .pimb file or a handoff bundle folder")
    if golden is None:
        raise UsageError(f"{path}: a bare program needs its golden: `nhil run {path} --golden GOLDEN.safetensors` (or run a bundle folder)")
    return path, Path(golden), None


def run_program(path, target: str = "sim", golden=None, runs_dir=Path("runs"), target_options: dict | None = None, lockstep: bool = True) -> dict:
    """Run ``path`` (a ``.pimb`` with ``golden``, or a bundle folder) on ``target``; returns the report (also written).

    Raises:
        nhil.args.UsageError: unknown target name, missing files (before any folder is made).
    """
    from nhil.args import check_name, new_run_dir
    from nhil.failure import keep_failure_context
    from nhil.targets.registry import available_targets

    check_name("target", target, available_targets())
    prog_path, gold_path, manifest = resolve_inputs(Path(path), golden)
    run_dir = new_run_dir(runs_dir, "run", Path(path).stem or "program", target)
    R: dict = {"outcome": "INCOMPLETE", "stage": "start", "kind": "run", "program_path": str(prog_path), "golden_path": str(gold_path),
               "model": (manifest or {}).get("model", Path(path).stem), "target": target, "run_dir": str(run_dir), "checks": [], "steps": [],
               "reproducer": f"nhil run {path} --target {target}" + (f" --golden {golden}" if golden else "")}
    state: dict = {}
    try:
        _run(R, prog_path, gold_path, manifest, target, target_options or {}, lockstep, state)
    except NhilError as e:
        R["outcome"], R["error"] = e.outcome, str(e)
        keep_failure_context(R, e, state.get("dut"))
    except Exception as e:  # noqa: BLE001 - CRASH with the traceback kept, as in verify
        R["outcome"], R["error"] = "CRASH", f"{type(e).__name__}: {e} (traceback in {run_dir / 'traceback.txt'})"
        (run_dir / "traceback.txt").write_text(traceback.format_exc())
        keep_failure_context(R, e, state.get("dut"))
    _write(run_dir, R)
    return R


def _write(run_dir: Path, R: dict) -> None:
    from nhil.report.junit import write_junit
    from nhil.report.writer import atomic_write_text, render_markdown, write_json

    write_json(run_dir / "report.json", R)
    atomic_write_text(run_dir / "report.md", render_markdown(R).replace("# nhil verify:", "# nhil run:", 1))
    write_junit(run_dir / "junit.xml", [R])


def _check(R: dict, name: str, passed: bool, detail: str) -> None:
    R["checks"].append({"name": name, "passed": bool(passed), "detail": detail})


def _run(R: dict, prog_path: Path, gold_path: Path, manifest: dict | None, target: str, topts: dict, lockstep: bool, state: dict) -> None:
    from nhil.golden import metrics
    from nhil.golden.store import load_golden
    from nhil.golden.tolerances import check, failing
    from nhil.isa import Program
    from nhil.runtime import Runner, run_teacher_forced
    from nhil.targets import get_target
    from nhil.targets.base import unclaimed
    from nhil.targets.lockstep import LockstepTarget
    from nhil.util import sha256_bytes

    R["stage"] = "load_program"
    program = Program.load(prog_path)
    R["program"] = {"bytes": prog_path.stat().st_size, "instructions": len(program.instrs), "device": program.device.name}
    if manifest is not None:
        bad = [n for n, e in (manifest.get("files") or {}).items()
               if not (prog_path.parent / n).is_file() or sha256_bytes((prog_path.parent / n).read_bytes()) != e.get("sha256")]
        _check(R, "bundle_files_intact", not bad, f"files differing from BUNDLE.json's sha256: {bad} (edited after the bundle was made)" if bad
               else f"{len(manifest.get('files') or {})} files match BUNDLE.json's sha256")
    R["stage"] = "golden"
    gt, gmeta = load_golden(gold_path)
    if "prompt_ids" not in gt or "tokens" not in gt or "logits" not in gt:
        from nhil.errors import GoldenError

        raise GoldenError(f"golden {gold_path} lacks prompt_ids / tokens / logits: it is not a verify golden")
    prompt = [int(t) for t in gt["prompt_ids"].tolist()]
    tokens = [int(t) for t in gt["tokens"].tolist()]
    R["prompt_ids"], R["golden_tokens"] = prompt, tokens
    R["stage"] = "open_target"
    opts = dict(topts)
    opts.setdefault("device", program.device if target == "sim" else program.device.name)
    dut = state["dut"] = get_target(target, **opts)
    missing = unclaimed(program, dut.capabilities())
    if missing:
        from nhil.errors import NotClaimed

        dut.close()
        raise NotClaimed(f"not claimed: target {target} does not implement {', '.join(missing)}; the run is skipped, not passed")
    if lockstep and target != "sim":
        dut = state["dut"] = LockstepTarget(dut)
    with dut:
        runner = Runner(program, dut)
        R["stage"] = "load_target"
        runner.reset()
        R["stage"] = "run_teacher_forced"
        tf = run_teacher_forced(runner, prompt, tokens)
        R["target_stats"] = dut.stats()
    R["stage"] = "compare"
    ref = gt["logits"].numpy()
    if tf.logits.shape != ref.shape:
        _check(R, "logits_shape", False, f"program logits {list(tf.logits.shape)} vs golden {list(ref.shape)}: the golden belongs to another program")
        R["outcome"] = "MISMATCH"
        return
    cmp = metrics.compare_logits(ref, tf.logits)
    fails = []
    for s in cmp["steps"]:
        v = failing(check(PROFILE, "logits", s))
        if v:
            fails.append(f"step {s['step']}: " + "; ".join(str(x) for x in v))
        R["steps"].append({**s, "passed": not v, "golden_token": tokens[s["step"]]})
    agree = sum(a == b for a, b in zip(tf.tokens, tokens))
    _check(R, "teacher_forced_top1", agree == len(tokens), f"target top-1 equals the golden token at {agree}/{len(tokens)} steps")
    _check(R, "logits_within_tolerance", not fails, "; ".join(fails) if fails else f"all {len(cmp['steps'])} steps within the {PROFILE} logits thresholds")
    if target != "sim" and lockstep:
        ls = R["target_stats"].get("lockstep", {})
        _check(R, "bit_identical_to_sim", ls.get("first_mismatch") is None,
               f"{ls.get('syncs_compared', 0)} SYNCs / {ls.get('readbacks_compared', 0)} readbacks compared bit for bit with the simulator")
    R["kl_mean"], R["kl_max"] = cmp["kl_mean"], cmp["kl_max"]
    R["target_tokens"] = [int(t) for t in np.asarray(tf.tokens).tolist()]
    R["outcome"] = "PASS" if all(c["passed"] for c in R["checks"]) else "MISMATCH"
