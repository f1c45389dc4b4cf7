"""``nhil verify``'s stages in order (the package docstring lists them): :func:`verify`."""

from __future__ import annotations

import dataclasses
import json
import math
import traceback

import numpy as np

from nhil.errors import NhilError
from nhil.verify.options import PROFILE, SAVE_PROGRAM_MAX_BYTES, VerifyOptions
from nhil.verify.accuracy_checks import check_accuracy
from nhil.verify.reference import layer_names, reference_outputs
from nhil.verify.run import Run, log

__all__ = ["verify"]


def verify(opts: VerifyOptions) -> dict:
    """Run the whole pipeline once; returns the report dict (also written to the run folder).

    Never raises for user-facing failures: they become the report's outcome with a
    message; an unexpected exception becomes CRASH with its traceback saved to
    ``<run>/traceback.txt``.

    Raises:
        nhil.args.UsageError: a bad argument (unknown model/target/quant/device name, a
            recipe that does not fit the model, bad PROMPT/TOKENS/SEED/REPEAT), found
            before any work and before the run folder is made.
    """
    from nhil.args import check_verify_args
    from nhil.failure import keep_failure_context

    check_verify_args(opts)
    run = Run(opts)
    try:
        _verify(run)
    except NhilError as e:
        run.report["outcome"] = e.outcome
        run.report["error"] = str(e)
        if getattr(e, "detail", None):
            run.report["cross_target_first_mismatch"] = e.detail
        keep_failure_context(run.report, e, getattr(run, "dut", None))  # link counters + a failed check
    except Exception as e:  # noqa: BLE001 - turned into a CRASH outcome with the traceback kept
        run.report["outcome"] = "CRASH"
        run.report["error"] = f"{type(e).__name__}: {e} (traceback in {run.dir / 'traceback.txt'})"
        (run.dir / "traceback.txt").write_text(traceback.format_exc())
        keep_failure_context(run.report, e, getattr(run, "dut", None))
    _finish(run)
    return run.report


def _finish(run: Run) -> None:
    """Expectation, plots and JUnit, then the final report write (each best-effort, never masking the outcome)."""
    from nhil.expectations import DEFAULT_PATH, apply_expectation
    from nhil.report.junit import write_junit

    apply_expectation(run.report, run.o.manifest or DEFAULT_PATH)
    try:
        from nhil.report.plots import plot_report

        run.report["plots"] = plot_report(run.report, run.dir)
    except Exception as e:  # noqa: BLE001 - a plotting problem must not change the outcome
        run.report["plots"] = []
        log(f"plots skipped: {type(e).__name__}: {e}")
    run.write()
    write_junit(run.dir / "junit.xml", [run.report])


TIGHT_CHECKS = ("tight_bit_identical_to_reference", "bit_identical_to_sim", "program_round_trip", "deterministic")


def _verify(run: Run) -> None:
    """The stages in order; each helper records what it measured in ``run.report``."""
    import torch

    from nhil import expectations

    o, R = run.o, run.report
    torch.manual_seed(o.seed)
    overrides = expectations.tolerance_overrides(o.model, o.target, o.quant, o.manifest or expectations.DEFAULT_PATH)
    bundle, prompt_ids = _load_model(run)
    gt, golden_tokens = _golden(run, bundle, prompt_ids)
    target, device, max_len = _open_target(run, prompt_ids)
    profile, thresholds = _thresholds(run, overrides)
    built: dict = {}
    program = _compile(run, bundle, device, max_len, profile, built)
    built["ew_silu"] = tuple(program.info.get("ew_silu", ()))  # the reference computes these silu_mul nodes as the device does
    tf, free = _run_on_target(run, program, target, bundle, prompt_ids, golden_tokens)

    # ---- tight tier: target == device-numerics reference, bit for bit
    ref = reference_outputs(run, bundle, built, device, max_len, prompt_ids, golden_tokens, R["program_cache"])
    names = layer_names(gt)
    _check_tight(run, ref, tf, len(prompt_ids), names)

    # ---- accuracy tier: target vs the fp32 eager golden
    with run.stage("compare"):
        check_accuracy(run, thresholds=thresholds, profile=profile, overrides=overrides, gt=gt, tf=tf, free=free, ref=ref, names=names,
                       prompt_ids=prompt_ids, golden_tokens=golden_tokens)
    R["thresholds"] = thresholds
    _outcome(R)


def _load_model(run: Run):
    from nhil.models import get_model

    o, R = run.o, run.report
    with run.stage("load_model"):
        bundle = get_model(o.model, seed=o.seed, layers=o.layers)
        prompt_ids = bundle.encode(o.prompt)
    R["prompt"] = o.prompt if o.prompt is not None else (bundle.default_prompt or ",".join(map(str, prompt_ids)))
    R["prompt_ids"] = prompt_ids
    R["weights_id"] = bundle.weights_id
    if bundle.load is not None:
        R["model_cache"] = bundle.load
    return bundle, prompt_ids


def _golden(run: Run, bundle, prompt_ids: list[int]):
    """The golden of this key, reused or generated once under its lock (``nhil.golden.cache``)."""
    from nhil.golden.cache import obtain_golden
    from nhil.golden.generate import generate_golden
    from nhil.golden.schema import golden_shapes
    from nhil.golden.store import golden_key, golden_path

    o, R = run.o, run.report
    with run.stage("golden"):
        key = golden_key(prompt_ids, o.tokens, bundle.weights_id, seed=o.seed)
        gpath = golden_path(o.goldens_dir, bundle.name, key)
        expect = {"model": bundle.name, "weights_id": bundle.weights_id, "prompt_ids": json.dumps(prompt_ids), "n_tokens": str(o.tokens)}
        gt, _gmeta, R["golden"] = obtain_golden(gpath, expect, o.regen, lambda: generate_golden(bundle, prompt_ids, o.tokens, seed=o.seed, prompt_text=R["prompt"]),
                                                shapes=golden_shapes(bundle.model))  # once per key, under its lock
    golden_tokens = [int(t) for t in gt["tokens"].tolist()]
    R["golden_tokens"] = golden_tokens
    R["golden_text"] = bundle.decode(golden_tokens)
    return gt, golden_tokens


def _open_target(run: Run, prompt_ids: list[int]):
    """The target, the device behind it (the program is compiled for it) and the static KV-cache length."""
    from nhil.isa import DEVICE_PRESETS
    from nhil.targets import get_target

    o, R = run.o, run.report
    if o.device and o.device not in DEVICE_PRESETS:
        from nhil.errors import SetupError

        raise SetupError(f"unknown DEVICE {o.device!r}; presets: {', '.join(DEVICE_PRESETS)}")
    topts = dict(o.target_options)
    if o.device:
        topts.setdefault("device", o.device)
    elif o.target == "sim":
        topts.setdefault("device", "aim-like")
    R["stage"] = "open_target"  # a LINK_FAIL during HELLO is this stage's, not the golden's
    target = get_target(o.target, **topts)
    run.dut = target  # for keep_failure_context
    device = target.capabilities().device  # compile for the device behind the target
    max_len = int(math.ceil((len(prompt_ids) + o.tokens) / 16) * 16)
    R["device"] = dataclasses.asdict(device)
    R["max_cache_len"] = max_len
    return target, device, max_len


def _thresholds(run: Run, overrides):
    """The tolerance profile of the recipe and its effective thresholds (the manifest's overrides applied)."""
    from nhil.golden import accuracy

    o, R = run.o, run.report
    profile = PROFILE
    if o.quant != "bf16":
        from nhil.compiler.quantize import tolerance_profile

        profile = tolerance_profile(o.quant, o.model)
    thresholds = accuracy.effective_thresholds(profile, overrides, R, log=log)
    judged = thresholds.get("judged", True)
    R["accuracy_judged"] = bool(judged)
    if not judged:
        R["accuracy_not_judged"] = thresholds.get("not_judged_reason", "no measured threshold")
    return profile, thresholds


def _compile(run: Run, bundle, device, max_len: int, profile: str, built: dict):
    """The program, from the content-addressed cache or compiled (``built["compiled"]`` then holds the graph)."""
    from nhil.compiler import cache as pcache  # warm verify: content-addressed program cache (NHIL_CACHE=0 disables)
    from nhil.compiler import pipeline
    from nhil.isa import Program

    o, R = run.o, run.report

    def compile_program():
        """The pipeline (export, raise, quantize, lower, passes) and the .pimb round trip; run on a program-cache miss."""
        c = built["compiled"] = pipeline.compile(bundle, device, o.quant, o.passes, max_cache_len=max_len, model_name=o.model, stage=run.stage)
        with run.stage("encode"):
            blob = c.program.encode()
            prog = Program.decode(blob, source="<encoded program>")
            run.check("program_round_trip", prog.encode() == blob, f".pimb of {len(blob)} bytes decodes and re-encodes byte-identically")
        from nhil.compiler.pim_share import pim_weight_share
        from nhil.compiler.placement import placement

        where_ran = placement(c.raised.gm) | {"weights": pim_weight_share(c.raised.gm, bundle.model)}
        meta = {"export_nodes": len(c.exported.graph.nodes), "raised_primitives": dict(c.raised.counts), "pass_log": [p.as_dict() for p in c.pass_log],
                "placement": where_ran}
        return prog, meta, blob

    program, meta, R["program_cache"] = pcache.cached_verify_compile(o.model, bundle, o.quant, device, max_len, compile_program, R["timings"], run.check, passes=o.passes)
    R["export_nodes"], R["raised_primitives"], R["placement"] = meta.get("export_nodes"), meta.get("raised_primitives"), meta.get("placement")
    R["passes"] = list(program.info.get("passes", []))
    R["pass_log"] = meta.get("pass_log", [])
    if o.quant != "bf16":
        qi = program.info["quant"]
        R["quant"] = {"recipe": o.quant, "profile": profile, "plan": qi["recipe"], "matrices_per_format": qi["matrices_per_format"], "weight_bytes": qi["weight_bytes"], "weight_formats": program.info["weight_formats"]}
    blob_len = R["program_cache"]["bytes"]
    if o.save_program and blob_len <= SAVE_PROGRAM_MAX_BYTES:
        from nhil.util import atomic_write_bytes

        atomic_write_bytes(run.dir / "program.pimb", program.encode())
    R["program"] = {
        "bytes": blob_len,
        "instructions": len(program.instrs),
        "host_ops": len(program.host_ops),
        "bank_rows": len(program.bank_images),
        "device": device.name,
        "passes": program.info.get("passes", []),
    }
    return program


def _run_on_target(run: Run, program, target, bundle, prompt_ids: list[int], golden_tokens: list[int]):
    """Teacher-forced (and repeated, with ``REPEAT``) then free-running greedy runs on the target, in lockstep with
    the simulator off it. A program using what the target does not claim is NotClaimed (SKIPPED, not passed)."""
    from nhil.runtime import Runner, run_greedy, run_teacher_forced
    from nhil.runtime.generate import prefill_runner
    from nhil.targets.base import unclaimed
    from nhil.targets.lockstep import LockstepTarget

    o, R = run.o, run.report
    missing = unclaimed(program, target.capabilities())
    if missing:
        from nhil.errors import NotClaimed

        target.close()
        raise NotClaimed(f"not claimed: target {o.target} does not implement {', '.join(missing)} (its capabilities() list what it claims; "
                         f"`nhil targets` shows them); the run is skipped, not passed")
    dut = run.dut = LockstepTarget(target) if (o.lockstep and o.target != "sim") else target
    with dut:
        runner = Runner(program, dut)
        R["program"]["device_instructions_per_step"] = runner.device_instructions
        with run.stage("load_target"):
            runner.reset()
        pf = None
        with run.stage("prefill_program"):
            why = "NHIL_PREFILL=token" if not o.prefill else ""
            if o.prefill:
                pf, why = prefill_runner(runner, len(prompt_ids))
            R["prefill"] = ({"mode": "program", "tokens": pf.prefill_tokens, "vectors": pf.p.info["prefill"]["vectors"],
                             "instructions": len(pf.p.instrs), "decode_instructions_x_tokens": len(program.instrs) * len(prompt_ids)}
                            if pf is not None else {"mode": "per-token", "reason": why})
            log(f"  prefill: {'one program of ' + str(pf.prefill_tokens) + ' tokens' if pf is not None else 'token by token (' + why + ')'}")

        def progress(i, n):
            if i == n or i % 5 == 0:
                log(f"  step {i}/{n}")

        with run.stage("run_teacher_forced"):
            tf = run_teacher_forced(runner, prompt_ids, golden_tokens, progress=progress, prefill=pf)
        if o.repeat > 1:
            with run.stage("repeat"):
                same = 0
                for _ in range(o.repeat - 1):
                    again = run_teacher_forced(runner, prompt_ids, golden_tokens, prefill=pf)
                    same += int(np.array_equal(again.logits.view(np.uint32), tf.logits.view(np.uint32)))
                run.check("deterministic", same == o.repeat - 1, f"{same + 1}/{o.repeat} teacher-forced runs gave bit-identical logits")
        with run.stage("run_free"):
            free = run_greedy(runner, prompt_ids, o.tokens, progress=progress, prefill=pf)
        R["target_stats"] = dut.stats()
    R["target_tokens"] = free.tokens
    R["target_text"] = bundle.decode(free.tokens)
    R["positions_run"] = len(prompt_ids) + o.tokens - 1
    if bundle.tokenizer is not None:
        R["golden_token_text"] = [bundle.decode([t]) for t in golden_tokens]
        R["target_token_text"] = [bundle.decode([t]) for t in tf.tokens]
    return tf, free


def _check_tight(run: Run, ref: dict, tf, n_prompt: int, names: list[str]) -> None:
    """The tight tier's check: every logit and captured activation bit-identical to the device-numerics reference."""
    from nhil.golden.tight import compare_bits

    tight = run.report["tight"] = compare_bits(ref["logits"], tf.logits, ref["acts"], tf.acts, n_prompt, names)
    fd = tight["first_difference"]
    where = "" if fd is None else (f"first difference at {'step ' + str(fd['step']) + ' (position ' + str(fd['position']) + ')' if 'step' in fd else 'position ' + str(fd['position'])}, "
                                   f"{fd['tensor']}[{fd['element']}]: reference {fd['reference']!r} ({fd['reference_bits']}) vs target {fd['target']!r} ({fd['target_bits']})")
    run.check("tight_bit_identical_to_reference", tight["passed"],
              f"{tight['logits_steps']} steps of logits and {tight['tensors_compared'] - 1} activations at every position bit-identical to the "
              f"device-numerics reference ({tight['elements_compared']:,} values)" if tight["passed"] else f"target != compiler semantics: {where}")


def _outcome(R: dict) -> None:
    """PASS or MISMATCH from the checks, the failed tier, and the divergence summary."""
    from nhil.golden import verdict

    failed = [c for c in R["checks"] if not c["passed"]]
    R["outcome"] = "PASS" if not failed else "MISMATCH"
    if failed:
        tight_fail = any(c["name"] in TIGHT_CHECKS for c in failed)
        acc_fail = any(c["name"] not in TIGHT_CHECKS for c in failed)
        R["failed_tier"] = "tight+accuracy" if tight_fail and acc_fail else ("tight" if tight_fail else "accuracy")
    R["divergence_summary"] = verdict.summary_words(R)
