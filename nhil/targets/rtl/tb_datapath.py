"""cocotb unit tests of the datapath blocks (``rtl_stubs/pim_dp_probe.sv``, inside
``pim_sim_top``) against
``nhil.numerics`` (the numerics contract), run by ``tests/test_rtl.py``.

Each test drives the combinational probe with vectors (random bit patterns, values
biased towards the interesting regions, and hand-picked edge cases: ties to even,
overflow to infinity, NaN propagation to the canonical NaN, signed zeros, subnormal
inputs and results) and compares bit for bit. ``NHIL_DP_VECTORS`` sets the number of
random vectors per block (default 3000); ``COCOTB_RANDOM_SEED`` the seed.
"""

from __future__ import annotations

import os

import cocotb
import numpy as np
from cocotb.triggers import Timer

from nhil.numerics.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from nhil.numerics.mac import burst_dot16, canonicalize_nan, mac_bursts

N = int(os.environ.get("NHIL_DP_VECTORS", "3000"))
LANES = 16

BF16_EDGES = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7F7F, 0xFF7F, 0x0080, 0x8080, 0x0001, 0x8001, 0x007F, 0x0040,
              0x3F80, 0xBF80, 0x3F81, 0x4000, 0x1F80, 0x2000, 0x5F80, 0x6000, 0x0100, 0x3F00, 0x3E80, 0x0081]
F32_EDGES = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000,
             0x80800000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x3F800000, 0xBF800000, 0x33800000, 0xB3800000, 0x33800001,
             0x34000000, 0x3F800001, 0x3F7FFFFF, 0x4B000000, 0x3F000000, 0x00400000, 0x7F000000, 0x00FFFFFF, 0x3F808000, 0x3F818000,
             0x337FFFFF, 0x34400000]


def _rng() -> np.random.Generator:
    return np.random.default_rng(int(os.environ.get("COCOTB_RANDOM_SEED", "1")) & 0xFFFFFFFF)


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _bits(x) -> np.ndarray:
    return canonicalize_nan(np.array(x, dtype=np.float32)).view(np.uint32)


def random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    """fp32 bit patterns: a third uniform bits, a third ordinary magnitudes, a third tiny/subnormal/huge."""
    u = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    k = rng.integers(0, 3, n)
    exp = np.where(k == 1, rng.integers(100, 154, n), rng.choice([0, 1, 2, 3, 25, 26, 253, 254], n)).astype(np.uint32)
    man = (u & 0x7FFFFF) & np.where(rng.random(n) < 0.5, 0x7FFFFF, 0x7F0000).astype(np.uint32)  # some with short mantissas (ties)
    shaped = (u & 0x80000000) | (exp << 23) | man
    return np.where(k == 0, u, shaped).astype(np.uint32)


def partner(rng: np.random.Generator, a: np.ndarray) -> np.ndarray:
    """Second operands near ``a`` (exponent difference 0..30, either sign): cancellation and ties."""
    n = a.size
    ea = (a >> 23) & 0xFF
    eb = np.clip(ea.astype(np.int64) - rng.integers(0, 31, n), 0, 254).astype(np.uint32)
    man = rng.integers(0, 1 << 23, n, dtype=np.uint64).astype(np.uint32) & np.where(rng.random(n) < 0.5, 0x7FFFFF, 0x7C0000).astype(np.uint32)
    sign = rng.integers(0, 2, n, dtype=np.uint64).astype(np.uint32) << 31
    b = sign | (eb << 23) | man
    return np.where(rng.random(n) < 0.3, a ^ 0x80000000, b).astype(np.uint32)


def random_bf16(rng: np.random.Generator, n: int) -> np.ndarray:
    return (random_f32(rng, n) >> 16).astype(np.uint16)


async def _settle() -> None:
    await Timer(1, unit="ns")


def _fail(what: str, i: int, inputs: str, got: int, exp: int) -> str:
    return f"{what} vector {i}: {inputs}: RTL 0x{got:08x} != contract 0x{exp:08x}"


@cocotb.test()
async def mul_bf16_matches_contract(dut):
    """bf16 x bf16 -> fp32: all edge pairs + random pairs."""
    rng = _rng()
    e = np.array(BF16_EDGES, np.uint16)
    a = np.concatenate([np.repeat(e, e.size), random_bf16(rng, N), rng.integers(0, 1 << 16, N).astype(np.uint16)])
    b = np.concatenate([np.tile(e, e.size), random_bf16(rng, N), rng.integers(0, 1 << 16, N).astype(np.uint16)])
    with np.errstate(all="ignore"):
        exp = _bits(bf16_bits_to_f32(a) * bf16_bits_to_f32(b))
    bad = []
    for i in range(a.size):
        dut.mul_a.value = int(a[i])
        dut.mul_b.value = int(b[i])
        await _settle()
        got = dut.mul_y.value.to_unsigned()
        if got != int(exp[i]):
            bad.append(_fail("mul", i, f"0x{a[i]:04x} * 0x{b[i]:04x}", got, int(exp[i])))
    assert not bad, f"{len(bad)} of {a.size} mismatches; first: " + "; ".join(bad[:5])


@cocotb.test()
async def add_f32_matches_contract(dut):
    """fp32 + fp32 (RNE, subnormals, inf, NaN, signed zero): all edge pairs + random + near pairs."""
    rng = _rng()
    e = np.array(F32_EDGES, np.uint32)
    r = random_f32(rng, N)
    a = np.concatenate([np.repeat(e, e.size), r, random_f32(rng, N)])
    b = np.concatenate([np.tile(e, e.size), partner(rng, r), random_f32(rng, N)])
    with np.errstate(all="ignore"):
        exp = _bits(_f32(a) + _f32(b))
    bad = []
    for i in range(a.size):
        dut.add_a.value = int(a[i])
        dut.add_b.value = int(b[i])
        await _settle()
        got = dut.add_y.value.to_unsigned()
        if got != int(exp[i]):
            bad.append(_fail("add", i, f"0x{a[i]:08x} + 0x{b[i]:08x}", got, int(exp[i])))
    assert not bad, f"{len(bad)} of {a.size} mismatches; first: " + "; ".join(bad[:5])


@cocotb.test()
async def f32_to_bf16_matches_contract(dut):
    """RD_ACC bf16 format: fp32 -> bf16 RNE, NaN -> 0x7FC0."""
    rng = _rng()
    a = np.concatenate([np.array(F32_EDGES, np.uint32), random_f32(rng, N)])
    exp = f32_to_bf16_bits(_f32(a))
    bad = []
    for i in range(a.size):
        dut.cvt_a.value = int(a[i])
        await _settle()
        got = dut.cvt_y.value.to_unsigned()
        if got != int(exp[i]):
            bad.append(_fail("f32_to_bf16", i, f"0x{a[i]:08x}", got, int(exp[i])))
    assert not bad, f"{len(bad)} of {a.size} mismatches; first: " + "; ".join(bad[:5])


def _pack(lanes: np.ndarray) -> int:
    return int.from_bytes(np.ascontiguousarray(lanes, dtype="<u2").tobytes(), "little")


def mac_cases(rng: np.random.Generator, n: int):
    """(w[16], a[16], acc) bit patterns: normal data, mixed magnitudes, specials sprinkled in."""
    for i in range(n):
        kind = i % 4
        if kind == 0:  # ordinary activations/weights
            w = f32_to_bf16_bits(rng.normal(size=LANES).astype(np.float32))
            a = f32_to_bf16_bits(rng.normal(size=LANES).astype(np.float32) * 4)
        elif kind == 1:  # wide dynamic range: ties, cancellation, subnormal partial sums
            w = f32_to_bf16_bits((rng.normal(size=LANES) * 2.0 ** rng.integers(-140, 40, LANES)).astype(np.float32))
            a = f32_to_bf16_bits((rng.normal(size=LANES) * 2.0 ** rng.integers(-20, 20, LANES)).astype(np.float32))
        elif kind == 2:  # random bit patterns (NaN, inf, subnormal inputs)
            w = random_bf16(rng, LANES)
            a = random_bf16(rng, LANES)
        else:  # exact cancellation and signed zeros
            w = f32_to_bf16_bits(rng.integers(-3, 4, LANES).astype(np.float32))
            a = f32_to_bf16_bits(np.repeat(rng.integers(-2, 3, LANES // 2), 2).astype(np.float32))
            w[1::2] = w[0::2] ^ np.uint16(0x8000 * rng.integers(0, 2))
            if rng.random() < 0.3:
                w[:] = 0x8000
        acc = int(random_f32(rng, 1)[0]) if i % 3 else int(np.float32(rng.normal()).view(np.uint32))
        yield w.astype(np.uint16), a.astype(np.uint16), acc


@cocotb.test()
async def mac16_tree_matches_contract(dut):
    """dot16 (fixed pairwise tree) and acc + dot16 against nhil.numerics.mac."""
    rng = _rng()
    bad = []
    cases = list(mac_cases(rng, max(N // 3, 8)))
    # hand-made: a tie inside the tree (1 + 2^-24 -> 1 under RNE) and overflow of the sum to inf
    one, tiny = np.uint16(0x3F80), np.uint16(0x3380)  # 1.0, 2^-24
    w = np.zeros(LANES, np.uint16)
    w[0], w[1] = one, tiny
    cases.append((w, np.full(LANES, one, np.uint16), 0))
    w2 = np.full(LANES, 0x7F7F, np.uint16)
    cases.append((w2, np.full(LANES, one, np.uint16), 0))
    for i, (w, a, acc) in enumerate(cases):
        wf, af = bf16_bits_to_f32(w), bf16_bits_to_f32(a)
        exp_dot = int(_bits(burst_dot16(wf, af))[0])
        exp_acc = int(mac_bursts(_f32(np.array([acc], np.uint32)), wf[None, :], af[None, :]).view(np.uint32)[0])
        dut.mac_w.value = _pack(w)
        dut.mac_a.value = _pack(a)
        dut.mac_acc.value = acc
        await _settle()
        got_dot = dut.mac_dot.value.to_unsigned()
        got_acc = dut.mac_y.value.to_unsigned()
        if got_dot != exp_dot or got_acc != exp_acc:
            bad.append(f"mac vector {i}: w={w.tolist()} a={a.tolist()} acc=0x{acc:08x}: RTL dot 0x{got_dot:08x} acc 0x{got_acc:08x} "
                       f"!= contract dot 0x{exp_dot:08x} acc 0x{exp_acc:08x}")
    assert not bad, f"{len(bad)} of {len(cases)} mismatches; first: " + "; ".join(bad[:3])
