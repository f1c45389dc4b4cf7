"""One landscape row: a tiny seeded model of one architecture through ``nhil verify --target sim``.

Runs in its own process (``python -m nhil.landscape.row MODEL_TYPE WORKDIR``, started by
:mod:`nhil.landscape.runner` with a timeout) and writes ``WORKDIR/row.json`` (temp file,
then rename). The model is the architecture's :func:`~nhil.landscape.tiny_config.tiny_config`
written as ``WORKDIR/<model_type>/config.json`` and loaded as ``--model config.json``
(seeded random weights), so a row reproduces with
``nhil verify --model WORKDIR/<model_type>/config.json --target sim --tokens 8``.

Buckets: CONFIG (no tiny model could be built: the reason), EXPORT_FAIL (``torch.export``
failed), COMPILE_FAIL (raise or lower failed: every unraised op with module path, class
and source line; or a weight matrix left off PIM), LOAD_FAIL (the eager golden failed),
MISMATCH, TIMEOUT (set by the runner), PASS (bit-exact raise, sim within the bf16
profile, every weight matrix on PIM); any other verify outcome keeps its name.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import traceback
from pathlib import Path

__all__ = ["run_row", "bucket_of"]

TOKENS = 8
_ERR = re.compile(r"cannot raise (?P<op>\S+) in module '(?P<path>[^']*)' at (?P<src>\S+): (?P<reason>.*?)(?: \(and \d+ more\))?\. Unsupported")


def _class_of(ep, module_path: str) -> str:
    """Module class name at ``module_path`` from the exported program's ``nn_module_stack``."""
    for n in ep.graph.nodes:
        for path, cls in (n.meta.get("nn_module_stack") or {}).values():
            if path == module_path:
                cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
                return cls.rsplit(".", 1)[-1]
    return ""


class _Probe:
    """Wraps ``nhil.compiler.raise_graph`` for the duration of a row: on an unraised op it
    re-raises non-strictly to list every root cause, on success it records the PIM share."""

    def __init__(self, model):
        self.model = model
        self.unraised: list[dict] = []
        self.pim: dict | None = None

    def __enter__(self):
        import nhil.compiler as comp

        self._orig = comp.raise_graph
        probe = self

        def raise_graph(ep, kind, strict=True, check=True):
            from nhil.errors import CompileError

            try:
                r = probe._orig(ep, kind, strict=strict, check=check)
            except CompileError:
                from nhil.compiler.raising import Raiser

                try:
                    loose = Raiser(ep, kind).run(strict=False)
                    probe.unraised = [{"op": u.op, "module": u.module_path, "class": _class_of(ep, u.module_path), "source": u.source, "reason": u.reason}
                                      for u in loose.unraised if "not raised" not in u.reason]
                except Exception as e:  # noqa: BLE001 - the strict error stays the row's verdict
                    probe.unraised = [{"op": "?", "module": "", "class": "", "source": "", "reason": f"non-strict raise failed: {type(e).__name__}: {e}"}]
                raise
            if r.gm is not None:
                from nhil.compiler.pim_share import pim_weight_share

                probe.pim = pim_weight_share(r.gm, probe.model)
            return r

        comp.raise_graph = raise_graph
        return self

    def __exit__(self, *exc):
        import nhil.compiler as comp

        comp.raise_graph = self._orig
        return False


def bucket_of(report: dict, pim: dict | None) -> str:
    """Landscape bucket of a verify report (see the module docstring)."""
    out, stage = report.get("outcome"), report.get("stage")
    if out == "COMPILE_FAIL" and stage == "export":
        return "EXPORT_FAIL"
    if out == "LOAD_FAIL" and stage == "load_model":
        return "CONFIG"
    if out in ("PASS", "XPASS"):
        return "PASS" if pim is not None and pim["share"] >= 1.0 else "COMPILE_FAIL"
    return out or "CRASH"


def run_row(model_type: str, workdir: Path) -> dict:
    """Build, verify and classify one architecture; returns the row dict (see the module docstring)."""
    t0 = time.perf_counter()
    row: dict = {"arch": model_type}
    try:
        from nhil.landscape.tiny_config import causal_lm_architectures, tiny_config
        from nhil.errors import NhilError

        row["class"] = causal_lm_architectures().get(model_type, "")
        try:
            cfg = tiny_config(model_type)
            d = workdir / model_type
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(cfg.to_json_string())
        except NhilError as e:
            row.update(bucket="CONFIG", error=str(e))
            return row
        except Exception as e:  # noqa: BLE001 - any config-building failure is a CONFIG row with its reason
            row.update(bucket="CONFIG", error=f"{type(e).__name__}: {str(e)[:300]}")
            return row
        spec = str(d / "config.json")
        row["reproducer"] = f"nhil verify --model {spec} --target sim --tokens {TOKENS}"
        from nhil.models import get_model
        from nhil.verify import VerifyOptions, verify

        try:
            bundle = get_model(spec)
        except NhilError as e:
            row.update(bucket="CONFIG", error=str(e))
            return row
        except Exception as e:  # noqa: BLE001 - the modeling code refuses its own tiny config
            row.update(bucket="CONFIG", error=f"building the model failed: {type(e).__name__}: {str(e)[:300]}")
            return row
        row["params"] = sum(p.numel() for p in bundle.model.parameters())
        with _Probe(bundle.model) as probe:
            rep = verify(VerifyOptions(model=spec, target="sim", tokens=TOKENS, goldens_dir=workdir / "goldens",
                                       runs_dir=workdir / "runs", save_program=False))
        if probe.pim is None:  # a program from the content-addressed cache: its share was recorded when it was compiled
            probe.pim = (rep.get("placement") or {}).get("weights")
        row["bucket"] = bucket_of(rep, probe.pim)
        if rep.get("outcome") in ("PASS", "XPASS") and probe.pim is None:
            row["error"] = "verify passed, but the PIM share of the weights was not measured; rerun the row with NHIL_CACHE=0"
        row.update(outcome=rep.get("outcome"), stage=rep.get("stage"), run_dir=rep.get("run_dir"))
        if rep.get("error"):
            row["error"] = rep["error"][:600]
        elif row["bucket"] == "MISMATCH":  # the failed checks are the cause (the tight tier says whose fault it is)
            failed = [f"{c['name']}: {c.get('detail', '')}" for c in rep.get("checks") or [] if not c.get("passed")]
            row["error"] = "; ".join(failed)[:600] or str(rep.get("divergence_summary") or "")[:600]
        if probe.pim is not None:
            row["pim"] = probe.pim
            if rep.get("outcome") in ("PASS", "XPASS") and probe.pim["share"] < 1.0:
                row["error"] = f"weights not on PIM: {', '.join(probe.pim['host_matrices'])} (share {probe.pim['share']:.3f})"
        if probe.unraised:
            row["unraised"] = probe.unraised
        elif row["bucket"] == "COMPILE_FAIL" and rep.get("error"):
            m = _ERR.search(rep["error"])
            if m:
                row["unraised"] = [{"op": m["op"], "module": m["path"], "class": "", "source": m["src"], "reason": m["reason"]}]
        sq = [float(x["sqnr_db"]) for x in rep.get("layers") or []]
        if any(math.isfinite(v) for v in sq):
            row["worst_layer_sqnr_db"] = round(min(v for v in sq if math.isfinite(v)), 1)
        if rep.get("steps"):
            row["top1"] = f"{sum(s['golden_token'] == s['target_token'] for s in rep['steps'])}/{len(rep['steps'])}"
    except Exception as e:  # noqa: BLE001 - a CRASH row keeps its traceback
        row.update(bucket="CRASH", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv: list[str]) -> int:
    from nhil.util import atomic_write_text

    model_type, workdir = argv[0], Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    row = run_row(model_type, workdir)
    atomic_write_text(workdir / "row.json", json.dumps(row, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
