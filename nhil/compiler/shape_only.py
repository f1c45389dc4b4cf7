"""Shape-only compilation: a decode-step program from a model config, with meta tensors, no weights.

The timing model needs the instruction stream and the placement, never the weight
values, so an 8B- or 30B-parameter model can be compiled on a laptop. This module emits
the same program as ``nhil.compiler.lower.lower_decode_graph`` would for a Llama-family
decode graph, by driving the same :class:`~nhil.compiler.builder.ProgramBuilder` calls
(``place_matrix`` with ``torch.empty(..., device="meta")`` weights, which records the
placement without bank images; ``gemv``; ``place_kv``; ``lower_decode_attention``) in
the order the raised graph has them. ``tests/test_timing_shape_only.py`` checks that on
``llama-tiny`` its device instruction stream equals the real compiler's, instruction for
instruction.

Shape-only programs hold no weight images (``info["shape_only"] = True``) and cannot run;
they exist to be timed (``nhil.timing``). Rows may exceed the 16-bit row field when a
model needs several devices (see :func:`device_for`), so they are not encodable as
``.pimb`` either.

Mixture-of-experts layers (Mixtral, Qwen3-MoE) are emitted as: router GEMV on PIM, a
``moe_route`` host op (softmax, top-k), then the GEMVs of ``top_k`` experts (experts
``0 .. top_k-1`` stand for the routed ones: every expert has the same placement shape,
so the timing does not depend on which are chosen) and a ``moe_combine`` host op. All
experts are placed. The MoE lowering of the real compiler does not exist yet; when it
does, this emitter should follow it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.compiler.lower_attention import lower_decode_attention, place_kv
from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.program import Program


@dataclasses.dataclass(frozen=True)
class ShapeConfig:
    """What the decode step's shapes depend on (names as in transformers configs)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    num_local_experts: int = 0  # MoE: experts per layer (0 = dense MLP)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # expert width if it differs from intermediate_size
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head before RoPE
    params_b: float = 0.0  # informative: parameter count in billions

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg, name: str | None = None) -> "ShapeConfig":
        """From a transformers config (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE)."""
        g = lambda k, dflt=None: getattr(cfg, k, dflt)  # noqa: E731
        experts = g("num_local_experts") or g("num_experts") or 0
        return cls(
            name=name or g("model_type", "model"),
            hidden_size=g("hidden_size"),
            intermediate_size=g("intermediate_size"),
            num_hidden_layers=g("num_hidden_layers"),
            num_attention_heads=g("num_attention_heads"),
            num_key_value_heads=g("num_key_value_heads") or g("num_attention_heads"),
            vocab_size=g("vocab_size"),
            head_dim=g("head_dim"),
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            num_local_experts=int(experts),
            num_experts_per_tok=int(g("num_experts_per_tok") or 0),
            moe_intermediate_size=g("moe_intermediate_size"),
            qk_norm=g("model_type", "") in ("qwen3", "qwen3_moe"),
        )


# Published configs (config.json of each checkpoint); only shapes matter here.
CONFIGS: dict[str, ShapeConfig] = {
    "smollm2-135m": ShapeConfig("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 64, tie_word_embeddings=True, params_b=0.135),
    "llama3-8b": ShapeConfig("llama3-8b", 4096, 14336, 32, 32, 8, 128256, 128, params_b=8.03),
    "mixtral-8x7b": ShapeConfig("mixtral-8x7b", 4096, 14336, 32, 32, 8, 32000, 128, num_local_experts=8, num_experts_per_tok=2, params_b=46.7),
    "qwen3-30b-a3b": ShapeConfig("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 151936, 128, num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True, params_b=30.5),
}


def _rows_for(n_out: int, n_in: int, d: DeviceConfig) -> int:
    from nhil.compiler.schedule import lowering_passes

    width = d.slots if "bank-spread" in lowering_passes() else d.banks  # as ProgramBuilder._width
    return math.ceil(n_out / width) * math.ceil(n_in / min(d.cols, d.gb_elems))


def _matrices(c: ShapeConfig) -> list[tuple[str, int, int]]:
    """(name, n_out, n_in) of every PIM matrix, in placement order."""
    H, hd = c.hidden_size, c.hd
    out = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", c.num_attention_heads * hd, H), (f"{p}.self_attn.k_proj.weight", c.num_key_value_heads * hd, H),
                (f"{p}.self_attn.v_proj.weight", c.num_key_value_heads * hd, H), (f"{p}.self_attn.o_proj.weight", H, c.num_attention_heads * hd)]
        if c.num_local_experts:
            F = c.moe_intermediate_size or c.intermediate_size
            out.append((f"{p}.mlp.gate.weight", c.num_local_experts, H))
            for e in range(c.num_local_experts):
                q = f"{p}.mlp.experts.{e}"
                out += [(f"{q}.gate_proj.weight", F, H), (f"{q}.up_proj.weight", F, H), (f"{q}.down_proj.weight", H, F)]
        else:
            F = c.intermediate_size
            out += [(f"{p}.mlp.gate_proj.weight", F, H), (f"{p}.mlp.up_proj.weight", F, H), (f"{p}.mlp.down_proj.weight", H, F)]
    out.append(("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight", c.vocab_size, H))
    return out


def device_for(c: ShapeConfig, base: DeviceConfig, max_cache_len: int) -> DeviceConfig:
    """``base``, or as many ``base`` devices as the model needs, pipelined by layer.

    For one decode stream the devices of a layer pipeline work one after another, so N
    devices time like one device with N x the rows; the result is that device, named
    ``"<base> x<N>"``.
    """
    rows = sum(_rows_for(o, i, base) for _, o, i in _matrices(c))
    kv = c.num_hidden_layers * (math.ceil(max_cache_len / base.slots) + math.ceil(max_cache_len / base.cols) * math.ceil(c.num_key_value_heads * c.hd / base.slots))
    n = max(1, math.ceil((rows + kv) / base.rows))
    if n == 1:
        return base
    return dataclasses.replace(base, name=f"{base.name} x{n}", rows=base.rows * n)


def compile_shape_only(config: ShapeConfig | str, device: DeviceConfig | str = "aim-like", max_cache_len: int = 128) -> Program:
    """Compile a decode step of ``config`` without weights (see the module docstring).

    Returns:
        A validated Program with ``info["shape_only"] = True``, ``info["row_use"]`` (row ->
        (slots, elements) used) and ``info["weight_bytes_per_token"]``.
    """
    c = CONFIGS[config] if isinstance(config, str) else config
    base = DEVICE_PRESETS[device] if isinstance(device, str) else device
    d = device_for(c, base, max_cache_len)
    b = ProgramBuilder(d)
    H, hd, nh, nkv, L = c.hidden_size, c.hd, c.num_attention_heads, c.num_key_value_heads, max_cache_len
    meta = lambda o, i: torch.empty((o, i), device="meta")  # noqa: E731
    stub = np.zeros(0, np.float32)
    n = [0]

    def img(name: str) -> str:
        b.host_images.setdefault(name, stub)
        return name

    def buf(size: int, tag: str) -> str:
        n[0] += 1
        return b.buffer(f"{tag}_{n[0]}", size)

    def linear(x: str, wname: str, n_out: int, n_in: int, tag: str) -> str:
        p = b.place_matrix(wname, meta(n_out, n_in))
        y = buf(n_out, tag)
        b.gemv(p, x, y)
        return y

    embed = img("model.embed_tokens.weight")
    h = buf(H, "embedding")
    b.host("embedding", [embed, "$token"], [h])
    cos, sin = b.buffer("rope.0", hd), b.buffer("rope.1", hd)
    b.host("rope_cos_sin", ["$pos", img("model.rotary_emb.inv_freq")], [cos, sin], attention_scaling=1.0)
    layer_out = {}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        x = buf(H, "rms_norm")
        b.host("rms_norm", [h, img(f"{p}.input_layernorm.weight")], [x], eps=1e-5)
        q = linear(x, f"{p}.self_attn.q_proj.weight", nh * hd, H, "linear")
        k = linear(x, f"{p}.self_attn.k_proj.weight", nkv * hd, H, "linear")
        v = linear(x, f"{p}.self_attn.v_proj.weight", nkv * hd, H, "linear")
        if c.qk_norm:
            qn, kn = buf(nh * hd, "rms_norm"), buf(nkv * hd, "rms_norm")
            b.host("rms_norm", [q, img(f"{p}.self_attn.q_norm.weight")], [qn], eps=1e-6)
            b.host("rms_norm", [k, img(f"{p}.self_attn.k_norm.weight")], [kn], eps=1e-6)
            q, k = qn, kn
        qr, kr = buf(nh * hd, "rope"), buf(nkv * hd, "rope")
        b.host("rope", [q, cos, sin], [qr], head_dim=hd)
        b.host("rope", [k, cos, sin], [kr], head_dim=hd)
        kv = place_kv(b, i, L, nkv, hd)
        a = buf(nh * hd, "attention_kv")
        lower_decode_attention(b, kv, qr, kr, v, a, nh, 1.0 / math.sqrt(hd), name=f"attn{i}")
        b.__dict__.setdefault("kv_layouts", {})[i] = kv
        o = linear(a, f"{p}.self_attn.o_proj.weight", H, nh * hd, "linear")
        h1 = buf(H, "add")
        b.host("add", [h, o], [h1])
        x2 = buf(H, "rms_norm")
        b.host("rms_norm", [h1, img(f"{p}.post_attention_layernorm.weight")], [x2], eps=1e-5)
        if c.num_local_experts:
            F = c.moe_intermediate_size or c.intermediate_size
            logits = linear(x2, f"{p}.mlp.gate.weight", c.num_local_experts, H, "router")
            for e in range(c.num_local_experts):  # every expert is placed
                for nm, o_, i_ in (("gate_proj", F, H), ("up_proj", F, H), ("down_proj", H, F)):
                    b.place_matrix(f"{p}.mlp.experts.{e}.{nm}.weight", meta(o_, i_))
            route = buf(2 * c.num_experts_per_tok, "route")
            b.host("moe_route", [logits], [route], top_k=c.num_experts_per_tok)
            outs = []
            for e in range(c.num_experts_per_tok):  # experts 0..k-1 stand for the routed ones
                q_ = f"{p}.mlp.experts.{e}"
                g = linear(x2, f"{q_}.gate_proj.weight", F, H, "linear")
                u = linear(x2, f"{q_}.up_proj.weight", F, H, "linear")
                s = buf(F, "silu_mul")
                b.host("silu_mul", [g, u], [s])
                outs.append(linear(s, f"{q_}.down_proj.weight", H, F, "linear"))
            m = buf(H, "moe_combine")
            b.host("moe_combine", [route, *outs], [m])
        else:
            F = c.intermediate_size
            g = linear(x2, f"{p}.mlp.gate_proj.weight", F, H, "linear")
            u = linear(x2, f"{p}.mlp.up_proj.weight", F, H, "linear")
            s = buf(F, "silu_mul")
            b.host("silu_mul", [g, u], [s])
            m = linear(s, f"{p}.mlp.down_proj.weight", H, F, "linear")
        h = buf(H, "add")
        b.host("add", [h1, m], [h])
        layer_out[i] = h
    xf = buf(H, "rms_norm")
    b.host("rms_norm", [h, img("model.norm.weight")], [xf], eps=1e-5)
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    logits = linear(xf, head, c.vocab_size, H, "linear")
    outputs = {"logits": logits, "act.model.embed_tokens": "embedding_1"}
    outputs.update({f"act.model.layers.{i}": v for i, v in layer_out.items()})
    row_use = {int(r): list(u) for r, u in b.__dict__.get("row_use", {}).items()}
    active = sum(2 * u[0] * u[1] for u in row_use.values())  # all placed weights (bytes)
    info = {
        "model": c.name,
        "kind": "decode-step",
        "shape_only": True,
        "weight_formats": ["bf16"],
        "max_cache_len": L,
        "rows_used": b.next_row,
        "devices": d.rows // base.rows if d.rows > base.rows else 1,
        "placed_weight_bytes": active,
        "kv_layout": {str(k): vars(v) for k, v in b.__dict__.get("kv_layouts", {}).items()},
        "row_use": row_use,
    }
    io = {"inputs": {"token": "int64 scalar", "pos": "int64 scalar"}, "outputs": outputs}
    return b.finish(io, info)
