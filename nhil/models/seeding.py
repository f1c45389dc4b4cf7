"""Seeded random weights for configs without a checkpoint (zoo entries, ``--model config.json``).

HF's default init (std ``initializer_range`` = 0.02) gives near-uniform logits, so greedy
decoding would hinge on ties. After ``torch.manual_seed(seed)`` and the default init,
every matrix (and every 3-D expert tensor) is redrawn from N(0, std), 1-D biases outside
norms from N(0, 0.1) (so that QKV bias matters), and DeepSeek-style router buffers
``e_score_correction_bias`` (zeros at init) from N(0, 0.1) so the bias-corrected expert
selection differs from the plain one. The zoo uses std 0.15 at hidden 64.
"""

from __future__ import annotations

import torch

__all__ = ["seed_weights", "std_for_hidden"]


def std_for_hidden(hidden_size: int) -> float:
    """0.15 * sqrt(64 / hidden_size): the zoo's 0.15 at hidden 64, scaled as 1/sqrt(fan-in) beyond it."""
    return 0.15 * (64.0 / max(1, int(hidden_size))) ** 0.5


@torch.no_grad()
def seed_weights(model: torch.nn.Module, std: float) -> str:
    """Redraw ``model``'s weights in place (see the module docstring); the caller seeds torch first.

    Returns:
        the weights-id suffix for provenance: ``""`` or ``";router-bias:N(0,0.1)"``.
    """
    for pname, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        elif pname.endswith("bias") and "norm" not in pname and "ln_" not in pname:
            p.normal_(0.0, 0.1)
    suffix = ""
    for bname, buf in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):  # deepseek: HF inits it to 0, which hides the bias correction
            buf.normal_(0.0, 0.1)
            suffix = ";router-bias:N(0,0.1)"
    return suffix
