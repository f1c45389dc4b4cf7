"""Near ties in the accuracy tier (nhil.golden.accuracy, nhil.golden.routing): reported with their margin, not failed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nhil.golden import accuracy
from nhil.golden.routing import routing_differences
from nhil.golden.tolerances import PROFILES
from nhil.models.zoo import ZOO
from nhil.verify import VerifyOptions, verify

PROFILE = "bf16-act-fp32-acc"
TH = PROFILES[PROFILE]


def _rows(margin: float, noise: float = 0.0, v: int = 64, seed: int = 0):
    """Golden logits [1, V] whose top-1 (token 0) leads token 1 by ``margin``; the target swaps them plus ``noise``."""
    g = np.random.default_rng(seed).normal(0, 1, (1, v)).astype(np.float32)
    g[0, 0], g[0, 1] = 5.0, 5.0 - margin
    t = g.copy()
    t[0, 0], t[0, 1] = g[0, 1], g[0, 0]  # the flip, everything else equal
    t += np.float32(noise)
    return g, t


def test_sigma_is_the_rms_error_the_sqnr_floor_allows():
    row = np.full(100, 2.0, np.float32)
    assert accuracy.logit_sigma(row, 20.0) == pytest.approx(0.2)  # 2 x 10^(-20/20), hand-computed


def test_top1_flip_within_two_sigma_is_a_near_tie_and_beyond_it_a_failure():
    floor = TH["logits"]["sqnr_db"]["min"]
    g, _ = _rows(0.0)
    sigma = accuracy.logit_sigma(g[0], floor)
    for margin, tie in ((0.5 * sigma, True), (1.9 * sigma, True), (2.2 * sigma, False)):  # sigma of the margin-0 row, within 1%
        g, t = _rows(margin)
        steps, fails, ties = accuracy.judge_steps(PROFILE, {}, TH, g, t, [0], prompt_len=3)
        assert steps[0]["target_token"] == 1 and steps[0]["passed"] is tie, (margin, sigma)
        assert (len(ties) == 1) is tie and (len(fails) == 0) is tie
        if tie:
            assert ties[0]["kind"] == "top1" and ties[0]["margin"] == pytest.approx(margin, rel=1e-5) and ties[0]["position"] == 2


def test_a_flip_on_a_step_that_fails_other_metrics_is_not_a_near_tie():
    g, t = _rows(1e-4)
    t[0, 2:] += 3.0  # the rest of the row is wrong too: SQNR and KL fail
    steps, fails, ties = accuracy.judge_steps(PROFILE, {}, TH, g, t, [0], prompt_len=3)
    assert not ties and fails and not steps[0]["passed"]


class _MoeGraph:
    """Just enough of a raised graph for routing_differences: one softmax top-2 nhil::moe node in layer 3."""

    def __init__(self):
        import torch.fx

        import nhil.compiler.primitives  # noqa: F401

        g = torch.fx.Graph()
        x = g.placeholder("x")
        n = g.call_function(torch.ops.nhil.moe.default, (x, x, x, x, 4, 2, "softmax", True))
        n.meta["nn_module_stack_path"] = "model.layers.3.mlp"
        g.output(n)
        self.graph = g


def test_routing_difference_on_a_near_tie_and_a_real_one():
    gm = _MoeGraph()
    golden = np.array([2.0, 1.0, 0.999, -1.0], np.float32)  # experts 0, 1 by 0.001 over expert 2
    near = golden.copy()
    near[1], near[2] = 0.998, 1.0005  # the device picks 0, 2
    clear = np.array([2.0, 1.0, 0.0, -1.0], np.float32)  # expert 1 leads expert 2 by 1.0: no tie
    far = np.array([2.0, -1.0, 1.5, 0.9], np.float32)  # the device picks 0, 2 anyway
    diffs = routing_differences(gm, [[golden], [golden], [clear]], [[golden], [near], [far]], prompt_len=2, hidden_sqnr_floor_db=30.0)
    assert [d["position"] for d in diffs] == [1, 2]
    tie, real = diffs
    sigma = float(np.sqrt(np.mean(golden.astype(np.float64) ** 2))) * 10 ** (-30 / 20)
    assert tie["near_tie"] and tie["layer"] == 3 and tie["golden_experts"] == [0, 1] and tie["device_experts"] == [0, 2]
    assert tie["gap"] == pytest.approx(0.001, abs=1e-6) and tie["sigma"] == pytest.approx(sigma) and tie["step"] == 0
    assert not real["near_tie"] and real["device_experts"] == [0, 2] and real["gap"] == pytest.approx(1.0)


@pytest.mark.sim
def test_mixtral_seed_0_routing_near_tie_is_reported_and_the_run_passes(tmp_path):
    """Seed 0 of the tiny Mixtral flips an expert selection at a router-logit gap of ~0.004 (measured): reported
    as a near tie, that position left out of the layer metrics, the run PASSES and the tight tier holds."""
    rep = verify(VerifyOptions(model="mixtral", target="sim", tokens=16, seed=0, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r"))
    assert rep["outcome"] == "PASS", rep["checks"]
    assert rep["tight"]["passed"]
    ties = [t for t in rep["near_ties"] if t["kind"] == "routing"]
    assert ties and all(t["gap"] <= t["sigma"] * 2 for t in ties)
    diffs = rep["routing_differences"]
    assert diffs and all(d["near_tie"] for d in diffs)
    assert any(row.get("positions_excluded") for row in rep["layers"])
    md = open(rep["run_dir"] + "/report.md").read()
    assert "## Near ties" in md and "expert selection at layer" in md


@pytest.mark.nightly
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("model", ["llama-tiny", *ZOO])
def test_every_family_passes_with_any_seed(model, seed, tmp_path):
    """No per-family seed: every zoo family passes with seeds 0-3 at the default 16 tokens (near ties reported)."""
    torch.manual_seed(0)
    rep = verify(VerifyOptions(model=model, target="sim", seed=seed, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "r", save_program=False))
    assert rep["outcome"] == "PASS", (rep.get("error"), [c for c in rep["checks"] if not c["passed"]])
