"""``nhil verify``: compile a model, run it on a target, check it against the golden.

Stages (each timed; the report is rewritten after every stage so a crash or a hang
still leaves one): load model -> golden (reuse or generate) -> export -> raise ->
lower -> encode/decode ``.pimb`` -> load on target -> teacher-forced run -> free-running
greedy run -> compare -> report. The outcome is one of ``docs/outcomes.md``:
COMPILE_FAIL, LOAD_FAIL, LINK_FAIL, RUN_FAIL, CRASH, MISMATCH, PASS.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from nhil.errors import NhilError

PROFILE = "bf16-act-fp32-acc"
SAVE_PROGRAM_MAX_BYTES = int(os.environ.get("NHIL_SAVE_PROGRAM_MAX_BYTES", 64 << 20))  # bigger programs: `nhil compile -o`


@dataclasses.dataclass
class VerifyOptions:
    """Options of one verify run (the Makefile variables in brackets).

    Attributes:
        model: registry name [MODEL].
        target: target name [TARGET].
        prompt: prompt text (or comma-separated ids for tokenizer-less models) [PROMPT].
        tokens: tokens to decode [TOKENS].
        seed: run seed [SEED].
        device: DeviceConfig preset to compile for; default: the target's own device [DEVICE].
        regen: regenerate the golden even if a matching one exists [REGEN].
        goldens_dir / runs_dir: where goldens and run folders live.
        target_options: extra keyword options for the target factory.
        lockstep: for non-sim targets, also run the simulator and compare at every SYNC.
        save_program: write ``program.pimb`` into the run folder (programs up to 64 MiB).
        repeat: run the teacher-forced pass this many times and check the logits are
            bit-identical across repeats (determinism, separate from accuracy) [REPEAT].
        stage_timeout_scale: multiplies every stage's timeout (``STAGE_TIMEOUTS``).
        manifest: expectations manifest (default ``nhil.expectations.DEFAULT_PATH``): the
            expected outcome and the row's tolerance overrides come from it.
    """

    model: str = "llama"
    target: str = "sim"
    prompt: str | None = None
    tokens: int = 16
    seed: int = 0
    device: str | None = None
    regen: bool = False
    goldens_dir: Path = Path("goldens")
    runs_dir: Path = Path("runs")
    target_options: dict = dataclasses.field(default_factory=dict)
    lockstep: bool = True
    save_program: bool = True
    repeat: int = 1
    quant: str = "bf16"  # weight quantization recipe [QUANT] (nhil.compiler.quantize), e.g. native, mxfp4, int4-g128:lm_head=bf16
    stage_timeout_scale: float = float(os.environ.get("NHIL_STAGE_TIMEOUT_SCALE", "1"))
    manifest: Path | None = None
    layers: int | None = None  # --model PATH only: keep the first N decoder layers [LAYERS]

    def reproducer(self) -> str:
        parts = [f"make verify MODEL={self.model} TARGET={self.target} TOKENS={self.tokens} SEED={self.seed}"]
        if self.prompt is not None:
            parts.append(f"PROMPT={shlex.quote(self.prompt)}")
        if self.device:
            parts.append(f"DEVICE={self.device}")
        if self.quant != "bf16":
            parts.append(f"QUANT={shlex.quote(self.quant)}")
        if self.layers is not None:
            parts.append(f"LAYERS={self.layers}")
        for env in ("FPGA_PORT", "FPGA_BAUD", "FPGA_FAULTS", "WAVES"):
            if os.environ.get(env):
                parts.append(f"{env}={shlex.quote(os.environ[env])}")
        return " ".join(parts)


# seconds per stage on a 2-core machine (SmolLM2 needs ~25 s to load, ~15 s to export,
# ~16 s per 20-token run on the simulator); generous so only a hang trips them
STAGE_TIMEOUTS = {
    "load_model": 600,
    "golden": 900,
    "export": 900,
    "raise": 600,
    "lower": 600,
    "encode": 600,
    "load_target": 1800,
    "run_teacher_forced": 7200,
    "run_free": 7200,
    "repeat": 7200,
    "compare": 300,
}


class StageTimeout(NhilError):
    """A stage ran longer than its timeout (``STAGE_TIMEOUTS``)."""

    outcome = "TIMEOUT"


def _log(msg: str) -> None:
    print(f"[nhil] {msg}", file=sys.stderr, flush=True)


def _arm_timeout(stage: str, seconds: float):
    """Raise StageTimeout in the main thread after ``seconds`` (SIGALRM; no-op off the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return None

    def on_alarm(signum, frame):
        raise StageTimeout(f"stage {stage} exceeded its timeout of {seconds:.0f} s (NHIL_STAGE_TIMEOUT_SCALE scales it)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    # repeat every 0.5 s: a signal handler's exception can be swallowed when it lands inside a
    # callback (e.g. a gc callback); the next tick raises again until the stage is interrupted
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001), 0.5)
    return old


def _disarm(old) -> None:
    import signal

    if old is None:
        return
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


class _Run:
    def __init__(self, opts: VerifyOptions) -> None:
        self.o = opts
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        qtag = "" if opts.quant == "bf16" else "-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in opts.quant)
        from nhil.models.from_path import model_label

        self.dir = Path(opts.runs_dir) / f"{stamp}-{model_label(opts.model)}-{opts.target}{qtag}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.report: dict = {
            "outcome": "INCOMPLETE",
            "stage": "start",
            "model": opts.model,
            "target": opts.target,
            "tokens": opts.tokens,
            "seed": opts.seed,
            "reproducer": opts.reproducer(),
            "run_dir": str(self.dir),
            "checks": [],
            "steps": [],
            "layers": [],
            "timings": {},
            "first_divergent_layer": None,
        }
        if opts.quant != "bf16":
            self.report["quant"] = {"recipe": opts.quant}
        self.write()

    def write(self) -> None:
        from nhil.report.writer import atomic_write_text, render_markdown, write_json

        write_json(self.dir / "report.json", self.report)
        if self.report["outcome"] != "INCOMPLETE":
            atomic_write_text(self.dir / "report.md", render_markdown(self.report))
            try:
                from nhil.report.html import write_verify_html

                write_verify_html(self.dir / "report.html", json.loads((self.dir / "report.json").read_text()), self.dir)
            except Exception as e:  # noqa: BLE001 - the HTML view must not change the outcome (report.json/.md are written)
                _log(f"report.html skipped: {type(e).__name__}: {e}")

    def stage(self, name: str):
        run = self

        class _S:
            def __enter__(s):
                run.report["stage"] = name
                run.write()
                _log(f"{name} ...")
                s.t0 = time.perf_counter()
                s.alarm = _arm_timeout(name, STAGE_TIMEOUTS.get(name, 3600) * run.o.stage_timeout_scale)
                return s

            def __exit__(s, *exc):
                _disarm(s.alarm)
                dt = time.perf_counter() - s.t0
                run.report["timings"][name] = round(dt, 3)
                if exc[0] is None:
                    _log(f"{name}: {dt:.1f} s")
                return False

        return _S()

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.report["checks"].append({"name": name, "passed": bool(passed), "detail": detail})


def verify(opts: VerifyOptions) -> dict:
    """Run the whole pipeline once; returns the report dict (also written to the run folder).

    Never raises for user-facing failures: they become the report's outcome with a
    message; an unexpected exception becomes CRASH with its traceback saved to
    ``<run>/traceback.txt``.
    """
    run = _Run(opts)
    try:
        _verify(run)
    except NhilError as e:
        run.report["outcome"] = e.outcome
        run.report["error"] = str(e)
        if getattr(e, "detail", None):
            run.report["cross_target_first_mismatch"] = e.detail
    except Exception as e:  # noqa: BLE001 - turned into a CRASH outcome with the traceback kept
        run.report["outcome"] = "CRASH"
        run.report["error"] = f"{type(e).__name__}: {e} (traceback in {run.dir / 'traceback.txt'})"
        (run.dir / "traceback.txt").write_text(traceback.format_exc())
    _finish(run)
    return run.report


def _finish(run: "_Run") -> None:
    """Expectation, plots and JUnit, then the final report write (each best-effort, never masking the outcome)."""
    from nhil.expectations import DEFAULT_PATH, apply_expectation
    from nhil.report.junit import write_junit

    apply_expectation(run.report, run.o.manifest or DEFAULT_PATH)
    try:
        from nhil.report.plots import plot_report

        run.report["plots"] = plot_report(run.report, run.dir)
    except Exception as e:  # noqa: BLE001 - a plotting problem must not change the outcome
        run.report["plots"] = []
        _log(f"plots skipped: {type(e).__name__}: {e}")
    run.write()
    write_junit(run.dir / "junit.xml", [run.report])


def _top_differences(ref: np.ndarray, got: np.ndarray, k: int = 5) -> list[dict]:
    """The ``k`` largest |ref - got| elements of a [positions, hidden] activation (position, channel, values)."""
    diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    flat = np.argsort(diff, axis=None)[::-1][:k]
    out = []
    for i in flat:
        p, c = np.unravel_index(i, diff.shape)
        out.append({"position": int(p), "channel": int(c), "golden": float(ref[p, c]), "target": float(got[p, c]), "abs_diff": float(diff[p, c])})
    return out


def _token_divergence(step: int, ref_logits: np.ndarray, test_logits: np.ndarray, ref_tok: int, test_tok: int, k: int = 5) -> dict:
    """At the first free-running token that differs (same prefix on both sides): is each side's
    token in the other's top-k, and the two logit gaps (a near-tie vs a real error)."""
    ref_top = [int(t) for t in np.argsort(ref_logits)[::-1][:k]]
    test_top = [int(t) for t in np.argsort(test_logits)[::-1][:k]]
    return {
        "step": step,
        "golden_token": ref_tok,
        "target_token": test_tok,
        f"target_token_in_golden_top{k}": test_tok in ref_top,
        f"golden_token_in_target_top{k}": ref_tok in test_top,
        "golden_logit_gap": float(ref_logits[ref_tok] - ref_logits[test_tok]),
        "target_logit_gap": float(test_logits[test_tok] - test_logits[ref_tok]),
    }


def _effective_thresholds(profile: str, overrides: dict, report: dict) -> dict:
    """The profile's threshold table with the manifest row's overrides applied; records the
    overrides in ``report["tolerance_overrides"]`` (metric, bound, value, reason, and the
    profile value/reason they replaced).

    Raises:
        SetupError: an override this profile refuses (unknown metric, wrong bound, no reason).
    """
    from nhil.errors import SetupError
    from nhil.golden.tolerances import apply_overrides

    try:
        table = apply_overrides(profile, overrides)
    except ValueError as e:
        raise SetupError(f"expectations manifest: {e}") from None
    rows = []
    for kind, metrics_ in table.items():
        if not isinstance(metrics_, dict):
            continue
        for metric, th in metrics_.items():
            ov = th.get("override") if isinstance(th, dict) else None
            if ov:
                b = ov["profile_bound"]
                rows.append({"metric": f"{kind}.{metric}", "bound": b, "value": th[b], "asserted": th["asserted"], "reason": th["reason"],
                             "profile": profile, "profile_value": ov["profile_value"], "profile_asserted": ov["profile_asserted"], "profile_reason": ov["profile_reason"]})
    if rows:
        report["tolerance_overrides"] = rows
        _log("tolerance overrides from the manifest: " + "; ".join(f"{r['metric']} {r['bound']} {r['value']:g} (profile {r['profile_value']:g}): {r['reason']}" for r in rows))
    return table


def _verify(run: _Run) -> None:
    import torch

    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.golden import metrics
    from nhil.golden.generate import generate_golden
    from nhil.golden.store import golden_key, golden_path, load_golden, write_golden
    from nhil.golden.tolerances import check, failing
    from nhil.isa import DEVICE_PRESETS, Program
    from nhil.models import get_model
    from nhil.runtime import Runner, run_greedy, run_teacher_forced
    from nhil.targets import get_target
    from nhil.targets.lockstep import LockstepTarget

    o = run.o
    R = run.report
    torch.manual_seed(o.seed)
    from nhil import expectations

    overrides = expectations.tolerance_overrides(o.model, o.target, o.quant, o.manifest or expectations.DEFAULT_PATH)
    with run.stage("load_model"):
        bundle = get_model(o.model, layers=o.layers)
        prompt_ids = bundle.encode(o.prompt)
    R["prompt"] = o.prompt if o.prompt is not None else (bundle.default_prompt or ",".join(map(str, prompt_ids)))
    R["prompt_ids"] = prompt_ids
    R["weights_id"] = bundle.weights_id

    with run.stage("golden"):
        key = golden_key(prompt_ids, o.tokens, bundle.weights_id, seed=o.seed)
        gpath = golden_path(o.goldens_dir, bundle.name, key)
        expect = {"model": bundle.name, "weights_id": bundle.weights_id, "prompt_ids": json.dumps(prompt_ids), "n_tokens": str(o.tokens)}
        if gpath.exists() and not o.regen:
            gt, gmeta = load_golden(gpath, expect=expect)
            R["golden"] = {"path": str(gpath), "reused": True}
        else:
            gt, gmeta = generate_golden(bundle, prompt_ids, o.tokens, seed=o.seed, prompt_text=R["prompt"])
            sha = write_golden(gpath, gt, gmeta)
            R["golden"] = {"path": str(gpath), "reused": False, "sha256": sha}
    golden_tokens = [int(t) for t in gt["tokens"].tolist()]
    R["golden_tokens"] = golden_tokens
    R["golden_text"] = bundle.decode(golden_tokens)

    if o.device and o.device not in DEVICE_PRESETS:
        from nhil.errors import SetupError

        raise SetupError(f"unknown DEVICE {o.device!r}; presets: {', '.join(DEVICE_PRESETS)}")
    topts = dict(o.target_options)
    if o.device:
        topts.setdefault("device", o.device)
    elif o.target == "sim":
        topts.setdefault("device", "aim-like")
    target = get_target(o.target, **topts)
    device = target.capabilities().device  # compile for the device behind the target
    max_len = int(math.ceil((len(prompt_ids) + o.tokens) / 16) * 16)
    R["device"] = dataclasses.asdict(device)
    R["max_cache_len"] = max_len

    with run.stage("export"):
        ep, example = export_decode(bundle.model, max_len)
        R["export_nodes"] = len(ep.graph.nodes)
    with run.stage("raise"):
        raised = raise_graph(ep, "decode")
        R["raised_primitives"] = dict(raised.counts)
    profile = PROFILE
    plan = None
    if o.quant != "bf16":
        from nhil.compiler.quantize import build_plan, tolerance_profile

        with run.stage("quantize"):
            src = str(bundle.source)
            plan = build_plan(o.quant, raised.gm, gguf_path=src if src.endswith(".gguf") else None, model=bundle.model)
            profile = tolerance_profile(o.quant, o.model)
    thresholds = _effective_thresholds(profile, overrides, R)
    with run.stage("lower"):
        program = lower_decode_graph(raised.gm, device, model_name=o.model, quant=plan)
    if plan is not None:
        qi = program.info["quant"]
        R["quant"] = {"recipe": o.quant, "profile": profile, "plan": qi["recipe"], "matrices_per_format": qi["matrices_per_format"], "weight_bytes": qi["weight_bytes"], "weight_formats": program.info["weight_formats"]}
    with run.stage("encode"):
        blob = program.encode()
        program = Program.decode(blob, source="<encoded program>")
        same = program.encode() == blob
        run.check("program_round_trip", same, f".pimb of {len(blob)} bytes decodes and re-encodes byte-identically")
        if o.save_program and len(blob) <= SAVE_PROGRAM_MAX_BYTES:
            from nhil.util import atomic_write_bytes

            atomic_write_bytes(run.dir / "program.pimb", blob)
    R["program"] = {
        "bytes": len(blob),
        "instructions": len(program.instrs),
        "host_ops": len(program.host_ops),
        "bank_rows": len(program.bank_images),
        "device": device.name,
    }

    from nhil.targets.base import unclaimed

    missing = unclaimed(program, target.capabilities())
    if missing:
        from nhil.errors import NotClaimed

        target.close()
        raise NotClaimed(f"not claimed: target {o.target} does not implement {', '.join(missing)} (its capabilities() list what it claims; "
                         f"`nhil targets` shows them); the run is skipped, not passed")
    dut = LockstepTarget(target) if (o.lockstep and o.target != "sim") else target
    with dut:
        runner = Runner(program, dut)
        R["program"]["device_instructions_per_step"] = runner.device_instructions
        with run.stage("load_target"):
            runner.reset()
        total = len(prompt_ids) + o.tokens - 1

        def progress(i, n):
            if i == n or i % 5 == 0:
                _log(f"  step {i}/{n}")

        with run.stage("run_teacher_forced"):
            tf = run_teacher_forced(runner, prompt_ids, golden_tokens, progress=progress)
        all_agree = tf.tokens == golden_tokens
        if o.repeat > 1:
            with run.stage("repeat"):
                same = 0
                for _ in range(o.repeat - 1):
                    again = run_teacher_forced(runner, prompt_ids, golden_tokens)
                    same += int(np.array_equal(again.logits.view(np.uint32), tf.logits.view(np.uint32)))
                run.check("deterministic", same == o.repeat - 1, f"{same + 1}/{o.repeat} teacher-forced runs gave bit-identical logits")
        with run.stage("run_free"):
            free = run_greedy(runner, prompt_ids, o.tokens, progress=progress)
        R["target_stats"] = dut.stats()
    R["target_tokens"] = free.tokens
    R["target_text"] = bundle.decode(free.tokens)
    R["positions_run"] = total

    with run.stage("compare"):
        cmp = metrics.compare_logits(gt["logits"].numpy(), tf.logits)
        steps = []
        step_fail = []
        for s in cmp["steps"]:
            s = dict(s)
            s["position"] = len(prompt_ids) - 1 + s["step"]
            s["golden_token"] = golden_tokens[s["step"]]
            s["target_token"] = s.pop("test_top1")
            v = failing(check(profile, "logits", s, overrides))
            s["passed"] = not v
            if v:
                step_fail.append(f"step {s['step']}: " + "; ".join(str(x) for x in v))
            steps.append(s)
        R["steps"] = steps
        R["kl_mean"], R["kl_max"] = cmp["kl_mean"], cmp["kl_max"]
        n_agree = sum(a == b for a, b in zip(tf.tokens, golden_tokens))
        fdt = metrics.first_divergent_token(golden_tokens, free.tokens)
        if fdt is not None and fdt < len(free.tokens):
            R["first_divergent_token"] = _token_divergence(fdt, gt["logits"].numpy()[fdt], free.logits[fdt], golden_tokens[fdt], free.tokens[fdt])
        run_th = thresholds.get("run")
        if run_th is None:
            run.check("teacher_forced_top1", all_agree, f"target top-1 equals the golden token at {n_agree}/{len(golden_tokens)} steps")
        else:  # quantized profiles: agreement rate and greedy match length with measured thresholds
            rate = n_agree / max(1, len(golden_tokens))
            th = run_th["top1_rate"]
            run.check("teacher_forced_top1", rate >= th["min"], f"top-1 agreement {n_agree}/{len(golden_tokens)} = {rate:.3f}, needs >= {th['min']}: {th['reason']}")
        run.check("logits_within_tolerance", not step_fail, "; ".join(step_fail) if step_fail else f"all {len(steps)} steps within the {profile} logits thresholds")
        if run_th is None:
            run.check("free_running_tokens", fdt is None, "free-running greedy tokens equal the golden's" if fdt is None else f"first divergent token at step {fdt}: golden {golden_tokens[fdt]} vs target {free.tokens[fdt]}")
        else:
            match = len(golden_tokens) if fdt is None else fdt
            th = run_th["greedy_match"]
            need = min(th["min"], len(golden_tokens))
            run.check("free_running_tokens", match >= need, f"greedy tokens match the golden's for {match}/{len(golden_tokens)} steps, needs >= {need}: {th['reason']}")
        layers = []
        first_bad = None
        names = ["act.model.embed_tokens"] + sorted((k for k in gt if k.startswith("act.model.layers.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        for name in names:
            if name not in tf.acts:
                continue
            ref = gt[name].numpy()
            got = tf.acts[name][: ref.shape[0]]
            m = metrics.compare_tensors(ref, got)
            v = failing(check(profile, "hidden", m, overrides))
            row = {"layer": name.removeprefix("act."), "cosine": m["cosine"], "sqnr_db": m["sqnr_db"], "max_abs": m["max_abs"], "rel_l2": m["rel_l2"], "passed": not v}
            if v and first_bad is None:
                first_bad = {"layer": row["layer"], "violations": [str(x) for x in v], "top_differences": _top_differences(ref, got)}
            layers.append(row)
        R["layers"] = layers
        R["first_divergent_layer"] = first_bad
        run.check("hidden_states_within_tolerance", first_bad is None, "every layer within tolerance" if first_bad is None else f"first layer over tolerance: {first_bad['layer']}: {'; '.join(first_bad['violations'])}")
        if o.target != "sim" and o.lockstep:
            ls = R["target_stats"].get("lockstep", {})
            run.check("bit_identical_to_sim", ls.get("first_mismatch") is None, f"{ls.get('syncs_compared', 0)} SYNCs / {ls.get('readbacks_compared', 0)} readbacks compared bit for bit with the simulator")
    R["thresholds"] = thresholds
    R["outcome"] = "PASS" if all(c["passed"] for c in R["checks"]) else "MISMATCH"
