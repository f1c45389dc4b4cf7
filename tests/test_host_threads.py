"""Host kernels run on one PyTorch thread (``nhil.runtime.host_threads``) give the bits they give on two.

The runtime runs the kernels of ``SERIAL_SAFE`` on one intra-op thread when every tensor is
below PyTorch's parallel grain; the device-numerics reference runs the same
``torch.ops.nhil`` kernels with the process's thread count. Each kernel is called here with
1 and with 2 threads on random data (sizes of real models, up to just under the grain) and
the outputs compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nhil.runtime.host_kernels import KERNELS
from nhil.runtime.host_threads import GRAIN, SERIAL_SAFE, one_thread, serial_ok

R = np.random.default_rng(3)


def _f(n, scale=1.0):
    return (R.standard_normal(n) * scale).astype(np.float32)


# kernel, inputs, output sizes, attrs, ctx
CASES = [
    ("masked_softmax", [_f(9 * 80, 30.0), 41], [9 * 80], dict(num_heads=9, max_len=80, scale=0.125), {}),
    ("masked_softmax", [_f(32 * 1000, 30.0), 700], [32 * 1000], dict(num_heads=32, max_len=1000, scale=0.125, window=512, softcap=50.0), {}),
    ("rms_norm", [_f(576), _f(576)], [576], dict(eps=1e-5), {}),
    ("rms_norm", [_f(32 * 128), _f(128)], [32 * 128], dict(eps=1e-6, head_dim=128, unit_offset=True), {}),
    ("rope", [_f(9 * 64), _f(64), _f(64)], [9 * 64], dict(head_dim=64), {}),
    ("silu_mul", [_f(GRAIN - 8, 4.0), _f(GRAIN - 8)], [GRAIN - 8], {}, {}),
    ("gelu_mul", [_f(14336, 4.0), _f(14336)], [14336], {}, {}),
    ("add", [_f(GRAIN - 1), _f(GRAIN - 1)], [GRAIN - 1], {}, {}),
    ("softcap", [_f(4096, 40.0)], [4096], dict(cap=30.0), {}),
    ("layer_norm", [_f(768), _f(768), _f(768)], [768], dict(eps=1e-5), {}),
    ("gelu", [_f(3072, 3.0)], [3072], dict(variant="gelu_new"), {}),
]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 PyTorch threads to compare against (this process has 1)")
@pytest.mark.parametrize("name,inputs,outs,attrs,ctx", CASES, ids=[f"{c[0]}-{c[2][0]}" for c in CASES])
def test_one_thread_equals_two(name, inputs, outs, attrs, ctx):
    assert serial_ok(name, [int(np.size(a)) for a in inputs] + outs)
    got = {}
    for serial in (False, True):
        o = [np.zeros(n, np.float32) for n in outs]
        if serial:
            with one_thread():
                assert torch.get_num_threads() == 1
                KERNELS[name](list(inputs), o, dict(ctx), **attrs)
        else:
            assert torch.get_num_threads() >= 2
            KERNELS[name](list(inputs), o, dict(ctx), **attrs)
        got[serial] = o[0].view(np.uint32).copy()
    assert np.array_equal(got[False], got[True])
    assert np.isfinite(got[True].view(np.float32)).any()


def test_thread_count_is_restored_and_large_or_blas_calls_stay_parallel():
    n = torch.get_num_threads()
    with pytest.raises(ValueError):
        with one_thread():
            raise ValueError("inside")
    assert torch.get_num_threads() == n
    assert not serial_ok("silu_mul", [GRAIN, GRAIN, GRAIN])  # at the grain a loop may split across threads
    assert not serial_ok("aten_graph", [4])  # host ATen regions may hold MKL matmuls
    assert "aten_graph" not in SERIAL_SAFE and "ssm_update" not in SERIAL_SAFE
