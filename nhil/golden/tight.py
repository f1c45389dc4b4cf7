"""The tight tier: the target equals the device-numerics reference bit for bit.

The reference (:class:`nhil.golden.quant_reference.QuantReference`) runs the raised graph
in PyTorch with the device's MAC contract and the same quantization plan; it shares no
code with the simulator, the executor or the lowering beyond ``nhil.numerics``' format
classes and the primitives' reference kernels (which define the host ops). Both sides run
teacher-forced on the same prompt and golden tokens, so every logit of every step and
every captured activation (``act.*``: the embedding and each decoder layer's residual
stream, at every position) must have the same IEEE-754 bits. There is no tolerance: a
difference of one ulp is a "target != compiler semantics" failure, named by the first
step / position, tensor and element where the bits differ.

NaNs compare by bit pattern too (both sides produce the canonical ``0x7FC00000`` from a
MAC; a different NaN payload is a difference).
"""

from __future__ import annotations

import numpy as np

__all__ = ["compare_bits"]


def _first_diff(ref: np.ndarray, got: np.ndarray) -> int | None:
    """Flat index of the first element whose float32 bits differ (None when all equal)."""
    d = np.flatnonzero(ref.view(np.uint32).ravel() != got.view(np.uint32).ravel())
    return int(d[0]) if d.size else None


def _elem(name: str, ref: np.ndarray, got: np.ndarray, row: int, col: int, row_kind: str, prompt_len: int) -> dict:
    r, g = np.float32(ref[row, col]), np.float32(got[row, col])
    out = {"tensor": name, row_kind: int(row), "element": int(col), "reference": float(r), "target": float(g),
           "reference_bits": f"0x{int(np.array(r).view(np.uint32)):08x}", "target_bits": f"0x{int(np.array(g).view(np.uint32)):08x}",
           "abs_diff": float(abs(np.float64(r) - np.float64(g))),
           "elements_differing": int(np.count_nonzero(ref[row].view(np.uint32) != got[row].view(np.uint32)))}
    if row_kind == "step":
        out["position"] = int(prompt_len - 1 + row)
    return out


def compare_bits(ref_logits: np.ndarray, got_logits: np.ndarray, ref_acts: dict[str, np.ndarray], got_acts: dict[str, np.ndarray],
                 prompt_len: int, layer_order: list[str]) -> dict:
    """Bit-compare a target's teacher-forced run with the reference's.

    Args:
        ref_logits / got_logits: float32 [T, V], row i = decode step i.
        ref_acts / got_acts: name -> float32 [positions, H] (``act.*`` outputs).
        prompt_len: P (step i is position ``P - 1 + i``).
        layer_order: activation names in model order (embedding first), so the first
            differing *layer* at the first differing position is named.

    Returns:
        ``{"passed", "logits_steps", "tensors_compared", "elements_compared",
        "first_difference": None | {tensor, step|position, element, reference, target,
        reference_bits, target_bits, abs_diff, elements_differing, layer_first}}``: the
        earliest position at which anything differs, and there the first layer in model
        order (an error entering at layer l shows in every layer after it).

    Raises:
        ValueError: the two runs have different shapes or activation names (they did
            not run the same program / graph).
    """
    if ref_logits.shape != got_logits.shape:
        raise ValueError(f"tight tier: logits shapes differ (reference {ref_logits.shape}, target {got_logits.shape})")
    if set(ref_acts) != set(got_acts):
        raise ValueError(f"tight tier: activation names differ (reference only {sorted(set(ref_acts) - set(got_acts))}, "
                         f"target only {sorted(set(got_acts) - set(ref_acts))})")
    names = [n for n in layer_order if n in ref_acts] + sorted(n for n in ref_acts if n not in layer_order)
    n_el = int(ref_logits.size) + sum(int(ref_acts[n].size) for n in names)
    first: dict | None = None
    best_pos = None
    for n in names:
        a, b = np.ascontiguousarray(ref_acts[n], np.float32), np.ascontiguousarray(got_acts[n], np.float32)
        if a.shape != b.shape:
            raise ValueError(f"tight tier: {n} shapes differ (reference {a.shape}, target {b.shape})")
        i = _first_diff(a, b)
        if i is None:
            continue
        pos, col = divmod(i, a.shape[1])
        if best_pos is None or pos < best_pos:  # earliest position; names are in model order, so ties keep the first layer
            best_pos = pos
            first = _elem(n.removeprefix("act."), a, b, pos, col, "position", prompt_len)
    lr, lg = np.ascontiguousarray(ref_logits, np.float32), np.ascontiguousarray(got_logits, np.float32)
    i = _first_diff(lr, lg)
    if i is not None:
        step, col = divmod(i, lr.shape[1])
        pos = prompt_len - 1 + step
        if best_pos is None or pos < best_pos:  # logits differ with every layer before them equal: the LM head / final norm
            first = _elem("logits", lr, lg, step, col, "step", prompt_len)
    return {"passed": first is None, "logits_steps": int(lr.shape[0]), "tensors_compared": len(names) + 1, "elements_compared": n_el,
            "first_difference": first}
