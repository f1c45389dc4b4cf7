"""Batched host kernels of a prefill program (``nhil.runtime.host_batch``) against the per-token kernels.

The reference is ``nhil.runtime.host_kernels.KERNELS``: the kernel a decode step calls, once per token. A
batched call of T tokens must write every token's output with the same bits (compared as uint32), at the
sizes real models use (SmolLM2: hidden 576, MLP 1536, 9 heads x 64) and at sizes that are not multiples of
:data:`ALIGN` for the kernels that have no transcendental. Grouping refuses what it cannot batch exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from nhil.runtime.host_batch import ALIGN, BATCHED, batch_reason, group_host_calls
from nhil.runtime.host_kernels import KERNELS
from nhil.runtime.host_threads import one_thread

T = 7  # prompt tokens per group (odd, so no size lines up with a vector width by accident)


def _f(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# name, attrs, per-token input builders (rng, t) -> value, shared input positions' builders, output sizes
def _cases():
    H, L, hd = 3, 64, 64
    rows = []

    def add(name, attrs, per_token, shared, out_sizes, id_):
        rows.append(pytest.param(name, attrs, per_token, shared, out_sizes, id=id_))

    for n in (576, 72):  # aligned (SmolLM2 hidden) and not: rms_norm has no transcendental
        add("rms_norm", {"eps": 1e-5}, {0: lambda r, t, n=n: _f(r, n)}, {1: lambda r, n=n: _f(r, n)}, [n], f"rms_norm-{n}")
    add("rms_norm", {"eps": 1e-6, "head_dim": 24, "unit_offset": True}, {0: lambda r, t: _f(r, 72)}, {1: lambda r: _f(r, 24)}, [72], "rms_norm-per-head")
    add("layer_norm", {"eps": 1e-5}, {0: lambda r, t: _f(r, 96, scale=3.0)}, {1: lambda r: _f(r, 96), 2: lambda r: _f(r, 96)}, [96], "layer_norm")
    add("layer_norm", {"eps": 1e-5, "has_weight": False, "has_bias": False, "width": 24}, {0: lambda r, t: _f(r, 72)}, {}, [72], "layer_norm-width")
    add("rope", {"head_dim": hd}, {0: lambda r, t: _f(r, H * hd), 1: lambda r, t: _f(r, hd), 2: lambda r, t: _f(r, hd)}, {}, [H * hd], "rope")
    add("rope", {"head_dim": 40, "rotary_dim": 20, "style": "rotate_half"},
        {0: lambda r, t: _f(r, 120), 1: lambda r, t: _f(r, 20), 2: lambda r, t: _f(r, 20)}, {}, [120], "rope-partial")
    add("rope", {"head_dim": 64, "style": "split_half"}, {0: lambda r, t: _f(r, 128), 1: lambda r, t: _f(r, 32), 2: lambda r, t: _f(r, 32)}, {}, [128],
        "rope-split-half")
    inv = lambda r: (1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64))).astype(np.float32)  # noqa: E731
    add("rope_cos_sin", {"attention_scaling": 1.0}, {0: lambda r, t: 3 + 5 * t}, {1: inv}, [64, 64], "rope_cos_sin")
    add("rope_cos_sin", {"attention_scaling": 0.5, "half": True}, {0: lambda r, t: 7 * t}, {1: lambda r: np.linspace(1, 1e-3, 64, dtype=np.float32)},
        [64, 64], "rope_cos_sin-half")
    add("embedding", {"scale": 24.0}, {1: lambda r, t: int(r.integers(0, 50))}, {0: lambda r: _f(r, 50, 40)}, [40], "embedding")
    add("pos_embedding", {}, {0: lambda r, t: _f(r, 40), 2: lambda r, t: 2 * t}, {1: lambda r: _f(r, 32, 40)}, [40], "pos_embedding")
    for n in (576, 72):
        add("add", {}, {0: lambda r, t, n=n: _f(r, n), 1: lambda r, t, n=n: _f(r, n)}, {}, [n], f"add-{n}")
    add("narrow", {"start": 5, "length": 30}, {0: lambda r, t: _f(r, 72)}, {}, [30], "narrow")
    add("silu_mul", {}, {0: lambda r, t: _f(r, 1536, scale=4.0), 1: lambda r, t: _f(r, 1536)}, {}, [1536], "silu_mul")
    add("gelu_mul", {"approximate": "tanh"}, {0: lambda r, t: _f(r, 256, scale=4.0), 1: lambda r, t: _f(r, 256)}, {}, [256], "gelu_mul")
    add("gelu", {"variant": "gelu_new"}, {0: lambda r, t: _f(r, 128, scale=4.0)}, {}, [128], "gelu")
    add("softcap", {"cap": 30.0}, {0: lambda r, t: _f(r, 128, scale=40.0)}, {}, [128], "softcap")
    sm = {"num_heads": H, "max_len": L, "scale": 0.125}
    pos = lambda r, t: 10 + 3 * t  # noqa: E731  (each token its own causal row)
    add("masked_softmax", sm, {0: lambda r, t: _f(r, H * L, scale=8.0), 1: pos}, {}, [H * L], "masked_softmax")
    add("masked_softmax", {**sm, "window": 8}, {0: lambda r, t: _f(r, H * L, scale=8.0), 1: pos}, {}, [H * L], "masked_softmax-window")
    add("masked_softmax", {**sm, "softcap": 50.0}, {0: lambda r, t: _f(r, H * L, scale=8.0), 1: pos}, {}, [H * L], "masked_softmax-softcap")
    add("masked_softmax", {**sm, "sinks": True}, {0: lambda r, t: _f(r, H * L, scale=8.0), 1: pos}, {2: lambda r: _f(r, H)}, [H * L], "masked_softmax-sinks")
    # an exact kernel at an odd size: masked_softmax without softcap only reduces row by row
    add("masked_softmax", {"num_heads": 2, "max_len": 37, "scale": 0.3}, {0: lambda r, t: _f(r, 74, scale=8.0), 1: lambda r, t: 4 + 4 * t}, {}, [74],
        "masked_softmax-odd")
    return rows


def _build(per_token, shared, seed=0):
    rng = np.random.default_rng(seed)
    sh = {p: b(rng) for p, b in shared.items()}
    n_in = max([*per_token, *shared]) + 1
    toks = [[sh[p] if p in sh else per_token[p](rng, t) for p in range(n_in)] for t in range(T)]
    return sh, toks


def _batched_outputs(name, attrs, per_token, shared, out_sizes):
    sh, toks = _build(per_token, shared)
    ins = [sh[p] if p in sh else [tok[p] for tok in toks] for p in range(len(toks[0]))]
    outs = [[np.full(n, np.nan, np.float32) for _ in range(T)] for n in out_sizes]
    with one_thread():
        BATCHED[name].fn(ins, outs, **attrs)
    ref = [[np.full(n, np.nan, np.float32) for _ in range(T)] for n in out_sizes]
    with one_thread():
        for t, tok in enumerate(toks):
            KERNELS[name](tok, [r[t] for r in ref], {"token": 0, "pos": t}, **attrs)
    return outs, ref


@pytest.mark.parametrize("name, attrs, per_token, shared, out_sizes", _cases())
def test_batched_kernel_equals_per_token_calls_bit_for_bit(name, attrs, per_token, shared, out_sizes):
    members = [([f"in{p}" if p in shared else f"in{p}@{t}" for p in range(max([*per_token, *shared]) + 1)], [f"out@{t}"]) for t in range(T)]
    assert batch_reason(name, attrs, members, out_sizes) is None  # every case here is one the runner batches
    outs, ref = _batched_outputs(name, attrs, per_token, shared, out_sizes)
    for j, (o, r) in enumerate(zip(outs, ref)):
        for t in range(T):
            assert not np.isnan(r[t]).all(), "the per-token kernel wrote nothing"
            np.testing.assert_array_equal(o[t].view(np.uint32), r[t].view(np.uint32), err_msg=f"{name} output {j} token {t}")


def test_every_batched_kernel_is_covered():
    assert {c.values[0] for c in _cases()} == set(BATCHED)


def _members(T_, shared_in=True):
    return [(["w" if shared_in else f"w{t}", f"x@{t}"], [f"y@{t}"]) for t in range(T_)]


def test_batch_reason_refuses_what_would_change_bits():
    ok = [([f"g@{t}", f"u@{t}"], [f"y@{t}"]) for t in range(4)]
    assert batch_reason("silu_mul", {}, ok, [1536]) is None
    # a transcendental at a size that is not a multiple of ALIGN: the per-token call's scalar tail would move
    assert "multiples of 64" in batch_reason("silu_mul", {}, ok, [1536 + 8])
    assert ALIGN == 64
    assert "multiples" in batch_reason("masked_softmax", {"softcap": 50.0}, ok, [3 * 37])
    assert batch_reason("masked_softmax", {"softcap": None}, ok, [3 * 37]) is None  # softmax itself is row-wise
    assert batch_reason("rms_norm", {"eps": 1e-5}, [([f"x@{t}", "w"], [f"y@{t}"]) for t in range(3)], [72]) is None
    # the weight (input 1) must be one buffer for all members
    assert "not shared" in batch_reason("rms_norm", {"eps": 1e-5}, [([f"x@{t}", f"w{t}"], [f"y@{t}"]) for t in range(3)], [576])
    # a member that reads what an earlier member writes must run after it
    chain = [(["a@0", "b@0"], ["c@0"]), (["c@0", "b@1"], ["c@1"])]
    assert "another's output" in batch_reason("add", {}, chain, [576])
    assert "no batched form" in batch_reason("moe_route", {}, ok, [8])
    assert batch_reason("add", {}, ok[:1], [576]) == "a single call"


def _prog(ops):
    return SimpleNamespace(host_ops=[SimpleNamespace(kernel=k, attrs=a, inputs=i, outputs=o) for k, a, i, o in ops])


def test_group_host_calls_groups_runs_of_distinct_tokens_only():
    ops = [
        ("rms_norm", {"eps": 1e-5}, ["x@0", "w"], ["h@0"]),
        ("rms_norm", {"eps": 1e-5}, ["x@1", "w"], ["h@1"]),
        ("rms_norm", {"eps": 1e-5}, ["x@2", "w"], ["h@2"]),
        ("rms_norm", {"eps": 1e-6}, ["x@3", "w"], ["h@3"]),  # other attributes: a new run
        ("moe_route", {}, ["r@0"], ["s@0"]),  # no batched form
        ("add", {}, ["a@0", "b@0"], ["c@0"]),
        ("add", {}, ["a@0", "b@0"], ["c@9"]),  # the same token again: not one group
        ("silu_mul", {}, ["g@0", "u@0"], ["m@0"]),
        ("silu_mul", {}, ["g@1", "u@1"], ["m@1"]),
    ]
    host_token = [0, 1, 2, 3, 0, 0, 0, 0, 1]
    sizes = {"h@0": 576, "h@1": 576, "h@2": 576, "h@3": 576, "c@0": 576, "c@9": 576, "m@0": 1000, "m@1": 1000}
    segs = [("host", i) for i in range(5)] + [("dev", [0])] + [("host", i) for i in range(5, 9)]
    got = group_host_calls(_prog(ops), segs, host_token, sizes)
    assert got == [("hosts", [0, 1, 2]), ("host", 3), ("host", 4), ("dev", [0]), ("host", 5), ("host", 6),
                   ("host", 7), ("host", 8)]  # silu_mul of 1000 per token is not a multiple of ALIGN
    sizes.update({"m@0": 1024, "m@1": 1024})
    assert group_host_calls(_prog(ops), segs, host_token, sizes)[-1] == ("hosts", [7, 8])


def test_grouped_runner_rejects_bad_token_like_per_token_call():
    """A bad token id inside a group fails with the per-token kernel's message, not a deep traceback."""
    from nhil.errors import RunError

    table = np.zeros((10, 8), np.float32)
    outs = [[np.zeros(8, np.float32) for _ in range(2)]]
    with pytest.raises(RunError, match="token id 12 outside the vocabulary of 10"):
        BATCHED["embedding"].fn([table, [3, 12]], outs)
