"""The graph IR of a decode step built from a model config, with meta tensors (no weights).

:func:`decode_graph` writes the raised decode graph (``nhil::*`` primitives, the form
``nhil.compiler.raising.raise_graph`` produces for the transformers Llama / Mistral /
Mixtral / Qwen3 / Qwen3-MoE classes) for a :class:`~nhil.compiler.shape_only.ShapeConfig`:
node order, node names, constant names and attributes as in the raised graph, every
constant a ``torch.empty(..., device="meta")`` tensor and every node's ``meta["val"]`` the
primitive's fake (meta) output. ``nhil.compiler.shape_only`` lowers it with the ordinary
lowering table; ``tests/test_timing_shape_only.py`` checks, on tiny configs, that the
lowering of this graph equals the lowering of the graph raised from the transformers model
(host ops, attributes, instructions).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

import nhil.compiler.primitives  # noqa: F401  (registers torch.ops.nhil.*)


class _GraphWriter:
    """An FX graph of ``nhil`` primitives whose values are meta tensors."""

    def __init__(self) -> None:
        self.g = fx.Graph()
        self.attrs: dict[str, torch.Tensor] = {}

    def input(self, name: str, *shape: int) -> fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.zeros(shape, dtype=torch.long, device="meta")
        return n

    def const(self, name: str, *shape: int) -> fx.Node:
        self.attrs[name] = torch.empty(shape, device="meta")
        n = self.g.get_attr(name)
        n.meta["val"] = self.attrs[name]
        return n

    def op(self, opname: str, path: str, *args, **kwargs) -> fx.Node:
        target = getattr(torch.ops.nhil, opname).default
        val = lambda a: a.meta["val"]  # noqa: E731
        n = self.g.call_function(target, args, kwargs)
        n.meta["val"] = target(*fx.node.map_arg(args, val), **fx.node.map_arg(kwargs, val))
        n.meta["nn_module_stack_path"] = path
        return n

    def getitem(self, src: fx.Node, i: int) -> fx.Node:
        n = self.g.call_function(operator.getitem, (src, i))
        n.meta["val"] = src.meta["val"][i]
        n.meta["nn_module_stack_path"] = src.meta["nn_module_stack_path"]
        return n

    def module(self, output: fx.Node) -> fx.GraphModule:
        self.g.output((output,))
        return fx.GraphModule(self.attrs, self.g)


def decode_graph(c, max_cache_len: int) -> fx.GraphModule:
    """Graph IR of one decode step of config ``c`` with a static KV cache of ``max_cache_len`` positions.

    Args:
        c: a :class:`~nhil.compiler.shape_only.ShapeConfig` (dense Llama-family or MoE).
        max_cache_len: KV-cache positions L.
    Returns:
        A GraphModule whose constants are meta tensors (weights ``[out, in]`` fp32, KV
        caches ``[1, Hkv, L, hd]``, MoE experts ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``).
    """
    w = _GraphWriter()
    H, hd, nh, nkv, L = c.hidden_size, c.hd, c.num_attention_heads, c.num_key_value_heads, max_cache_len
    ids, pos = w.input("input_ids", 1, 1), w.input("cache_position", 1)
    m = "model.model"
    inv_freq = w.const(f"{m}.rotary_emb.inv_freq", hd // 2)
    embed = w.const(f"{m}.embed_tokens.weight", c.vocab_size, H)
    h = w.op("embedding", f"{m}.embed_tokens", embed, ids)
    cs = w.op("rope_cos_sin", f"{m}.rotary_emb", pos, inv_freq, 1.0)
    cos, sin = w.getitem(cs, 0), w.getitem(cs, 1)
    for i in range(c.num_hidden_layers):
        p = f"{m}.layers.{i}"
        x = w.op("rms_norm", f"{p}.input_layernorm", h, w.const(f"{p}.input_layernorm.weight", H), c.rms_norm_eps)
        proj = lambda nm, o_, in_=H, src=x: w.op("linear", f"{p}.self_attn.{nm}", src, w.const(f"{p}.self_attn.{nm}.weight", o_, in_), None)  # noqa: E731
        q = proj("q_proj", nh * hd)
        if c.qk_norm:  # Qwen3: RMSNorm of each head of q and k before RoPE
            q = w.op("rms_norm", f"{p}.self_attn.q_norm", q, w.const(f"{p}.self_attn.q_norm.weight", hd), c.rms_norm_eps, hd)
        k = proj("k_proj", nkv * hd)
        if c.qk_norm:
            k = w.op("rms_norm", f"{p}.self_attn.k_norm", k, w.const(f"{p}.self_attn.k_norm.weight", hd), c.rms_norm_eps, hd)
        v = proj("v_proj", nkv * hd)
        qr = w.op("rope", f"{p}.self_attn", q, cos, sin, hd)
        kr = w.op("rope", f"{p}.self_attn", k, cos, sin, hd)
        kc, vc = w.const(f"key_cache_{i}", 1, nkv, L, hd), w.const(f"value_cache_{i}", 1, nkv, L, hd)
        a = w.op("attention_kv", f"{p}.self_attn", qr, kr, v, kc, vc, pos, nh, nkv, 1.0 / math.sqrt(hd))
        h1 = w.op("add", p, h, proj("o_proj", H, nh * hd, a))
        x2 = w.op("rms_norm", f"{p}.post_attention_layernorm", h1, w.const(f"{p}.post_attention_layernorm.weight", H), c.rms_norm_eps)
        if c.num_local_experts:
            E, F = c.num_local_experts, c.moe_intermediate_size or c.intermediate_size
            y = w.op("moe", f"{p}.mlp", x2, w.const(f"{p}.mlp.gate.weight", E, H), w.const(f"{p}.mlp.experts.gate_up_proj", E, 2 * F, H),
                     w.const(f"{p}.mlp.experts.down_proj", E, H, F), E, c.num_experts_per_tok, "softmax", c.norm_topk_prob, "silu")
        else:
            F = c.intermediate_size
            mlp = lambda nm, o_, in_, src: w.op("linear", f"{p}.mlp.{nm}", src, w.const(f"{p}.mlp.{nm}.weight", o_, in_), None)  # noqa: E731
            g, u = mlp("gate_proj", F, H, x2), mlp("up_proj", F, H, x2)
            y = mlp("down_proj", H, F, w.op("silu_mul", f"{p}.mlp", g, u))
        h = w.op("add", p, h1, y)
    xf = w.op("rms_norm", f"{m}.norm", h, w.const(f"{m}.norm.weight", H), c.rms_norm_eps)
    head = embed if c.tie_word_embeddings else w.const("model.lm_head.weight", c.vocab_size, H)
    return w.module(w.op("linear", "model.lm_head", xf, head, None))
