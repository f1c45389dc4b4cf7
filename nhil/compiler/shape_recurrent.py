"""Shape-only decode graph of a Mamba-2 model (state-space layers), for the timing model and the bench.

The graph IR is the one ``raise_recurrent`` produces for transformers' ``Mamba2ForCausalLM``
(``tests/test_hybrid.py`` checks it on the zoo's tiny config: same primitives, attributes
and constant shapes): per layer RMSNorm, ``in_proj`` GEMV, narrow into gate / xBC / dt,
``causal_conv1d_update``, narrow into x / B / C, ``ssm_state_update``, ``rms_norm_gated``,
``out_proj`` GEMV, residual add; constants are meta tensors (``shape_graph._GraphWriter``).

Configs: ``state-spaces/mamba2-1.3b`` / ``mamba2-2.7b`` (``config.json``: d_model 2048 / 2560,
n_layer 48 / 64, d_state 128, headdim 64, expand 2, ngroups 1, d_conv 4, vocab 50277 padded
to a multiple of 16 = 50288, tied embeddings).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from nhil.compiler.shape_graph import _GraphWriter


@dataclasses.dataclass(frozen=True)
class Mamba2Shape:
    """What a Mamba-2 decode step's shapes depend on (names as in ``Mamba2Config``)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    state_size: int
    head_dim: int
    vocab_size: int
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    params_b: float = 0.0

    @property
    def inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def num_heads(self) -> int:
        return self.inner // self.head_dim


CONFIGS = {
    "mamba2-1.3b": Mamba2Shape("mamba2-1.3b", 2048, 48, 128, 64, 50288, params_b=1.3),
    "mamba2-2.7b": Mamba2Shape("mamba2-2.7b", 2560, 64, 128, 64, 50288, params_b=2.7),
}


def decode_graph(c: Mamba2Shape, max_cache_len: int = 0) -> fx.GraphModule:
    """Graph IR of one Mamba-2 decode step of ``c`` (no KV cache: ``max_cache_len`` is unused)."""
    w = _GraphWriter()
    H, I, Hh, hd, G, N, K, eps = c.hidden_size, c.inner, c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel, c.layer_norm_epsilon
    GN = G * N
    CD = I + 2 * GN
    ids, _pos = w.input("input_ids", 1, 1), w.input("cache_position", 1)
    m = "model.backbone"
    embed = w.const(f"{m}.embeddings.weight", c.vocab_size, H)
    h = w.op("embedding", f"{m}.embeddings", embed, ids)
    for i in range(c.num_hidden_layers):
        p, mx = f"{m}.layers.{i}", f"{m}.layers.{i}.mixer"
        x = w.op("rms_norm", f"{p}.norm", h, w.const(f"{p}.norm.weight", H), eps)
        zx = w.op("linear", f"{mx}.in_proj", x, w.const(f"{mx}.in_proj.weight", I + CD + Hh, H), None)
        gate, xbc, dt = (w.op("narrow", mx, zx, s, n) for s, n in ((0, I), (I, CD), (I + CD, Hh)))
        conv = w.op("causal_conv1d_update", mx, xbc, w.const(f"conv_state_{i}", 1, CD, K), w.const(f"{mx}.conv1d.weight", CD, 1, K),
                    w.const(f"{mx}.conv1d.bias", CD), "silu")
        xs, bs, cs = (w.op("narrow", mx, conv, s, n) for s, n in ((0, I), (I, GN), (I + GN, GN)))
        y = w.op("ssm_state_update", mx, xs, dt, w.const(f"{mx}.A_log", Hh), bs, cs, w.const(f"{mx}.D", Hh), w.const(f"{mx}.dt_bias", Hh),
                 w.const(f"ssm_state_{i}", 1, Hh, hd, N), Hh, hd, G, N)
        n = w.op("rms_norm_gated", f"{mx}.norm", y, gate, w.const(f"{mx}.norm.weight", I), eps, I // G)
        o = w.op("linear", f"{mx}.out_proj", n, w.const(f"{mx}.out_proj.weight", H, I), None)
        h = w.op("add", p, h, o)
    xf = w.op("rms_norm", f"{m}.norm_f", h, w.const(f"{m}.norm_f.weight", H), eps)
    head = embed if c.tie_word_embeddings else w.const("model.lm_head.weight", c.vocab_size, H)
    return w.module(w.op("linear", "model.lm_head", xf, head, None))
