"""Vectorised binding of KV-append runs (``nhil.runtime.bind_runs``) equals the per-instruction binding.

The reference is ``Runner._resolve``, the binding rules of docs/isa.md "Position-relative
instructions" applied to one instruction; every run a simulator runner forms is bound both
ways at positions that cross slot groups and (on a 32-column device) rows, in bf16 and fp8
KV caches and in a prefill program, and compared field for field and payload bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nhil.errors import RunError
from nhil.isa import DEVICE_PRESETS
from nhil.isa.instr import FLAG_POS_COL, FLAG_POS_SLOT, Instr, Op
from nhil.runtime.bind_runs import KvRun
from nhil.runtime.executor import Runner
from nhil.targets.base import ReadbackDigest, ResolvedRun
from nhil.targets.sim import SimTarget
from nhil.targets.sim.device import PimState
from nhil.targets.sim.fast import FastPimState

SMALL = dataclasses.replace(DEVICE_PRESETS["rtl-tiny"], name="kv-small", row_bytes=64)  # 32 columns: 48 positions span 2 rows


@pytest.fixture(scope="module")
def gm():
    from nhil.compiler import export_decode, raise_graph
    from nhil.models import get_model

    return raise_graph(export_decode(get_model("llama-tiny").model, 48)[0], "decode").gm


def _program(gm, recipe, device):
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.quantize import build_plan

    return lower_decode_graph(gm, device, quant=build_plan(recipe, gm))


def _runner(prog):
    t = SimTarget()
    t.open()
    r = Runner(prog, t)
    rng = np.random.default_rng(7)
    for name, buf in r.bufs.items():  # raw buffers hold 16-bit words as exact fp32 integers
        buf[:] = rng.integers(0, 1 << 16, buf.size) if name in r.raw else rng.standard_normal(buf.size)
    return r


def _runs(r):
    return [it for kind, seg in r.segments if kind == "dev" for it in r._segment_plan(seg)[0] if isinstance(it, KvRun)]


def _check(r, positions):
    runs = _runs(r)
    assert runs, "the program has no KV-append run (the comparison would be vacuous)"
    for pos in positions:
        bits: dict = {}
        for run in runs:
            want = [r._resolve(int(i), pos, {}) for i in run.index]
            # bits per buffer (bits_of), and the host buffers' concatenation rounded at once (bufs; what the runner passes)
            for bufs in (None, r.bufs):
                got = run.bind(pos, lambda b: r._bits(b, bits), bufs).instrs()
                for g, w in zip(got, want, strict=True):
                    assert g.index == w.index and g.instr == w.instr, (pos, g, w)
                    assert g.payload.dtype == w.payload.dtype == np.uint16 and np.array_equal(g.payload, w.payload), (pos, g.index)
    return runs


@pytest.mark.parametrize("recipe,device", [("bf16", "aim-like"), ("bf16:kv_cache=fp8", "aim-like"), ("bf16", "small"), ("bf16:kv_cache=fp8", "small")])
def test_run_binding_equals_per_instruction_binding(gm, recipe, device):
    prog = _program(gm, recipe, DEVICE_PRESETS["aim-like"] if device == "aim-like" else SMALL)
    runs = _check(_runner(prog), [0, 1, 15, 16, 17, 31, 32, 33, 47])
    kinds = {(bool(f & FLAG_POS_SLOT), bool(f & FLAG_POS_COL), int(k)) for run in runs for f, k in zip(run.fields[:, 1], run.fields[:, 8])}
    assert (True, False, 0) in kinds  # K bursts (slot-relative)
    assert any(col for _, col, _ in kinds)  # Vᵀ elements (column-relative)
    if "fp8" in recipe:
        assert any(k == 3 for *_, k in kinds)  # fp8 Vᵀ bytes


def test_prefill_program_runs_bind_like_their_instructions(gm):
    from nhil.compiler.prefill import prefill_program

    prog = _program(gm, "bf16", DEVICE_PRESETS["aim-like"])
    pf = prefill_program(prog, 18)
    runs = _check(_runner(pf), [0, 5, 30])
    assert any(run.fields[:, 10].any() for run in runs)  # token offsets (tok byte) took part


def test_a_run_the_scatter_refuses_raises_the_instructions_error():
    """A run with a bank outside the device goes through ``step`` one by one and fails on that instruction, by name,
    with the reference path's message."""
    d = DEVICE_PRESETS["rtl-tiny"]
    ins = [Instr(Op.WR_SBK, ch=0, bank=b, row=3, col=0, imm=1) for b in (0, d.banks)]
    run = ResolvedRun(np.array([10, 11]), np.array([tuple(int(x) for x in i) for i in ins], np.int64), np.ones((2, d.lanes), np.uint16))
    with pytest.raises(RunError) as fast:
        FastPimState(d).run_block([run], ReadbackDigest())
    ref = PimState(d)
    with pytest.raises(RunError) as want:
        for idx, i, p in run.instrs():
            ref.step(idx, i, p)
    assert str(fast.value) == str(want.value) and "instruction 11 (WR_SBK)" in str(want.value)
