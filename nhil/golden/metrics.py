"""Numerical comparison metrics between a reference (golden) and a test tensor.

Every function accepts torch tensors (any dtype, including bfloat16, any device) or
anything ``numpy.asarray`` accepts, flattens nothing it does not need to, and computes
in float64. Scalar results are Python ``float``; per-step results are float64/bool
``numpy`` arrays.

Definitions follow the practice surveyed in ``shared/research/harness_anchors.md`` §10:
SQNR as in ``torch.ao.ns.fx.utils.compute_sqnr`` (ExecuTorch ``error_statistics.py``),
PCC as in tt-metal ``assert_with_pcc`` but with the constant-tensor guard that
tt-metal#24928 lacked, KL(P_ref || P_test) over the vocabulary as in llama.cpp
``--kl-divergence``, top-1 agreement ("same top p") as in llama.cpp.

Non-finite values. ``max_abs``/``mae``/... return ``nan`` when an input holds NaN (never
raise); ``sqnr_db`` is ``inf`` for identical tensors. JSON cannot hold inf/NaN, so
:func:`compare_tensors` and :func:`compare_logits` store each non-finite metric as one of
the strings ``"inf"``, ``"-inf"``, ``"nan"`` (see :func:`json_safe`); ``float(value)``
recovers the number in every case.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "to_f64",
    "max_abs",
    "mae",
    "rel_l2",
    "cosine",
    "pcc",
    "pcc_detail",
    "sqnr_db",
    "log_softmax",
    "kl_divergence",
    "top1_match",
    "top1_agreement",
    "first_divergent_token",
    "compare_tensors",
    "compare_logits",
    "json_safe",
]


def to_f64(x: Any) -> np.ndarray:
    """``x`` (torch tensor of any dtype/device, numpy array, list, scalar) as a float64 ndarray.

    bfloat16/float16 torch tensors are widened exactly (every bf16/fp16 value is an fp64
    value). Shape is preserved.
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        import torch

        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _pair(ref: Any, test: Any) -> tuple[np.ndarray, np.ndarray]:
    r, t = to_f64(ref), to_f64(test)
    if r.shape != t.shape:
        raise ValueError(f"cannot compare tensors of different shapes: ref {r.shape} vs test {t.shape}")
    return r, t


def max_abs(ref: Any, test: Any) -> float:
    """max |ref - test| over all elements (same shape, any dtype). 0.0 for empty; NaN if any NaN.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    if r.size == 0:
        return 0.0
    return float(np.max(np.abs(r - t)))


def mae(ref: Any, test: Any) -> float:
    """Mean absolute error mean|ref - test| (same shape). 0.0 for empty; NaN if any NaN.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    if r.size == 0:
        return 0.0
    return float(np.mean(np.abs(r - t)))


def rel_l2(ref: Any, test: Any) -> float:
    """Relative L2 error ||ref - test||_2 / ||ref||_2 (tt-xla ``rel_l2``), dimensionless.

    Guards: 0.0 when both are equal (including both zero); ``inf`` when ref is all zeros
    and test is not; NaN if any NaN.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    num = float(np.sqrt(np.sum((r - t) ** 2)))
    den = float(np.sqrt(np.sum(r**2)))
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if num == 0.0:
        return 0.0
    if den == 0.0:
        return math.inf
    return num / den


def cosine(ref: Any, test: Any) -> float:
    """Cosine similarity <ref, test> / (||ref|| ||test||) of the flattened tensors, in [-1, 1].

    Guards: both all-zero -> 1.0 (identical); exactly one all-zero -> 0.0; NaN if any NaN.
    Blind to scale (cos(x, 2x) = 1): pair it with ``sqnr_db`` or ``rel_l2``.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    r, t = r.ravel(), t.ravel()
    if np.isnan(r).any() or np.isnan(t).any():
        return math.nan
    nr, nt = float(np.linalg.norm(r)), float(np.linalg.norm(t))
    if nr == 0.0 and nt == 0.0:
        return 1.0
    if nr == 0.0 or nt == 0.0:
        return 0.0
    if math.isinf(nr) or math.isinf(nt):
        return math.nan
    return float(np.clip(np.dot(r, t) / (nr * nt), -1.0, 1.0))


def pcc_detail(ref: Any, test: Any) -> tuple[float, str | None]:
    """Pearson correlation of the flattened tensors, plus a flag saying when a guard applied.

    Returns ``(value, flag)``; ``flag`` is ``None`` for an ordinary value, else:

    * ``"nan"``: an input holds NaN/inf -> value NaN (reported, never raised);
    * ``"both_constant"``: both tensors constant (includes single-element tensors) ->
      1.0 if they are equal element-wise, else 0.0 (tt-xla PR #2784 got NaN here);
    * ``"one_constant"``: exactly one tensor is constant -> 0.0 (tt-metal#24928
      returned 1.0 here, which hid a broken kernel).

    Blind to scale and offset (PCC(x, 2x+1) = 1, tt-metal#22994): pair it with SQNR.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    r, t = r.ravel(), t.ravel()
    if not (np.isfinite(r).all() and np.isfinite(t).all()):
        return math.nan, "nan"
    if r.size == 0:
        return 1.0, "both_constant"
    rc, tc = r - r.mean(), t - t.mean()
    sr, st = float(np.sqrt(np.sum(rc**2))), float(np.sqrt(np.sum(tc**2)))
    r_const, t_const = sr == 0.0 or np.ptp(r) == 0.0, st == 0.0 or np.ptp(t) == 0.0
    if r_const and t_const:
        return (1.0 if np.array_equal(r, t) else 0.0), "both_constant"
    if r_const or t_const:
        return 0.0, "one_constant"
    return float(np.clip(np.dot(rc, tc) / (sr * st), -1.0, 1.0)), None


def pcc(ref: Any, test: Any) -> float:
    """Pearson correlation coefficient in [-1, 1]; see :func:`pcc_detail` for the guards.

    Raises:
        ValueError: the shapes differ.
    """
    return pcc_detail(ref, test)[0]


def sqnr_db(ref: Any, test: Any) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum ref^2 / sum (ref - test)^2).

    Same as 20 log10(||ref|| / ||ref - test||) (``torch.ao.ns.fx.utils.compute_sqnr``).
    ``inf`` when the tensors are equal, ``-inf`` when ref is all zeros and test is not,
    NaN if any NaN. One bf16 rounding of a tensor gives about 55.6 dB (measured on normal,
    uniform and log-normal data); each factor of 2 in relative error costs 6.02 dB.

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    sig = float(np.sum(r**2))
    noise = float(np.sum((r - t) ** 2))
    if math.isnan(sig) or math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)


def log_softmax(logits: Any, axis: int = -1) -> np.ndarray:
    """log softmax along ``axis`` in float64 (max-subtracted log-sum-exp); same shape as input."""
    x = to_f64(logits)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def _as_steps(logits: Any) -> np.ndarray:
    x = to_f64(logits)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"expected LM logits of shape [T, V] (or [V]), got {x.shape}")
    return x


def kl_divergence(ref_logits: Any, test_logits: Any) -> np.ndarray:
    """Per-step KL(P_ref || P_test) in nats over the vocabulary.

    Args:
        ref_logits: [T, V] (or [V]) golden logits, any float dtype.
        test_logits: same shape, logits from the target.

    Returns:
        float64 array [T]: sum_v p_ref(v) (log p_ref(v) - log p_test(v)), with both log
        distributions from a float64 :func:`log_softmax` (llama.cpp ``--kl-divergence``
        uses the same direction: base model first). Terms with p_ref = 0 count as 0;
        p_test = 0 where p_ref > 0 gives ``inf``; NaN inputs give NaN for that step.
        Tiny negative values from rounding are clamped to 0.

    Raises:
        ValueError: shapes differ or are not [T, V].
    """
    r, t = _as_steps(ref_logits), _as_steps(test_logits)
    if r.shape != t.shape:
        raise ValueError(f"cannot compare logits of different shapes: ref {r.shape} vs test {t.shape}")
    lr, lt = log_softmax(r), log_softmax(t)
    pr = np.exp(lr)
    with np.errstate(invalid="ignore"):
        terms = np.where(pr > 0.0, pr * (lr - lt), 0.0)
    terms = np.where(np.isnan(lr) | np.isnan(lt), np.nan, terms)
    kl = np.sum(terms, axis=-1)
    return np.where(kl < 0.0, 0.0, kl)


def top1_match(ref_logits: Any, test_logits: Any) -> np.ndarray:
    """Per-step bool [T]: argmax_v ref[t] == argmax_v test[t] (first index wins ties).

    Raises:
        ValueError: shapes differ or are not [T, V].
    """
    r, t = _as_steps(ref_logits), _as_steps(test_logits)
    if r.shape != t.shape:
        raise ValueError(f"cannot compare logits of different shapes: ref {r.shape} vs test {t.shape}")
    return np.argmax(r, axis=-1) == np.argmax(t, axis=-1)


def top1_agreement(ref_logits: Any, test_logits: Any) -> float:
    """Fraction in [0, 1] of steps whose argmax token agrees (llama.cpp "Same top p"); 1.0 for T = 0."""
    m = top1_match(ref_logits, test_logits)
    return float(m.mean()) if m.size else 1.0


def _token_list(x: Any) -> list[int]:
    if hasattr(x, "detach"):
        x = x.detach().cpu().reshape(-1).tolist()
    return [int(v) for v in np.asarray(x).ravel().tolist()]


def first_divergent_token(ref_tokens: Any, test_tokens: Any) -> int | None:
    """Index of the first position where two token sequences differ, or ``None`` if equal.

    Args:
        ref_tokens, test_tokens: int sequences (list, [T] tensor or array).

    Returns:
        the first i with ref[i] != test[i]; if one sequence is a strict prefix of the
        other, the length of the shorter one; ``None`` when both are identical.
    """
    a, b = _token_list(ref_tokens), _token_list(test_tokens)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``"inf"``, ``"-inf"`` or ``"nan"``.

    Recurses into dicts, lists and tuples (tuples become lists); numpy scalars become
    Python scalars. ``float(x)`` recovers each replaced number.
    """
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return [json_safe(v) for v in value.tolist()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return f
    return value


def compare_tensors(ref: Any, test: Any) -> dict[str, Any]:
    """All elementwise metrics of ``test`` against ``ref`` as a JSON-safe dict.

    Returns keys: ``shape`` (list), ``numel``, ``max_abs``, ``mae``, ``rel_l2``,
    ``cosine``, ``pcc``, ``pcc_flag`` (None or a guard name, see :func:`pcc_detail`),
    ``sqnr_db`` (dB), ``nan_ref``, ``nan_test``, ``inf_ref``, ``inf_test`` (counts).
    Metric values are floats, or ``"inf"``/``"-inf"``/``"nan"`` strings for non-finite
    values (see :func:`json_safe`).

    Raises:
        ValueError: the shapes differ.
    """
    r, t = _pair(ref, test)
    p, flag = pcc_detail(r, t)
    out = {
        "shape": list(r.shape),
        "numel": int(r.size),
        "max_abs": max_abs(r, t),
        "mae": mae(r, t),
        "rel_l2": rel_l2(r, t),
        "cosine": cosine(r, t),
        "pcc": p,
        "pcc_flag": flag,
        "sqnr_db": sqnr_db(r, t),
        "nan_ref": int(np.isnan(r).sum()),
        "nan_test": int(np.isnan(t).sum()),
        "inf_ref": int(np.isinf(r).sum()),
        "inf_test": int(np.isinf(t).sum()),
    }
    return json_safe(out)


def compare_logits(ref_logits: Any, test_logits: Any) -> dict[str, Any]:
    """Per-step and summary metrics for LM logits [T, V] (teacher-forced positions).

    Returns a JSON-safe dict: ``steps`` (list of T dicts with ``step``, ``cosine``,
    ``sqnr_db``, ``kl`` (nats), ``max_abs``, ``top1_agree`` (bool), ``ref_top1``,
    ``test_top1`` (token ids)), and summary ``kl_mean``, ``kl_max`` (nats),
    ``top1_agreement`` (fraction), ``first_top1_mismatch`` (step index or None) plus
    :func:`compare_tensors` of the whole [T, V] block under ``overall``.

    Raises:
        ValueError: shapes differ or are not [T, V].
    """
    r, t = _as_steps(ref_logits), _as_steps(test_logits)
    if r.shape != t.shape:
        raise ValueError(f"cannot compare logits of different shapes: ref {r.shape} vs test {t.shape}")
    kl = kl_divergence(r, t)
    ra, ta = np.argmax(r, axis=-1), np.argmax(t, axis=-1)
    steps = [
        {
            "step": i,
            "cosine": cosine(r[i], t[i]),
            "sqnr_db": sqnr_db(r[i], t[i]),
            "kl": float(kl[i]),
            "max_abs": max_abs(r[i], t[i]),
            "top1_agree": bool(ra[i] == ta[i]),
            "ref_top1": int(ra[i]),
            "test_top1": int(ta[i]),
        }
        for i in range(r.shape[0])
    ]
    mism = np.nonzero(ra != ta)[0]
    out = {
        "steps": steps,
        "kl_mean": float(np.mean(kl)) if kl.size else 0.0,
        "kl_max": float(np.max(kl)) if kl.size else 0.0,
        "top1_agreement": float(np.mean(ra == ta)) if ra.size else 1.0,
        "first_top1_mismatch": int(mism[0]) if mism.size else None,
        "overall": compare_tensors(r, t),
    }
    return json_safe(out)
