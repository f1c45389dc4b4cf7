"""Attribute validation at raise time (issue #15 item 7): a bad primitive attribute is a COMPILE_FAIL naming it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx

import nhil.compiler.primitives  # noqa: F401
from nhil.compiler.attr_checks import ATTR_CHECKS, check_attributes
from nhil.compiler.primitives import PRIMITIVES
from nhil.errors import CompileError

M = lambda *s: torch.empty(s, device="meta")  # noqa: E731


def _graph(op: str, *args, **kwargs) -> fx.GraphModule:
    """One nhil::<op> node whose tensor arguments are placeholders with meta values."""
    g = fx.Graph()
    fa = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            n = g.placeholder(f"t{i}")
            n.meta["val"] = a
            fa.append(n)
        else:
            fa.append(a)
    n = g.call_function(getattr(torch.ops.nhil, op).default, tuple(fa), kwargs)
    n.meta["nn_module_stack_path"] = "model.layers.3.self_attn"
    g.output(n)
    return fx.GraphModule({}, g)


def _attn(**kw):
    a = dict(window=None, softcap=None)
    a.update(kw)
    hq, hkv, scale = a.pop("hq", 4), a.pop("hkv", 2), a.pop("scale", 0.25)
    return _graph("attention_kv", M(1, 1, 64), M(1, 1, 32), M(1, 1, 32), M(1, 2, 8, 16), M(1, 2, 8, 16), M(1), hq, hkv, scale, a["window"], a["softcap"])


def _moe(*pos, **kw):
    base = [M(1, 1, 64), M(4, 64), M(4, 64, 64), M(4, 64, 32), 4, 2]
    for i, v in pos:
        base += ["softmax", True, "silu"][len(base) - 6 : i - 5]  # schema defaults up to position i
        base[i] = v
    return _graph("moe", *base, **kw)


BAD = [
    # (graph, message regex)
    (lambda: _attn(softcap=-5.0), r"nhil::attention_kv at model\.layers\.3\.self_attn: attribute softcap = -5\.0: must be a finite number > 0"),
    (lambda: _attn(softcap=0.0), r"attribute softcap = 0\.0: must be a finite number > 0"),
    (lambda: _attn(softcap=math.inf), r"attribute softcap = inf"),
    (lambda: _attn(window=0), r"attribute window = 0: must be an integer >= 1"),
    (lambda: _attn(hq=4, hkv=3), r"attribute num_heads % num_kv_heads = '4 % 3 = 1': num_kv_heads must divide num_heads"),
    (lambda: _attn(scale=math.nan), r"attribute scale = nan: must be a finite number > 0"),
    (lambda: _graph("softcap", M(1, 1, 8), -30.0), r"nhil::softcap .*attribute cap = -30\.0"),
    (lambda: _graph("rms_norm", M(1, 1, 64), M(64), 0.0), r"nhil::rms_norm .*attribute eps = 0\.0: must be a finite number > 0"),
    (lambda: _graph("rms_norm", M(1, 1, 64), M(64), math.inf), r"attribute eps = inf"),
    (lambda: _graph("rms_norm", M(1, 1, 64), M(12), 1e-6, 12), r"attribute head_dim = 12: must divide the normalised width 64"),
    (lambda: _graph("layer_norm", M(1, 1, 64), None, None, -1e-5), r"nhil::layer_norm .*attribute eps = -1e-05"),
    (lambda: _graph("embedding", M(256, 64), M(1, 1), math.nan), r"nhil::embedding .*attribute scale = nan"),
    (lambda: _graph("rope_cos_sin", M(1), torch.tensor([1.0, math.nan]), 1.0), r"attribute inv_freq = nan: .*rope_theta must be a finite number > 0"),
    (lambda: _graph("rope_cos_sin", M(1), torch.tensor([1.0, 0.5]), 0.0), r"attribute attention_scaling = 0\.0"),
    (lambda: _graph("rope", M(1, 1, 64), M(1, 1, 16), M(1, 1, 16), 16, 17), r"attribute rotary_dim = 17: must be an even integer in \[2, head_dim=16\]"),
    (lambda: _graph("rope", M(1, 1, 64), M(1, 1, 16), M(1, 1, 16), 24), r"attribute head_dim = 24: must divide the projection width 64"),
    (lambda: _graph("gelu_mul", M(1, 1, 8), M(1, 1, 8), "fast"), r"attribute approximate = 'fast': must be one of 'tanh', 'none'"),
    (lambda: _graph("narrow", M(1, 1, 8), -1, 4), r"attribute start = -1: must be an integer >= 0"),
    (lambda: _moe((5, 5)), r"nhil::moe .*attribute top_k = 5: must be <= num_experts=4"),
    (lambda: _moe((5, 0)), r"attribute top_k = 0: must be an integer >= 1"),
    (lambda: _moe((6, "relu")), r"attribute score_func = 'relu'"),
    (lambda: _moe(), None),  # valid
    (lambda: _moe((5, 2)), None),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_attribute_is_a_compile_error_naming_it(case):
    make, msg = BAD[case]
    gm = make()
    if msg is None:
        check_attributes(gm)  # a valid node passes
        return
    with pytest.raises(CompileError, match=msg) as e:
        check_attributes(gm)
    assert e.value.outcome == "COMPILE_FAIL" and "model.layers.3.self_attn" in str(e.value)


def test_moe_group_rules():
    bad = _graph("moe", M(1, 1, 64), M(4, 64), M(4, 64, 64), M(4, 64, 32), 4, 2, "sigmoid", True, "silu", None, 3, 1, 2.5)
    with pytest.raises(CompileError, match=r"attribute num_experts % n_group = '4 % 3 = 1'"):
        check_attributes(bad)
    bad = _graph("moe", M(1, 1, 64), M(4, 64), M(4, 64, 64), M(4, 64, 32), 4, 2, "sigmoid", True, "silu", None, 2, 3, 2.5)
    with pytest.raises(CompileError, match=r"attribute topk_group = 3: must be <= n_group=2"):
        check_attributes(bad)
    bad = _graph("moe", M(1, 1, 64), M(4, 64), M(4, 64, 64), M(4, 64, 32), 4, 2, "sigmoid", True, "silu", None, 2, 1, -1.0)
    with pytest.raises(CompileError, match=r"attribute routed_scaling_factor = -1\.0"):
        check_attributes(bad)


def test_mla_rules():
    bad = _graph("mla_kv", M(1, 1, 96), M(1, 1, 16), M(1, 1, 8), M(1, 1, 8, 16), M(1, 1, 8, 8), M(1), M(1, 1, 8), M(1, 1, 8), M(128, 16),
                 4, 16, 16, 7, 16, 0.1)
    with pytest.raises(CompileError, match=r"nhil::mla_kv .*attribute qk_rope_head_dim = 7: must be even"):
        check_attributes(bad)


def test_every_primitive_has_an_attribute_check():
    assert sorted(ATTR_CHECKS) == sorted(f"nhil::{p}" for p in PRIMITIVES)


def _gemma2(**overrides):
    import transformers

    from nhil.models.zoo import ZOO

    _, cls, kw, _ = ZOO["gemma2"]
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.Gemma2Config(**dict(kw, **overrides))).eval()


@pytest.mark.parametrize("cap", [-50.0, 0.0])
def test_gemma2_bad_softcap_is_compile_fail_at_raise(cap):
    """End to end: a tiny gemma2 whose config has a bad attention soft-cap ends COMPILE_FAIL at raise time,
    naming the attribute, its value and the attention module (a cap of 0 used to fail later with
    'max |diff| nan'; a negative cap was accepted)."""
    from nhil.compiler import export_decode, raise_graph

    ep, _ = export_decode(_gemma2(attn_logit_softcapping=cap), 16)
    with pytest.raises(CompileError, match=rf"nhil::attention_kv at model\.model\.layers\.0\.self_attn: attribute softcap = {cap!r}: must be a finite number > 0") as e:
        raise_graph(ep, "decode")
    assert e.value.outcome == "COMPILE_FAIL"


def test_gemma2_bad_final_softcap_is_compile_fail():
    from nhil.compiler import export_decode, raise_graph

    ep, _ = export_decode(_gemma2(final_logit_softcapping=-30.0), 16)
    with pytest.raises(CompileError, match=r"nhil::softcap at .*: attribute cap = -30\.0"):
        raise_graph(ep, "decode")
