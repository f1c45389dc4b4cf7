"""The compile pipeline (nhil.compiler.pipeline): one sequence for every caller, explicit passes, a pass log."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from nhil.compiler import pipeline
from nhil.compiler.schedule import PASS_INFO, PIPELINE
from nhil.errors import CompileError, SetupError
from nhil.isa import DEVICE_PRESETS
from nhil.models import get_model

AIM = DEVICE_PRESETS["aim-like"]
TOKENS = [3, 17, 42, 99, 5, 7]


@pytest.fixture(scope="module")
def mixtral():
    return get_model("mixtral")


@pytest.fixture(scope="module")
def mixtral_raised(mixtral):
    return pipeline.export_and_raise(mixtral, 32)[1]


def _batches(program) -> int:
    """Accumulator batches: maximal runs of consecutive WR_ACC (each opens one batch of accumulators)."""
    n, prev = 0, None
    for ins in program.instrs:
        n += ins.op.name == "WR_ACC" and prev != "WR_ACC"
        prev = ins.op.name
    return n


def _logits(program):
    from nhil.runtime import Runner, run_teacher_forced
    from nhil.targets.sim import SimTarget

    with SimTarget() as t:
        r = run_teacher_forced(Runner(program, t), TOKENS[:3], TOKENS[3:])
    return r.logits, r.acts


def test_default_pipeline_equals_the_explicit_sequence_byte_for_byte():
    """pipeline.compile == export_decode -> raise_graph -> lower under every pass -> every program pass, written out by hand."""
    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph

    b = get_model("llama-tiny")
    c = pipeline.compile(b, "aim-like", max_cache_len=32, model_name="llama-tiny")
    ep, _ = export_decode(b.model, 32)
    prog = lower_decode_graph(raise_graph(ep, "decode").gm, AIM, model_name="llama-tiny")  # lower-stage passes: all on by default
    for name in PIPELINE:
        if PASS_INFO[name].fn is not None:
            prog = PASS_INFO[name].fn(prog)
    assert c.program.info["passes"] == list(PIPELINE) and c.passes == PIPELINE
    assert c.program.instrs == prog.instrs
    import dataclasses

    assert c.program.encode() == dataclasses.replace(prog, info={**prog.info, "passes": list(PIPELINE)}).encode()
    assert [p.name for p in c.pass_log] == list(PIPELINE)
    for rec in c.pass_log:
        assert (rec.changed is None) == (PASS_INFO[rec.name].stage != "program")
    assert any(rec.changed for rec in c.pass_log if rec.name == "gemv-batch")  # q/k/v and gate/up share inputs in llama-tiny


def test_a_failing_pass_is_named_with_the_passes_before_it(monkeypatch, mixtral_raised):
    import dataclasses

    def broken(p):
        raise IndexError("instruction 7 out of range")

    monkeypatch.setitem(PASS_INFO, "handoff-batch", dataclasses.replace(PASS_INFO["handoff-batch"], fn=broken))
    with pytest.raises(CompileError, match=r"pass handoff-batch \(program stage\) failed: IndexError: instruction 7 out of range; "
                                           r"passes that ran before it: bank-spread, row-locality, vector-reuse$"):
        pipeline.lower(mixtral_raised, AIM)
    with pytest.raises(SetupError, match="unknown scheduling pass"):
        pipeline.PassManager(["bank-spread", "loop-unroll"])


@pytest.mark.parametrize("name", PIPELINE)
def test_each_pass_alone_and_removed_keeps_outputs_bit_identical(name, mixtral_raised):
    """MoE model (expert sub-programs, routing on the host): the pass alone, the default pipeline without it and the default
    pipeline give the same logits and activations bit for bit; the pass's own invariant holds."""
    default, _ = pipeline.lower(mixtral_raised, AIM)
    alone, _ = pipeline.lower(mixtral_raised, AIM, passes=[name])
    without, _ = pipeline.lower(mixtral_raised, AIM, passes=[n for n in PIPELINE if n != name])
    ref_logits, ref_acts = _logits(default)
    for prog in (alone, without):
        lg, acts = _logits(prog)
        assert np.array_equal(lg.view(np.uint32), ref_logits.view(np.uint32))
        assert all(np.array_equal(acts[k].view(np.uint32), ref_acts[k].view(np.uint32)) for k in ref_acts)
    # the pass's own invariant, against the naive baseline (its effect can be subsumed by later passes in the default pipeline)
    none, _ = pipeline.lower(mixtral_raised, AIM, passes=[])
    ops = lambda p, op: sum(1 for i in p.instrs if i.op.name == op)  # noqa: E731
    if name == "handoff-batch":
        assert ops(alone, "SYNC") < ops(none, "SYNC")
    elif name == "vector-reuse":
        assert ops(alone, "WR_GB") < ops(none, "WR_GB")
    elif name == "gemv-batch":  # accumulator batches span matrices that share an input (within a device block: needs handoff-batch)
        assert _batches(default) < _batches(without)  # measured on the tiny Mixtral: 27 vs 39
    elif name in ("row-locality", "bank-spread"):
        assert ops(alone, "MAC_AB") < ops(none, "MAC_AB")  # whole-row MACs / every channel: fewer MAC_AB
    else:  # gb-overlap: a decision of the command schedule, the instruction stream is the baseline's
        assert alone.instrs == none.instrs
    assert default.info["passes"] == list(PIPELINE) and without.info["passes"] == [n for n in PIPELINE if n != name]


def test_compile_records_the_passes_in_the_program_and_the_bundle(tmp_path):
    from nhil.compile import compile_model, write_bundle
    import json

    prog = compile_model("llama-tiny", passes=["row-locality"])
    assert prog.info["passes"] == ["row-locality"]
    write_bundle(tmp_path, "llama-tiny", prog, None, 2)
    assert json.loads((tmp_path / "BUNDLE.json").read_text())["passes"] == ["row-locality"]


def test_callers_do_not_write_the_compile_sequence_again():
    """Only the pipeline imports the lowering entry point (every caller goes through pipeline.compile / lower)."""
    root = Path(__file__).resolve().parents[1] / "nhil"
    offenders = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        if rel in ("compiler/pipeline.py", "compiler/lower.py", "compiler/shape_only.py"):  # shape-only lowers its meta graph with the same table
            continue
        if re.search(r"^\s*from nhil\.compiler\.lower import .*\blower_decode_graph\b", f.read_text(), re.M):
            offenders.append(rel)
    assert offenders == []
