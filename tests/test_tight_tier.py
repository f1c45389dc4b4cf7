"""The tight tier of verify (nhil.golden.tight): target == device-numerics reference, bit for bit.

Each mutation below is a bug a simulator, host kernel or lowering could have that stays
within bf16 noise of the fp32 golden. The tight tier must catch every one as MISMATCH and
name the right layer; where the accuracy tier alone would pass, the test says so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nhil.golden.tight import compare_bits
from nhil.runtime import host_kernels
from nhil.verify import VerifyOptions, verify

pytestmark = pytest.mark.sim

ACCURACY = ("teacher_forced_top1", "logits_within_tolerance", "free_running_tokens", "hidden_states_within_tolerance")


@pytest.fixture
def dirs(tmp_path):
    return dict(goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs")


def _run(model, dirs, tokens=8, **kw):
    rep = verify(VerifyOptions(model=model, target="sim", tokens=tokens, **dirs, **kw))
    assert rep["outcome"] in ("PASS", "MISMATCH"), rep.get("error")
    return rep


def _checks(rep):
    return {c["name"]: c["passed"] for c in rep["checks"]}


def _caught(rep, layer: str, accuracy_alone_passes: bool | None):
    """MISMATCH from the tight tier, first difference in ``layer`` (an act name or "logits")."""
    assert rep["outcome"] == "MISMATCH"
    c = _checks(rep)
    assert c["tight_bit_identical_to_reference"] is False
    fd = rep["tight"]["first_difference"]
    assert fd["tensor"] == layer, fd
    assert fd["reference_bits"] != fd["target_bits"]
    assert "tight" in rep["failed_tier"]
    if accuracy_alone_passes:
        assert all(c[k] for k in ACCURACY if k in c), c  # the accuracy tier alone would have passed this bug
    assert "does not compute what the compiler meant" in rep["divergence_summary"]


def _wrap(monkeypatch, name, fn):
    """Replace host kernel ``name`` by ``fn(real, ...)`` (same signature, so the program still validates at load)."""
    import functools

    real = host_kernels.KERNELS[name]

    @functools.wraps(real)
    def mutant(ins, outs, ctx, **a):
        return fn(real, ins, outs, ctx, **a)

    monkeypatch.setitem(host_kernels.KERNELS, name, mutant)


def test_unmutated_zoo_families_are_bit_identical(dirs):
    for model in ("gemma2", "gpt_oss"):
        rep = _run(model, dirs)
        assert rep["tight"]["passed"] and rep["tight"]["elements_compared"] > 1000, rep["tight"]


def test_soft_cap_dropped_in_the_host_softmax(dirs, monkeypatch):
    _wrap(monkeypatch, "masked_softmax", lambda real, ins, outs, ctx, softcap=None, **a: real(ins, outs, ctx, **a))
    _caught(_run("gemma2", dirs), "model.layers.0", accuracy_alone_passes=True)


def test_sliding_window_one_key_too_wide(dirs, monkeypatch):
    _wrap(monkeypatch, "masked_softmax", lambda real, ins, outs, ctx, window=None, **a: real(ins, outs, ctx, window=None if window is None else window + 1, **a))
    rep = _run("mistral", dirs)  # window 8 on every layer; prompt 6 + 8 tokens reaches position 13
    _caught(rep, "model.layers.0", accuracy_alone_passes=None)
    assert rep["tight"]["first_difference"]["position"] == 8  # the first query that would see one key too many


def _rope_interleaved(real, ins, outs, ctx, head_dim, rotary_dim=None, style="rotate_half"):
    """RoPE with pairs (x0, x1), (x2, x3), ... rotated instead of rotate-half (x_i, x_{i+d/2})."""
    x, cos, sin = (np.asarray(a, np.float32) for a in ins)
    xh = torch.from_numpy(x.copy()).reshape(-1, head_dim)
    c, s = torch.from_numpy(cos.copy()).reshape(1, -1), torch.from_numpy(sin.copy()).reshape(1, -1)
    rot = torch.stack([-xh[:, 1::2], xh[:, 0::2]], dim=-1).reshape(xh.shape)
    outs[0][:] = (xh * c + rot * s).reshape(-1).numpy()


def test_rope_rotate_half_swapped_for_interleaved(dirs, monkeypatch):
    _wrap(monkeypatch, "rope", _rope_interleaved)
    _caught(_run("llama-tiny", dirs), "model.layers.0", accuracy_alone_passes=None)


def test_attention_sink_dropped(dirs, monkeypatch):
    def no_sinks(real, ins, outs, ctx, sinks=False, **a):
        return real(ins[:2], outs, ctx, **a)

    _wrap(monkeypatch, "masked_softmax", no_sinks)
    _caught(_run("gpt_oss", dirs), "model.layers.0", accuracy_alone_passes=None)


def test_moe_renormalisation_skipped(dirs, monkeypatch):
    _wrap(monkeypatch, "moe_route", lambda real, ins, outs, ctx, norm_topk_prob=True, **a: real(ins, outs, ctx, norm_topk_prob=False, **a))
    _caught(_run("mixtral", dirs), "model.layers.0", accuracy_alone_passes=None)


def test_burst_summed_in_the_wrong_order(dirs, monkeypatch):
    """The simulator accumulates a MAC's bursts last to first: the same sum re-associated, an ulp-level bug."""
    from nhil.numerics.mac import burst_dot16, canonicalize_nan
    from nhil.targets.sim import device as dev_mod

    def reversed_order(acc, w, a):
        s = burst_dot16(w, a)
        out = np.array(np.broadcast_to(acc, s.shape[:-1]), dtype=np.float32, copy=True)
        with np.errstate(all="ignore"):
            for j in reversed(range(s.shape[-1])):
                np.add(out, s[..., j], out=out)
        return canonicalize_nan(out)

    from nhil.targets.sim import kernels

    monkeypatch.setattr(dev_mod, "mac_bursts", reversed_order)
    monkeypatch.setattr(kernels, "AVAILABLE", False)  # every MAC through PimState.step, where the mutation sits
    _caught(_run("llama-tiny", dirs), "model.layers.0", accuracy_alone_passes=True)


def test_compare_bits_names_the_earliest_position_then_the_first_layer():
    ref = {"act.model.embed_tokens": np.zeros((4, 3), np.float32), "act.model.layers.0": np.ones((4, 3), np.float32),
           "act.model.layers.1": np.ones((4, 3), np.float32)}
    got = {k: v.copy() for k, v in ref.items()}
    got["act.model.layers.1"][1, 2] = np.nextafter(np.float32(1), np.float32(2))  # one ulp, position 1
    got["act.model.layers.0"][2, 0] = 5.0  # later position, earlier layer
    logits = np.zeros((2, 5), np.float32)
    r = compare_bits(logits, logits.copy(), ref, got, prompt_len=3, layer_order=sorted(ref))
    fd = r["first_difference"]
    assert not r["passed"] and fd["tensor"] == "model.layers.1" and fd["position"] == 1 and fd["element"] == 2
    assert fd["reference_bits"] == "0x3f800000" and fd["target_bits"] == "0x3f800001"
    got["act.model.layers.0"][1, 0] = -1.0  # now the same position: the earlier layer is named
    assert compare_bits(logits, logits.copy(), ref, got, 3, sorted(ref))["first_difference"]["tensor"] == "model.layers.0"
    canon = np.full((2, 5), 0x7FC00000, np.uint32).view(np.float32)
    other = canon.copy()
    other.view(np.uint32)[1, 4] = 0x7FC00001  # a NaN with another payload is a difference
    lg = compare_bits(canon, other, ref, ref, 3, sorted(ref))["first_difference"]
    assert lg["tensor"] == "logits" and lg["step"] == 1 and lg["element"] == 4 and lg["position"] == 3
    assert compare_bits(logits, logits.copy(), ref, {k: v.copy() for k, v in ref.items()}, 3, sorted(ref))["passed"]
