"""bf16 conversion and the MAC contract against independent references (torch, ml_dtypes, hand cases)."""

import math
import struct

import ml_dtypes
import numpy as np
import torch

from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits, f32_to_bf16_bits_np
from nhil.numerics.mac import burst_dot16, mac_bursts, reference_gemv

EDGE = np.array(
    [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 3.4e38, -3.4e38, 3.3895314e38, np.inf, -np.inf, 1e-40, -1e-45, 1.1754944e-38, 65504.0, 1 + 2**-8, 1 + 3 * 2**-8],
    dtype=np.float32,
)


def _random_f32(n, seed):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return x[~np.isnan(x)]


def test_bf16_rne_matches_torch_and_ml_dtypes():
    x = np.concatenate([EDGE, _random_f32(200_000, 0), np.random.default_rng(1).normal(size=10_000).astype(np.float32)])
    ours = f32_to_bf16_bits(x)
    ref_torch = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    ref_ml = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, ref_torch)
    np.testing.assert_array_equal(ours, ref_ml)


def test_bf16_ties_to_even_hand_cases():
    # 1 + 2^-8 is exactly halfway between 1.0 and 1+2^-7: ties to even -> 1.0 (0x3F80)
    assert f32_to_bf16_bits(np.float32(1 + 2**-8)) == 0x3F80
    # 1 + 3*2^-8 is halfway between 1+2^-7 (odd mantissa 1) and 1+2^-6: ties to even -> 0x3F82
    assert f32_to_bf16_bits(np.float32(1 + 3 * 2**-8)) == 0x3F82
    # largest finite fp32 rounds up to infinity in bf16
    assert f32_to_bf16_bits(np.float32(3.4028235e38)) == 0x7F80


def test_bf16_nan_is_canonical():
    nans = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    assert (f32_to_bf16_bits(nans) == 0x7FC0).all()


def test_bf16_compiled_rounding_equals_the_numpy_expression_and_torch():
    """Every bf16 upper half with the lower halves at and around the rounding tie (0x7FFF/0x8000/0x8001), the
    extremes, NaN payloads of both signs, random patterns; in a 2-D and a strided (non-contiguous) array."""
    hi = np.arange(2**16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    rnd = np.random.default_rng(3).integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([(hi[:, None] | lo[None, :]).ravel(), rnd]).view(np.float32)
    got = f32_to_bf16_bits(x)
    np.testing.assert_array_equal(got, f32_to_bf16_bits_np(x))
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], torch.from_numpy(x[finite]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert (got[~finite] == 0x7FC0).all()
    m = x[: 6 * 4096].reshape(4096, 6)
    np.testing.assert_array_equal(f32_to_bf16_bits(m), f32_to_bf16_bits_np(m))
    np.testing.assert_array_equal(f32_to_bf16_bits(m[:, ::2]), f32_to_bf16_bits_np(m)[:, ::2])


def test_bf16_widen_is_exact():
    b = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    f = bf16_bits_to_f32(b)
    ref = b.view(ml_dtypes.bfloat16).astype(np.float32)
    same = (f.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(f) & np.isnan(ref))
    assert same.all()


def _tree_loop(prods):
    """Independent dot16: explicit Python loop over the tree, each add rounded to fp32 via struct."""

    def f32(v):
        return struct.unpack("<f", struct.pack("<f", v))[0]

    level = [f32(p) for p in prods]
    while len(level) > 1:
        level = [f32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def test_dot16_pairwise_order_hand_case():
    # products [2^24, 1, 1, 1, 0...]: tree: (2^24+1)->2^24 (tie to even), (1+1)=2, then 2^24+2 exact.
    # A left-to-right loop would give 2^24 (each +1 is lost): the order is observable.
    w = np.zeros(16, np.float32)
    w[:4] = [2.0**24, 1, 1, 1]
    a = np.ones(16, np.float32)
    assert burst_dot16(w, a)[0] == np.float32(16777218.0)
    seq = np.float32(0)
    for v in w:
        seq = np.float32(seq + v)
    assert seq == np.float32(16777216.0)


def test_mac_matches_independent_loop_on_random_bf16():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 5))
        w = bf16_bits_to_f32(f32_to_bf16_bits(rng.normal(size=16 * n).astype(np.float32) * 10 ** rng.uniform(-3, 3)))
        a = bf16_bits_to_f32(f32_to_bf16_bits(rng.normal(size=16 * n).astype(np.float32)))
        acc0 = np.float32(rng.normal())
        got = mac_bursts(np.array(acc0, np.float32), w, a)
        ref = float(acc0)
        for j in range(n):
            prods = [float(np.float32(w[16 * j + i]) * np.float32(a[16 * j + i])) for i in range(16)]
            ref = struct.unpack("<f", struct.pack("<f", ref + _tree_loop(prods)))[0]
        assert got.view(np.uint32) == np.float32(ref).view(np.uint32)


def test_mac_special_values():
    one = np.ones(16, np.float32)
    # NaN anywhere -> canonical NaN
    w = one.copy()
    w[5] = np.nan
    assert mac_bursts(np.float32(0), w, one).view(np.uint32) == 0x7FC00000
    # inf + -inf -> NaN (canonical)
    w = np.zeros(16, np.float32)
    w[0], w[1] = np.inf, -np.inf
    assert mac_bursts(np.float32(0), w, one).view(np.uint32) == 0x7FC00000
    # overflow of a product -> inf
    w = np.zeros(16, np.float32)
    w[0] = 2.0**127
    a = one * 4
    assert mac_bursts(np.float32(0), w, a) == np.inf
    # signed zeros: -0 accumulator plus products -0 stays -0; +0 product makes it +0
    negz = np.float32(-0.0)
    r = mac_bursts(np.array(negz), -one, np.zeros(16, np.float32))
    assert r.view(np.uint32) == 0x80000000
    r = mac_bursts(np.array(negz), one, np.zeros(16, np.float32))
    assert r.view(np.uint32) == 0
    # subnormal product kept (no flush to zero): 2^-100 * 2^-40 = 2^-140
    w = np.zeros(16, np.float32)
    w[0] = 2.0**-100
    a = np.zeros(16, np.float32)
    a[0] = 2.0**-40
    r = mac_bursts(np.float32(0), w, a)
    assert r == np.float32(2.0**-140) and r != 0


def test_reference_gemv_close_to_float64():
    rng = np.random.default_rng(5)
    w = rng.normal(size=(37, 100)).astype(np.float32)
    x = rng.normal(size=100).astype(np.float32)
    wb, xb = f32_to_bf16_bits(w), f32_to_bf16_bits(x)
    y = reference_gemv(wb, xb)
    exact = bf16_bits_to_f32(wb).astype(np.float64) @ bf16_bits_to_f32(xb).astype(np.float64)
    # fp32 accumulation of 100 products: error bound ~ K * 2^-24 * sum|p|
    bound = 100 * 2.0**-24 * (np.abs(bf16_bits_to_f32(wb)) @ np.abs(bf16_bits_to_f32(xb)))
    assert np.all(np.abs(y - exact) <= bound)
    assert not math.isnan(float(y.sum()))
