"""What a failed run's report keeps: the target's counters and a failed check naming the failure.

A run that ends before the compare stage (LINK_FAIL, RUN_FAIL, a lockstep MISMATCH, CRASH...)
used to drop ``target_stats`` (so a MISMATCH caused by a replayed request had no link counters to
explain it) and, having passed every check it got to, its summary read "checks 1/1 passed".
:func:`keep_failure_context` fixes both; ``nhil.verify.verify`` calls it on every failure.
"""

from __future__ import annotations


def keep_failure_context(report: dict, err: BaseException, target) -> None:
    """Add ``target_stats`` (from ``target.stats()``, if the run got that far and has none yet)
    and, if every recorded check passed, a failed check ``stage_<stage>`` whose detail is the error.

    Args:
        report: the verify report dict (``outcome`` already set).
        err: the exception that ended the run.
        target: the target (or its lockstep wrapper) the run used, or None if none was made.
    """
    if target is not None and report.get("target_stats") is None:
        try:
            report["target_stats"] = target.stats()  # counters only: no I/O, valid after close
        except Exception as e:  # noqa: BLE001 - the counters are context; the outcome stands
            report["target_stats"] = {"unavailable": f"{type(e).__name__}: {e}"}
    checks = report.setdefault("checks", [])
    if all(c.get("passed") for c in checks):
        checks.append({"name": f"stage_{report.get('stage', 'start')}", "passed": False,
                       "detail": f"{report.get('outcome')}: {type(err).__name__ if not str(err) else err}"})
