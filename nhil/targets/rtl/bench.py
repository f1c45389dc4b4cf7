"""RTL rows for ``make bench`` (issue 3): build time, simulated cycles/s, MACs/s, wall time
per decoded token, each beside the functional simulator measured in the same call.

``rtl_bench_rows()`` returns a list of dicts (one per figure)::

    {"model", "device", "stage", "value", "unit", "sim_value", "ratio", "note"}

``ratio`` is ``value / sim_value`` (for wall times: how many times slower the RTL is;
for rates: the RTL's fraction of the simulator's rate). Figures:

* ``rtl build cold``: a full Verilator build of ``pim_sim_top`` for the device into a
  fresh, temporary build root (so the shared cache is neither used nor disturbed);
  ``rtl build cached``: the same ``ensure_build`` call again (hash check only).
* ``wall per decoded token``: mean wall time of one decode step (one token position:
  all device blocks + host ops) through ``Runner``, RTL vs ``SimTarget``, same program.
* ``simulated cycles/s``: RTL clock cycles per second of ``execute`` wall time; the
  simulator column is the same cycle count over the simulator's execute time
  (simulator speed in "RTL cycles' worth of work" per second).
* ``MACs/s``: bf16 multiply-accumulates per second of execute time, both targets.

Per weight-format family (``format_rows(run_formats())``, hooked into ``make bench`` by
``format_rows_provider``): llama-tiny compiled with each recipe of ``FORMAT_FAMILIES``, the
RTL's simulated cycles/s and MACs/s with ``ratio`` against the bf16 program's in the same call.

``llama-tiny`` on ``rtl-tiny`` always (about a minute plus a cold build); the real
``llama`` on ``rtl-aim1`` (bf16) and ``llama:native`` (SmolLM2 in its own GGUF Q4_1/Q8_0 blocks) on
the two-channel ``rtl-aim2`` only with ``NHIL_BENCH_RTL_LLAMA=1`` (each about 2 min of compile,
10 s of backdoor load and ~15-50 s per token). A model name ``<model>:<quant>`` is that model
compiled with the quant recipe. ``as_table_rows(rows)`` gives the
``(stage, value, ratio, baseline, note)`` tuples of ``nhil.bench``'s table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

from nhil.targets.base import DelegatingTarget, ResolvedInstr, Target

TINY_STEPS = 4
LLAMA_STEPS = 2


class _Timed(DelegatingTarget):
    """Forwards to a target; adds up ``execute`` wall time."""

    def __init__(self, inner: Target) -> None:
        super().__init__(inner)
        self.exec_s = 0.0

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = self.inner.execute(block)
        self.exec_s += time.perf_counter() - t0
        return out


def _say(msg: str) -> None:
    print(f"[bench rtl] {msg}", file=sys.stderr, flush=True)


def build_times(device: str) -> dict:
    """Cold build into a fresh temporary build root, then the cached lookup; seconds each."""
    import shutil

    from nhil.isa import DEVICE_PRESETS
    from nhil.targets.rtl.build import ensure_build
    from nhil.targets.rtl.target import channel_spec

    spec = channel_spec(DEVICE_PRESETS[device])
    old = os.environ.get("NHIL_RTL_BUILD")
    tmp = tempfile.mkdtemp(prefix="nhil-rtl-bench-build-")
    os.environ["NHIL_RTL_BUILD"] = tmp
    try:
        t0 = time.perf_counter()
        ensure_build(spec, progress=_say)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, info = ensure_build(spec, progress=_say)
        cached = time.perf_counter() - t0
        assert info["cached"]
    finally:
        if old is None:
            os.environ.pop("NHIL_RTL_BUILD", None)
        else:
            os.environ["NHIL_RTL_BUILD"] = old
        shutil.rmtree(tmp, ignore_errors=True)
    return {"cold_s": cold, "cached_s": cached}


def run_model(model: str, device: str, steps: int, quant: str = "bf16") -> dict:
    """Compile ``model`` (with the ``quant`` recipe) for ``device`` and run ``steps`` decode steps on the simulator and the RTL."""
    from nhil.compile import compile_model
    from nhil.models import get_model
    from nhil.runtime import Runner
    from nhil.targets.rtl import RtlTarget
    from nhil.targets.sim import SimTarget

    ids = get_model(model).encode(None)
    toks = (list(ids) + [ids[-1]] * steps)[:steps]  # teacher-forced positions 0..steps-1
    max_len = max(16, ((steps + 15) // 16) * 16)
    t0 = time.perf_counter()
    prog = compile_model(model, device, max_len, quant=quant)
    r: dict = {"model": model if quant == "bf16" else f"{model}:{quant}", "device": device, "weight_formats": prog.info.get("weight_formats"), "steps": steps, "compile_s": time.perf_counter() - t0, "rows_used": prog.info.get("rows_used")}
    for name, tgt in (("sim", SimTarget(device=prog.device)), ("rtl", RtlTarget(device=device))):
        tt = _Timed(tgt)
        with tt:
            runner = Runner(prog, tt)
            t0 = time.perf_counter()
            runner.reset()
            load_s = time.perf_counter() - t0
            tt.exec_s = 0.0
            t0 = time.perf_counter()
            outs = []
            for pos, tok in enumerate(toks):
                outs.append({k: np.array(v, copy=True) for k, v in runner.step(tok, pos).items()})
            wall = time.perf_counter() - t0
            st = tt.stats()
        r[name] = {"load_s": load_s, "wall_s": wall, "exec_s": tt.exec_s, "s_per_token": wall / steps, "stats": st, "outs": outs}
        _say(f"{r['model']} on {name}: {wall / steps:.3f} s per token ({steps} steps), load {load_s:.2f} s")
    rs = r["rtl"]["stats"]
    r["cycles"] = rs["cycles"]
    r["macs"] = rs["macs"]
    r["load"] = rs.get("load", {})
    # the bench also checks the two targets agree (it is not a correctness test, but a
    # fast RTL that computes something else would be a meaningless figure)
    same = all(
        np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)) for a, b in zip(r["sim"]["outs"], r["rtl"]["outs"]) for k in a
    )
    r["bit_identical"] = bool(same)
    for name in ("sim", "rtl"):
        del r[name]["outs"]
    return r


def _rows_for(r: dict) -> list[dict]:
    m, dev = r["model"], r["device"]
    sim, rtl = r["sim"], r["rtl"]
    cyc, macs = r["cycles"], r["macs"]
    rtl_cps, sim_cps = cyc / rtl["exec_s"], cyc / sim["exec_s"]
    rtl_mps, sim_mps = macs / rtl["exec_s"], macs / sim["exec_s"]
    agree = "bit-identical outputs" if r["bit_identical"] else "OUTPUTS DIFFER"
    rows = [
        {"stage": "wall per decoded token", "value": rtl["s_per_token"], "unit": "s", "sim_value": sim["s_per_token"],
         "note": f"{r['steps']} steps, {agree}; ratio = x slower than the simulator"
                 + (f"; formats {','.join(r['weight_formats'])}" if r.get("weight_formats") else "")},
        {"stage": "simulated cycles/s", "value": rtl_cps, "unit": "cycles/s", "sim_value": sim_cps,
         "note": f"{cyc / r['steps']:,.0f} RTL cycles per token; sim column = same cycles over the simulator's execute time"},
        {"stage": "MACs/s", "value": rtl_mps, "unit": "MAC/s", "sim_value": sim_mps, "note": f"{macs / r['steps']:,.0f} MACs per token"},
        {"stage": "load (bank images)", "value": rtl["load_s"], "unit": "s", "sim_value": sim["load_s"],
         "note": f"{r['load'].get('rows', '?')} rows, {r['load'].get('bytes', 0) / 2**20:.0f} MB {r['load'].get('format', '')} backdoor"},
    ]
    for row in rows:
        row.update(model=m, device=dev, ratio=row["value"] / row["sim_value"] if row["sim_value"] else None)
    return rows


def rtl_bench_rows(models: list[str] | None = None, build: bool = True) -> list[dict]:
    """The RTL bench figures (see the module docstring). Raises SetupError without cocotb/Verilator."""
    if models is None:
        models = ["llama-tiny"] + (["llama", "llama:native"] if os.environ.get("NHIL_BENCH_RTL_LLAMA", "") not in ("", "0") else [])
    devices = {"llama-tiny": ("rtl-tiny", TINY_STEPS), "llama": ("rtl-aim1", LLAMA_STEPS), "llama:native": ("rtl-aim2", LLAMA_STEPS)}
    rows: list[dict] = []
    for m in models:
        dev, steps = devices.get(m, ("rtl-tiny", TINY_STEPS))
        name, _, quant = m.partition(":")
        if build:
            _say(f"cold build for {dev} ...")
            bt = build_times(dev)
            rows.append({"model": m, "device": dev, "stage": "rtl build cold", "value": bt["cold_s"], "unit": "s", "sim_value": None, "ratio": None,
                         "note": "Verilator build of pim_sim_top into a fresh build root"})
            rows.append({"model": m, "device": dev, "stage": "rtl build cached", "value": bt["cached_s"], "unit": "s", "sim_value": None,
                         "ratio": bt["cached_s"] / bt["cold_s"], "note": "content-hash lookup; ratio = of the cold build"})
        _say(f"{m} on {dev}: simulator vs RTL, {steps} steps ...")
        rows.extend(_rows_for(run_model(name, dev, steps, quant or "bf16")))
    return rows


FORMAT_FAMILIES = ("bf16", "int8", "int4-g128", "fp8-e4m3", "mxfp8", "mxfp4", "nvfp4", "q8_0", "q4_1")
FORMAT_STEPS = 2


def run_formats(model: str = "llama-tiny", device: str = "rtl-tiny", recipes: tuple[str, ...] = FORMAT_FAMILIES, steps: int = FORMAT_STEPS) -> list[dict]:
    """``model`` compiled once per quant recipe and run ``steps`` decode steps on the simulator and the RTL (one
    RTL session for all recipes). Returns per recipe: ``cycles``, ``macs`` (RTL counters), ``rtl_exec_s``,
    ``sim_exec_s``, ``bit_identical``, ``formats`` (program weight formats)."""
    from nhil.compiler import pipeline
    from nhil.isa import DEVICE_PRESETS
    from nhil.models import get_model
    from nhil.runtime import Runner
    from nhil.targets.rtl import RtlTarget
    from nhil.targets.sim import SimTarget

    bundle = get_model(model)
    ids = bundle.encode(None)
    toks = (list(ids) + [ids[-1]] * steps)[:steps]
    _, raised = pipeline.export_and_raise(bundle, 16)
    dev = DEVICE_PRESETS[device]
    out = []
    with RtlTarget(device=device) as rtl:
        for recipe in recipes:
            prog, _ = pipeline.lower(raised, dev, plan=None if recipe == "bf16" else pipeline.quant_plan(recipe, raised, bundle), model_name=model)
            res: dict = {"recipe": recipe, "formats": prog.info.get("weight_formats")}
            outs = {}
            for name, tgt in (("sim", SimTarget(device=dev)), ("rtl", rtl)):
                tt = _Timed(tgt)
                runner = Runner(prog, tt)
                runner.reset()
                tt.exec_s = 0.0
                outs[name] = [{k: np.array(v, copy=True) for k, v in runner.step(tok, pos).items()} for pos, tok in enumerate(toks)]
                res[f"{name}_exec_s"] = tt.exec_s
            st = rtl.stats()
            res.update(cycles=st["cycles"], macs=st["macs"])
            res["bit_identical"] = all(np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8))
                                       for a, b in zip(outs["sim"], outs["rtl"]) for k in a)
            _say(f"{model} {recipe}: {res['cycles'] / res['rtl_exec_s']:,.0f} cycles/s on rtl, bit-identical {res['bit_identical']}")
            out.append(res)
    return out


def format_rows(runs: list[dict], model: str = "llama-tiny", device: str = "rtl-tiny") -> list[dict]:
    """Per recipe: simulated cycles/s and MACs/s of the RTL, ``ratio`` = against the bf16 recipe's in the same call."""
    base = next(r for r in runs if r["recipe"] == "bf16")
    b_cps, b_mps = base["cycles"] / base["rtl_exec_s"], base["macs"] / base["rtl_exec_s"]
    rows = []
    for r in runs:
        cps, mps = r["cycles"] / r["rtl_exec_s"], r["macs"] / r["rtl_exec_s"]
        agree = "bit-identical to the simulator" if r["bit_identical"] else "OUTPUTS DIFFER FROM THE SIMULATOR"
        fm = ",".join(r["formats"] or [])
        rows.append({"model": model, "device": device, "stage": f"{r['recipe']}: simulated cycles/s", "value": cps, "unit": "cycles/s",
                     "sim_value": None, "ratio": cps / b_cps, "note": f"ratio = of bf16's {b_cps:,.0f}; formats {fm}; {agree}"})
        rows.append({"model": model, "device": device, "stage": f"{r['recipe']}: MACs/s", "value": mps, "unit": "MAC/s",
                     "sim_value": r["macs"] / r["sim_exec_s"], "ratio": mps / b_mps, "note": f"ratio = of bf16's {b_mps:,.0f}; sim column = the simulator's MACs/s"})
    return rows


def format_rows_provider(r: dict) -> list:
    """``nhil.bench`` row provider: the per-format-family RTL rows, once (on llama-tiny, when rtl is benched)."""
    if r.get("model") != "llama-tiny" or "rtl" not in os.environ.get("NHIL_BENCH_TARGETS", "rtl,fpga"):
        return []
    from nhil.errors import NhilError

    try:
        return [(st, val, ratio, f"{base} {note}".strip()) for st, val, ratio, base, note in as_table_rows(format_rows(run_formats()))]
    except NhilError as e:
        return [("rtl formats", "unavailable", "", str(e)[:80])]


def _fmt(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f} s" if v < 100 else f"{v:.0f} s"
    return f"{v:,.0f} {unit}"


def as_table_rows(rows: list[dict]) -> list[tuple[str, str, str, str, str]]:
    """``(stage, value, ratio, baseline, note)`` tuples for ``nhil.bench``'s rich table."""
    out = []
    for r in rows:
        base = f"sim {_fmt(r['sim_value'], r['unit'])}" if r.get("sim_value") is not None else ""
        ratio = f"{r['ratio']:.3g}" if r.get("ratio") is not None else ""
        out.append((f"rtl {r['model']}/{r['device']}: {r['stage']}", _fmt(r["value"], r["unit"]), ratio, base, r.get("note", "")))
    return out


if __name__ == "__main__":  # python -m nhil.targets.rtl.bench [formats]
    import json

    t0 = time.perf_counter()
    rows = format_rows(run_formats()) if sys.argv[1:] == ["formats"] else rtl_bench_rows()
    for row in as_table_rows(rows):
        print(" | ".join(row))
    print(json.dumps(rows, indent=1, default=float))
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
