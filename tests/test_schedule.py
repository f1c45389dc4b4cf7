"""Scheduling passes (nhil.compiler.schedule): each pass's effect on the instruction / command stream, and no change of any result."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nhil.compiler.builder import ProgramBuilder
from nhil.compiler.pipeline import PassManager
from nhil.compiler.schedule import NAIVE_PIECES, PASS_INFO, PIPELINE, apply_passes
from nhil.errors import SetupError
from nhil.isa import DEVICE_PRESETS
from nhil.isa.instr import Op

TOKENS = [3, 17, 42, 99, 5]


@pytest.fixture(scope="module")
def tiny_graph():
    from nhil.compiler import export_decode, raise_graph
    from nhil.models import get_model

    ep, _ = export_decode(get_model("llama-tiny").model, 64)
    return raise_graph(ep, "decode").gm


def _compile(gm, passes):
    from nhil.compiler.lower import lower_decode_graph

    return PassManager(passes).compile(lower_decode_graph, gm, DEVICE_PRESETS["aim-like"], model_name="llama-tiny")


@pytest.fixture(scope="module")
def tiny(tiny_graph):
    from nhil.compiler.lower import lower_decode_graph

    return lower_decode_graph(tiny_graph, DEVICE_PRESETS["aim-like"], model_name="llama-tiny")


def _run(prog, tokens=TOKENS):
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    r = Runner(prog, SimTarget())
    r.reset()
    return [{k: v.copy() for k, v in r.step(t, pos).items()} for pos, t in enumerate(tokens)]


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)), k


SUBSETS = [(), PIPELINE] + [tuple(q for q in PIPELINE if q != n) for n in PIPELINE] + [(n,) for n in PIPELINE]
SUBSETS += [PIPELINE + ("host-overlap",), ("host-overlap",)]  # the opt-in pass (nhil.compiler.host_overlap), on the full pipeline and alone


@pytest.mark.parametrize("passes", SUBSETS, ids=lambda s: "+".join(s) or "baseline")
def test_any_pass_subset_is_bit_identical_on_llama_tiny(tiny_graph, tiny, passes):
    """Logits and every read-back activation equal, bit for bit, those of the program as compiled by default."""
    prog = _compile(tiny_graph, passes)
    assert prog.info["passes"] == list(passes)
    if {"bank-spread", "row-locality", "handoff-batch"} - set(passes):
        assert prog.instrs != tiny.instrs  # the subset really changed the program
    _same(_run(tiny), _run(prog))


def test_host_overlap_only_reorders(tiny_graph):
    """host-overlap keeps every instruction and moves some (the V appends ahead of the K appends, WR_ACC zeros ahead of WR_GBs)."""
    base, ov = _compile(tiny_graph, PIPELINE), _compile(tiny_graph, PIPELINE + ("host-overlap",))
    assert sorted(base.instrs) == sorted(ov.instrs) and base.instrs != ov.instrs
    bars = lambda p: [i for i in p.instrs if i.op in (Op.SYNC, Op.EOC)]  # noqa: E731
    assert bars(base) == bars(ov)


def test_full_pipeline_matches_pytorch_golden_tokens(tiny_graph):
    """The fully scheduled program decodes the same greedy tokens as PyTorch eager (independent reference)."""
    import torch

    from nhil.models import get_model

    outs = _run(_compile(tiny_graph, PIPELINE), TOKENS[:3])
    model = get_model("llama-tiny").model
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([TOKENS[:3]])).logits[0].float().numpy()
    for pos, o in enumerate(outs):
        assert int(np.argmax(o["logits"])) == int(np.argmax(ref[pos]))


def test_default_builder_output_is_the_full_pipeline_lowering(tiny_graph, tiny):
    """The builder's default (no manager) is the all-on lowering: same instructions."""
    assert _compile(tiny_graph, PIPELINE).instrs == PassManager().run(tiny).instrs


def test_pass_manager_validates_and_orders():
    with pytest.raises(SetupError, match="unknown scheduling pass.*'nope'.*row-locality"):
        PassManager(["nope"])
    assert PassManager(["gb-overlap", "row-locality"]).passes == ("row-locality", "gb-overlap")
    assert PassManager().passes == PIPELINE and set(PIPELINE) == {n for n, i in PASS_INFO.items() if i.default}
    assert "host-overlap" in PASS_INFO and "host-overlap" not in PIPELINE  # opt-in (issue 17 item 4)
    assert PassManager(["host-overlap", "gb-overlap"]).passes == ("gb-overlap", "host-overlap")
    with pytest.raises(SetupError, match="unknown program pass"):
        apply_passes(None, ["gb-overlap"])


# ---------------------------------------------------------------- hand-checkable single GEMVs
D = DEVICE_PRESETS["rtl-tiny"]  # 1 channel x 16 banks, 128-element rows (8 bursts), 128-element GB


def _gemv_prog(passes, n_out=64, n_in=256, gemvs=1, chain=False):
    """``gemvs`` GEMVs of [n_out, n_in] on rtl-tiny, compiled under ``passes``: all read ``x`` and a HOST op follows, or (``chain``) each reads the previous output."""
    pm = PassManager(passes)

    def build(passes=None):
        b = ProgramBuilder(D, passes)
        x = b.buffer("x", n_in)
        for i in range(gemvs):
            w = np.cos(np.arange(n_out * n_in, dtype=np.float32) * (0.37 + i)).reshape(n_out, n_in)
            p = b.place_matrix(f"w{i}", w)
            y = b.buffer(f"y{i}", n_out)
            b.gemv(p, x, y)
            if chain:
                x = y
        if not chain:
            b.host("add", ["y0", "y0"], [b.buffer("out", n_out)])
        return b.finish({"inputs": {}, "outputs": {"y": y}}, {"model": "hand"})

    return pm.compile(build)


def _run_hand(prog):
    """Run a hand program once on the simulator with a fixed ``x``; returns its output ``y``."""
    from nhil.runtime import Runner
    from nhil.targets.sim import SimTarget

    r = Runner(prog, SimTarget())
    r.reset()
    r.bufs["x"][:] = np.linspace(-1, 1, r.bufs["x"].size, dtype=np.float32)
    return [{k: v.copy() for k, v in r.step(0, 0).items()}]


def _ops(p, *ops):
    return [(i.op.name, i.row, i.col, i.n, i.k) for i in p.instrs if i.op in ops]


def test_row_locality_one_mac_per_row_chunk():
    """W[64, 256]: 4 row-groups x 2 chunks. With the pass: one 8-burst MAC per (group, chunk); without: 4 pieces of 2 bursts, interleaved over the 4 accumulators."""
    on = _gemv_prog(PIPELINE)
    assert _ops(on, Op.MAC_AB) == [("MAC_AB", g * 2 + j, 0, 8, g) for j in range(2) for g in range(4)]
    off = _gemv_prog([n for n in PIPELINE if n != "row-locality"])
    assert NAIVE_PIECES == 4
    assert _ops(off, Op.MAC_AB) == [("MAC_AB", g * 2 + j, c, 2, g) for j in range(2) for c in (0, 2, 4, 6) for g in range(4)]
    # every row activated once with the pass, once per piece without (timing engine's ACT count)
    from nhil.timing.engine import TimingEngine

    acts = []
    for p in (on, off):
        e = TimingEngine(D, program=p)
        e.run_program()
        acts.append(e.stats.acts)
    assert acts == [8, 8 * NAIVE_PIECES]
    # the GEMV's useful bytes are counted once either way (bf16 weights: 2 x 64 x 256)
    from nhil.timing.report import analyze

    assert analyze(on)["gemv"]["useful_bytes"] == analyze(off)["gemv"]["useful_bytes"] == 2 * 64 * 256


def test_vector_reuse_drops_exactly_the_rebroadcasts():
    """Baseline: one WR_GB per MAC (8 per chunk batch); the pass leaves one per chunk and equals the builder's own reuse."""
    base = _gemv_prog(["row-locality"])
    assert len(_ops(base, Op.WR_GB)) == 8  # 2 chunks x 4 accumulators
    after = PassManager(["row-locality", "vector-reuse"]).run(base)
    assert _ops(after, Op.WR_GB) == [("WR_GB", 0, 0, 8, 0)] * 2
    assert after.instrs == _gemv_prog(["row-locality", "vector-reuse"]).instrs
    assert [i for i in after.instrs if i.op is not Op.WR_GB] == [i for i in base.instrs if i.op is not Op.WR_GB]


def test_vector_reuse_keeps_a_write_after_a_barrier():
    """A WR_GB after a SYNC/HOST is kept even if it repeats the last one (the host may have changed the buffer)."""
    from nhil.compiler.schedule import vector_reuse

    base = _gemv_prog(["row-locality"], n_out=16, n_in=128, gemvs=2)  # two GEMVs of the same x, a SYNC between them
    after = vector_reuse(base)
    assert len(_ops(after, Op.WR_GB)) == 2 and len(_ops(after, Op.SYNC)) == 3


def test_handoff_batch_removes_only_unneeded_syncs():
    # three independent GEMVs of one x: the baseline SYNCs after GEMV 1 and 2 go, the one before HOST stays
    base = _gemv_prog(["row-locality", "vector-reuse"], n_out=16, n_in=128, gemvs=3)
    assert [i.op.name for i in base.instrs if i.op in (Op.SYNC, Op.HOST, Op.EOC)] == ["SYNC", "SYNC", "SYNC", "HOST", "SYNC", "EOC"]
    after = PassManager(["row-locality", "vector-reuse", "handoff-batch"]).run(base)
    assert [i.op.name for i in after.instrs if i.op in (Op.SYNC, Op.HOST, Op.EOC)] == ["SYNC", "HOST", "SYNC", "EOC"]
    # a chain y1 = W y0 needs y0 on the host before WR_GB sends it back: that SYNC stays
    chain = _gemv_prog(["row-locality", "vector-reuse"], n_out=128, n_in=128, gemvs=2, chain=True)
    kept = PassManager(["row-locality", "vector-reuse", "handoff-batch"]).run(chain)
    first_rd = next(i for i, ins in enumerate(kept.instrs) if ins.op is Op.RD_ACC)
    nxt_gb = next(i for i, ins in enumerate(kept.instrs) if i > first_rd and ins.op is Op.WR_GB)
    assert any(ins.op is Op.SYNC for ins in kept.instrs[first_rd:nxt_gb])
    # and the chain still computes W1 (W0 x) as the contract says (nhil.numerics.mac.reference_gemv)
    from nhil.numerics.bf16 import f32_to_bf16_bits
    from nhil.numerics.mac import reference_gemv

    out = _run_hand(kept)
    _same(_run_hand(chain), out)
    x = np.linspace(-1, 1, 128, dtype=np.float32)
    for i in range(2):
        w = np.cos(np.arange(128 * 128, dtype=np.float32) * (0.37 + i)).reshape(128, 128)
        x = reference_gemv(f32_to_bf16_bits(w), f32_to_bf16_bits(x))
    assert np.array_equal(out[0]["y"].view(np.uint32), x.view(np.uint32))


def test_gemv_batch_regroups_shared_input_gemvs(tiny):
    after = apply_passes(tiny, ["gemv-batch"])
    assert after.info["schedule"] == ["gemv-batch"]
    # q, k, v of layer 0 (3 units, one input) now form one batch: three WR_ACC before the first MAC
    first_mac = next(i for i, ins in enumerate(after.instrs) if ins.op is Op.MAC_AB)
    assert sum(1 for ins in after.instrs[:first_mac] if ins.op is Op.WR_ACC) == 3
    assert sorted(i.op for i in after.instrs if i.op is not Op.WR_GB) == sorted(i.op for i in tiny.instrs if i.op is not Op.WR_GB)


def test_gb_overlap_selects_the_command_schedule():
    """gb-overlap changes no instruction; without it the engine issues commands in program order, which is slower here by the WR_GB of chunk 2 not hiding under the MACs."""
    from nhil.timing.report import analyze, controller_for

    on = _gemv_prog(PIPELINE)
    off = _gemv_prog([n for n in PIPELINE if n != "gb-overlap"])
    assert on.instrs == off.instrs
    assert (controller_for(on), controller_for(off)) == (False, True)
    a_on, a_off = analyze(on), analyze(off)
    assert (a_on["controller"], a_off["controller"]) == ("reordering", "in-order")
    assert a_off["cycles_per_token"] == analyze(on, inorder=True)["cycles_per_token"] > a_on["cycles_per_token"]


def test_each_pass_does_not_slow_the_modelled_step_cumulatively():
    """A 2-layer shape-only Llama (hidden 1024): adding passes in pipeline order never costs cycles; bank-spread alone is > 10x (32 channels instead of 1)."""
    from nhil.compiler.shape_only import ShapeConfig, compile_shape_only
    from nhil.timing.report import analyze

    cfg = ShapeConfig("small", hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, head_dim=128)
    cyc = [analyze(PassManager(PIPELINE[:i]).compile(compile_shape_only, cfg, max_cache_len=32))["cycles_per_token"] for i in range(len(PIPELINE) + 1)]
    assert all(b <= a for a, b in itertools.pairwise(cyc)), cyc
    assert cyc[0] / cyc[1] > 10 and cyc[1] > cyc[-1]


def test_bank_spread_places_outputs_over_every_channel():
    """fpga-small (2 channels x 16 banks): W[64, 1024] takes 2 row-groups of 32 slots with the pass, 4 row-groups of channel 0's 16 banks without; same result either way."""
    from nhil.numerics.bf16 import f32_to_bf16_bits
    from nhil.numerics.mac import reference_gemv

    d = DEVICE_PRESETS["fpga-small"]
    w = np.sin(np.arange(64 * 1024, dtype=np.float32) * 0.11).reshape(64, 1024)

    def build(passes=None):
        b = ProgramBuilder(d, passes)
        b.gemv(b.place_matrix("w", w), b.buffer("x", 1024), b.buffer("y", 64))
        return b.finish({"inputs": {}, "outputs": {"y": "y"}}, {"model": "hand"})

    on = PassManager(PIPELINE).compile(build)
    off = PassManager([n for n in PIPELINE if n != "bank-spread"]).compile(build)
    mac_on = [(i.flags & 1, i.ch, i.row) for i in on.instrs if i.op is Op.MAC_AB]
    mac_off = [(i.flags & 1, i.ch, i.row) for i in off.instrs if i.op is Op.MAC_AB]
    assert mac_on == [(1, 0, 0), (1, 0, 1)] and mac_off == [(0, 0, r) for r in range(4)]
    assert [(i.col, i.n) for i in off.instrs if i.op is Op.RD_ACC] == [(0, 16)] * 4
    img = {im.row: im.data for im in off.bank_images}
    assert not img[0][1].any() and img[0][0].any()  # channel 1 holds nothing
    ref = reference_gemv(f32_to_bf16_bits(w), f32_to_bf16_bits(np.linspace(-1, 1, 1024, dtype=np.float32)))
    for p in (on, off):
        assert np.array_equal(_run_hand(p)[0]["y"].view(np.uint32), ref.view(np.uint32))
    from nhil.timing.report import analyze

    a_on, a_off = analyze(on), analyze(off)
    assert a_on["gemv"]["useful_bytes"] == a_off["gemv"]["useful_bytes"] == 2 * 64 * 1024
    assert a_off["gemv"]["cycles"] > a_on["gemv"]["cycles"]


def test_passes_keep_moe_expert_subprograms_bit_identical():
    """Mixtral (tiny): expert sub-programs are bounded by HOST markers; baseline and full pipeline decode bit-identically to the default program."""
    from nhil.compiler import export_decode, raise_graph
    from nhil.compiler.lower import lower_decode_graph
    from nhil.models import get_model

    ep, _ = export_decode(get_model("mixtral").model, 16)
    gm = raise_graph(ep, "decode").gm
    ref = _run(lower_decode_graph(gm, DEVICE_PRESETS["aim-like"], model_name="mixtral"))
    for passes in ((), PIPELINE):
        prog = PassManager(passes).compile(lower_decode_graph, gm, DEVICE_PRESETS["aim-like"], model_name="mixtral")
        _same(ref, _run(prog))
