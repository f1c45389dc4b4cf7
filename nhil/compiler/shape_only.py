"""Shape-only compilation: a decode-step program from a model config, with meta tensors, no weights.

The timing model needs the instruction stream and the placement, never the weight
values, so an 8B- or 30B-parameter model can be compiled on a laptop. The decode graph IR
of the config is written with meta-tensor constants (``nhil.compiler.shape_graph``) and
lowered by the ordinary lowering table (``nhil.compiler.lowering.LOWERINGS``, via
``lower_decode_graph``): ``ProgramBuilder.place_matrix`` of a meta weight records the
placement without bank images, ``host_image`` of a meta constant an empty stub. There is
no second copy of any lowering: ``tests/test_timing_shape_only.py`` checks on tiny dense
and MoE configs that the program equals the real compiler's, host op for host op and
instruction for instruction.

Shape-only programs hold no weight images (``info["shape_only"] = True``) and cannot run;
they exist to be timed (``nhil.timing``). Rows may exceed the 16-bit row field when a
model needs several devices (see :func:`device_for`), so they are not encodable as
``.pimb`` either.

Mixture-of-experts layers (Mixtral, Qwen3-MoE) lower as in the real compiler
(``nhil.compiler.lower_moe``): router GEMV, ``moe_route``, one sub-program per expert
(every expert placed), ``moe_dispatch``; the timing model runs the sub-programs of
``top_k`` experts at the dispatch (``nhil.timing.engine``).
"""

from __future__ import annotations

import dataclasses
import math

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
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = True  # MoE: renormalise the top-k router probabilities (Mixtral, Qwen3-MoE)

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
            rms_norm_eps=float(g("rms_norm_eps", 1e-5)),
            norm_topk_prob=bool(g("norm_topk_prob", True)),
        )


# Published configs (config.json of each checkpoint); only shapes matter here.
CONFIGS: dict[str, ShapeConfig] = {
    "smollm2-135m": ShapeConfig("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 64, tie_word_embeddings=True, params_b=0.135),
    "llama3-8b": ShapeConfig("llama3-8b", 4096, 14336, 32, 32, 8, 128256, 128, params_b=8.03),
    "mixtral-8x7b": ShapeConfig("mixtral-8x7b", 4096, 14336, 32, 32, 8, 32000, 128, num_local_experts=8, num_experts_per_tok=2, params_b=46.7),
    "qwen3-30b-a3b": ShapeConfig("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 151936, 128, num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, qk_norm=True, params_b=30.5,
                                 rms_norm_eps=1e-6),
}


_UNBOUNDED_ROWS = 1 << 40  # rows of the device a shape-only program is first lowered on (counted, then split into devices)


def device_for(c: ShapeConfig, base: DeviceConfig, max_cache_len: int) -> DeviceConfig:
    """``base``, or as many ``base`` devices as the model needs, pipelined by layer.

    For one decode stream the devices of a layer pipeline work one after another, so N
    devices time like one device with N x the rows; the result is that device, named
    ``"<base> x<N>"``. N comes from the rows the lowering allocates (weights and KV cache).
    """
    return compile_shape_only(c, base, max_cache_len).device


def _devices(base: DeviceConfig, rows: int) -> DeviceConfig:
    n = max(1, math.ceil(rows / base.rows))
    return base if n == 1 else dataclasses.replace(base, name=f"{base.name} x{n}", rows=base.rows * n)


def compile_shape_only(config: ShapeConfig | str, device: DeviceConfig | str = "aim-like", max_cache_len: int = 128, passes=None) -> Program:
    """Compile a decode step of ``config`` without weights (see the module docstring).

    Args:
        config: a :class:`ShapeConfig` or a name of :data:`CONFIGS`.
        device: a device preset or its name; the program's device is this one or N of them
            (:func:`device_for`).
        max_cache_len: KV-cache positions.
        passes: lower-stage scheduling passes (None = every pass; ``nhil.compiler.pipeline.compile_shapes``
            also runs the program-stage ones).
    Returns:
        A validated Program with ``info["shape_only"] = True``, ``info["row_use"]`` (row ->
        (slots, elements) used), ``info["placed_weight_bytes"]`` and ``info["devices"]``.
    Raises:
        CompileError: the config cannot be mapped (e.g. a head_dim that is not a multiple of the burst).
    """
    from nhil.compiler.lower import lower_decode_graph
    from nhil.compiler.shape_graph import decode_graph

    from nhil.compiler import shape_recurrent

    if isinstance(config, str) and config in shape_recurrent.CONFIGS:  # state-space models (Mamba-2): their own graph writer
        config = shape_recurrent.CONFIGS[config]
    c = CONFIGS[config] if isinstance(config, str) else config
    base = DEVICE_PRESETS[device] if isinstance(device, str) else device
    graph = (shape_recurrent.decode_graph if isinstance(c, shape_recurrent.Mamba2Shape) else decode_graph)(c, max_cache_len)
    prog = lower_decode_graph(graph, dataclasses.replace(base, rows=_UNBOUNDED_ROWS), model_name=c.name, passes=passes)
    d = _devices(base, prog.info["rows_used"])
    row_use = prog.info.get("row_use", {})
    prog.device = d
    prog.info.update({
        "shape_only": True,
        "devices": d.rows // base.rows,
        "placed_weight_bytes": sum(2 * u[0] * u[1] for u in row_use.values()),  # all placed weights (bytes)
        "row_use": row_use,
    })
    prog.validate()
    return prog
