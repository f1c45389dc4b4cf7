"""Batched decode in the timing model (``nhil.timing.batch``) against the engine, exact enumeration and hand-computed rooflines."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from nhil.compiler.shape_only import ShapeConfig, compile_shape_only
from nhil.timing.batch import active_experts, batch_table
from nhil.timing.report import analyze
from nhil.timing.table import timing_for

DENSE = ShapeConfig("dense-small", 1024, 2048, 2, 8, 2, 4096, 128)
MOE = ShapeConfig("moe-small", 1024, 2048, 2, 8, 2, 4096, 128, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def dense():
    p = compile_shape_only(DENSE, max_cache_len=64)
    return p, analyze(p)


@pytest.fixture(scope="module")
def moe():
    p = compile_shape_only(MOE, max_cache_len=64)
    return p, analyze(p)


def test_batch_one_is_the_engine_step(dense, moe):
    for p, rep in (dense, moe):
        t = batch_table(p, batches=(1,), report=rep)
        assert t["rows"][0]["cycles_per_step"] == rep["cycles_per_token"]
        assert t["rows"][0]["pim_tokens_per_s"] == pytest.approx(rep["tokens_per_s"], rel=1e-12)


def test_active_experts_equals_exact_enumeration_of_top_k_routing():
    """Expected distinct experts when each of B tokens picks a uniform k-subset of E: enumerate every choice."""
    for E, k, B in [(4, 2, 3), (5, 1, 4), (6, 3, 2)]:
        subsets = list(itertools.combinations(range(E), k))
        total = sum(len(set().union(*c)) for c in itertools.product(subsets, repeat=B))
        exact = Fraction(total, len(subsets) ** B)
        assert active_experts(B, E, k) == pytest.approx(float(exact), rel=1e-12)


def test_gpu_roofline_by_hand_and_pim_gemv_by_the_row_formula(dense):
    p, rep = dense
    t = batch_table(p, batches=(1, 8), report=rep, gpu_gbs=1000.0, gpu_tflops=1e9)  # compute effectively unbounded
    T = timing_for(p.device)
    for row in t["rows"]:
        B = row["batch"]
        by_hand = B * 1000.0e9 / (rep["weight_bytes"] + B * rep["kv_bytes"])  # weights read once per step, KV per sequence
        assert row["gpu_tokens_per_s"] == pytest.approx(by_hand, rel=1e-9) and row["gpu_bound"] == "HBM"
    # every weight MAC of this config streams a whole 64-burst row: rc(8*64) / rc(64) by the table's formula
    n = p.device.bursts_per_row
    ratio = T.mac_row_cycles(8 * n) / T.mac_row_cycles(n)
    assert ratio == pytest.approx((T.nRCDRDMAC + T.nCCD * (8 * n - 1) + T.nRTP + T.nRP) / 218)
    g1 = rep["exposed_cycles_by_kind"]["MAC_AB.gemv"]
    r8 = t["rows"][1]
    assert r8["cycles"]["gemv"] == pytest.approx(g1 * ratio, rel=1e-12)
    assert r8["cycles"]["sync"] == rep["exposed_cycles_by_kind"]["SYNC"]  # the batch shares the step's hand-offs


def test_compute_bound_gpu_and_batched_pim_are_monotone(dense, moe):
    p, rep = dense
    t = batch_table(p, report=rep, gpu_tflops=1.0)  # a 1 TFLOP/s GPU: compute-bound from B = 1
    assert all(r["gpu_bound"] == "compute" for r in t["rows"])
    flops_per_token = 2 * rep["weight_bytes"] / 2  # bf16: bytes / 2 weights, 2 FLOPs each
    assert t["rows"][0]["gpu_tokens_per_s"] == pytest.approx(1e12 / flops_per_token, rel=1e-9)
    for p, rep in (dense, moe):
        rows = batch_table(p, report=rep)["rows"]
        tok = [r["pim_tokens_per_s"] for r in rows]
        assert all(b > a for a, b in zip(tok, tok[1:]))  # sharing row activations never costs tokens/s
        assert tok[-1] / tok[0] < 32  # but the MACs still scale with B: far from linear
    rows = batch_table(*moe[:1], report=moe[1])["rows"]
    assert rows[0]["active_experts"] == pytest.approx(2.0) and rows[-1]["active_experts"] == pytest.approx(4 * (1 - 0.5**32))
