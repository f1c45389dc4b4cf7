"""Quantized PyTorch reference: the raised decode graph executed with the device's numerics.

The simulator, the RTL and the board must give the same bits as this reference; it
is written independently of them (no simulator, executor, bank image or packing code):
it interprets the raised FX graph (``nhil.compiler.raising.raise_graph(ep, "decode")``)
node by node in PyTorch, and

* ``nhil::linear``: ``y = W x`` with the weight in its stored format and the MAC of
  ``docs/numerics.md`` ("MAC" and "MAC with quantized weights"): activations rounded
  to bf16 (RNE), per 16-lane burst ``s = dot16(e * a)`` as the fixed pairwise tree in
  fp32, then ``s *= c1``, ``s *= c2``, ``s += dot16(a) * m``, and the bursts accumulated
  in order along K from +0 in fp32 (every step IEEE binary32 RNE; a NaN result is the
  canonical ``0x7FC00000``). ``e``, ``c1``, ``c2``, ``m`` come from the quantization
  plan's :class:`~nhil.numerics.formats.QTensor` fields (``QTensor.operands()``; the
  device decodes them from the packed bank rows instead); bf16 weights are ``e`` = the
  fp32 weight rounded to bf16, no scales. A bias is added afterwards in fp32.
* ``nhil::attention_kv``: decode attention as the device runs it (``docs/isa.md``,
  ``nhil/compiler/lower_attention.py``): k and v appended to a bf16 KV cache (zeros
  initially); scores ``q_j · K_t`` = the bf16 MAC over ``head_dim`` (q rounded to bf16)
  for every cache position ``t < L``; the host softmax ``softmax(scale * scores)`` over
  the visible keys (masked ones exactly 0), fp32, as the ``masked_softmax`` host kernel;
  output ``p_j · V`` = the bf16 MAC over the ``L`` cache positions (p rounded to bf16).
  With ``sinks`` (GPT-OSS) each head's sink logit joins the softmax as an extra column
  (``- max``, then softmax, column dropped); with ``softcap`` c the scaled scores are
  ``c * tanh(s / c)`` before masking.
* ``nhil::moe``: as ``nhil/compiler/lower_moe.py`` runs it: the router as a bf16 GEMV
  (GPT-OSS: + router bias in fp32), the routing rule of
  :func:`nhil.compiler.primitives.moe_routing` on the host, then for each selected expert
  in slot order its gate and up GEMVs, the activation on the host (``silu(g) * u`` or the
  GPT-OSS clamped SwiGLU with its biases), its down GEMV (+ down bias); the combine
  ``(stack(y) * w[:, None]).view(1, k, H).sum(1)``; a shared expert (gate/up/down GEMVs and
  its [1, H] gate GEMV) adds ``sigmoid(gate) * shared``. Expert and shared-expert matrices
  take the plan's format under their lowered names (``<gate_up>.<e>.gate`` / ``.up``,
  ``<down>.<e>``); the router and the shared expert's gate stay bf16, as the lowering keeps
  them. The router logits of every step are kept
  (:attr:`QuantReference.router_logits`) so verify can tell a routing near tie.
* ``nhil::mla_kv``: the absorbed form of ``nhil/compiler/lower_mla.py``: per head
  ``q_abs_h = W_UK_hᵀ q_nope_h`` (bf16 GEMV), key rows ``[latent ‖ k_rot ‖ 0]`` and value
  columns ``latent`` stored in bf16 at the position, scores = bf16 MAC of
  ``[q_abs_h ‖ q_rot_h ‖ 0]`` with every key row, host softmax, ``ctx_h`` = bf16 MAC of the
  probabilities with each latent channel over the positions, ``o_h = W_UV_h ctx_h`` (bf16 GEMV).
* ``nhil::causal_conv1d_update`` / ``ssm_state_update`` / ``gated_delta_rule`` (hybrid layers): states
  stored in bf16, host updates in fp32, the state products as bf16 MACs
  (:mod:`nhil.golden.quant_recurrent`, the mapping of ``nhil/compiler/lower_recurrent.py``).
* every other primitive (embedding, RMSNorm, RoPE, SiLU gating, residual add, ...):
  its own reference kernel (``torch.ops.nhil.*``) in fp32, i.e. the graph IR as is; ATen
  ops left in the graph (host regions) run as exported.

The MAC arithmetic (burst tree, weights in their stored format) is :mod:`nhil.golden.quant_mac`:
elementwise fp32 ``*`` and ``+`` only (``torch.sum``/``matmul`` would reorder), a second
implementation of ``nhil.numerics.mac`` rather than a call to it.

``mode="fake-quant"`` instead computes each linear as ``F.linear`` of fp32 activations
with the format's dequantized weight and attention by the ``attention_kv`` reference
kernel (fp32 SDPA): the format's own accuracy loss without the device's bf16
activations and summation order (the "format" vs "device" split of the quant report).

A :class:`QuantReference` has the ``reset()`` / ``step(token, pos)`` interface of
:class:`nhil.runtime.Runner`, so the generation loops of ``nhil.runtime.generate``
(teacher-forced, greedy) run it unchanged; ``step`` returns ``logits`` and the
``act.*`` activations under the same names as a lowered program's outputs.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F

from nhil.compiler.primitives import visible_mask
from nhil.errors import CompileError, RunError
from nhil.golden.quant_recurrent import RECURRENT_OPS

from nhil.golden.quant_mac import (  # noqa: F401  (MacWeight, burst_tree, act_quant_torch: public names of this module too)
    MacWeight, _fp8_values, _lanes_up, act_quant_torch, bf16_mac_rows, burst_tree, round_bf16)

MODES = ("device", "fake-quant")


class QuantReference(torch.fx.Interpreter):
    """Executes a raised decode-step graph with the device's numerics (module docstring).

    Args:
        gm: raised decode graph (one token, static KV cache), inputs ``input_ids`` [1, 1]
            and ``cache_position`` [1], output logits [1, 1, V].
        plan: :class:`nhil.compiler.quantize.QuantPlan` giving each linear's stored
            weight (the same plan the compiler lowers with), or None for all-bf16 weights.
        mode: ``"device"`` (bit-exact device numerics) or ``"fake-quant"`` (fp32
            activations, dequantized weights, fp32 attention).

    Raises:
        CompileError: unknown mode, or the graph holds a primitive with device numerics
            this reference does not model (e.g. ``nhil::moe``, cache-less ``attention``).
    """

    def __init__(self, gm: torch.fx.GraphModule, plan=None, mode: str = "device", ew_silu=()) -> None:
        super().__init__(gm)
        self.ew_silu = frozenset(ew_silu)  # silu_mul nodes the program computes in the device (info["ew_silu"], nhil.golden.quant_ew)
        if mode not in MODES:
            raise CompileError(f"unknown quantized-reference mode {mode!r}; use one of {', '.join(MODES)}")
        self.plan = plan
        self.mode = mode
        self.weights: dict = {}
        self.cache_names: set[str] = set()
        self.mla_caches: dict[str, tuple[str, int, int, int]] = {}  # node -> (latent cache constant, heads, r, rope)
        self.router_logits: list[list[np.ndarray]] = []  # per step: router logits [E] of each MoE layer, in graph order
        self.acts: dict[str, str] = {}  # graph node name -> output name (act.*)
        layer_out: dict[int, str] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            op = getattr(n.target, "_opname", None) or str(n.target)
            ns = getattr(n.target, "namespace", None)
            if ns == "nhil" and op in ("attention", "mla"):
                raise CompileError(f"the quantized reference has no device numerics for cache-less nhil::{op} (node {n.name}); it runs decode graphs")
            if ns == "nhil" and op == "attention_kv":
                self.cache_names.update(a.target for a in n.args[3:5])
            if ns == "nhil" and op == "mla_kv":
                self.cache_names.update(a.target for a in n.args[3:5])
                self.mla_caches[n.name] = (n.args[3].target, int(n.args[9]), int(n.args[10]), int(n.args[12]))
            if ns == "nhil" and op == "embedding" and "act.model.embed_tokens" not in self.acts.values():
                self.acts[n.name] = "act.model.embed_tokens"  # the first lookup, as nhil.compiler.lower_ops names it
            if ns == "nhil" and op == "add":  # residual stream after each decoder layer (nhil.compiler.lower's act.model.layers.N)
                m = re.search(r"(?:^|\.)(?:layers|h)\.(\d+)$", n.meta.get("nn_module_stack_path", ""))
                if m:
                    layer_out[int(m.group(1))] = n.name
        tagged = {int(n.meta["act"].rsplit(".", 1)[1]): n.name for n in gm.graph.nodes if "act" in n.meta}  # as lower.py names them
        for layer, name in (tagged or layer_out).items():
            self.acts[name] = f"act.model.layers.{layer}"
        self.caches: dict[str, torch.Tensor] = {}
        self._captured: dict[str, torch.Tensor] = {}
        from nhil.golden.quant_recurrent import RecurrentStates  # noqa: E402

        self.recurrent = RecurrentStates(gm)  # conv / SSM states of hybrid layers (nhil.golden.quant_recurrent)
        self.reset()

    # ---------------------------------------------------------------- Runner-like interface
    def reset(self) -> None:
        """Zero the KV caches (start of a sequence)."""
        self.caches = {}
        for name in self.cache_names:
            t = self.module
            for part in name.split("."):
                t = getattr(t, part)
            self.caches[name] = torch.zeros_like(t, dtype=torch.float32)
        # MLA latent cache as the banks hold it: key rows [latent | k_rot | 0] and latent values, bf16 (zeros initially)
        self.mla_state = {}
        for name, (cache, _, r, rope) in self.mla_caches.items():
            L = int(self.caches[cache].shape[2])
            self.mla_state[name] = {"k": torch.zeros(L, _lanes_up(r + rope)), "v": torch.zeros(L, r)}
        self.router_logits = []
        if hasattr(self, "recurrent"):
            self.recurrent.reset()

    def step(self, token: int, pos: int) -> dict[str, np.ndarray]:
        """Run one decode step: token id at cache position ``pos``.

        Returns:
            ``logits`` float32 [V] and ``act.model.embed_tokens`` / ``act.model.layers.N``
            float32 [H] (the residual stream after the embedding and after each layer).
        Raises:
            RunError: ``pos`` outside the static KV cache ``[0, L)``.
        """
        max_len = min((int(c.shape[2]) for c in self.caches.values()), default=None)
        if max_len is not None and not 0 <= int(pos) < max_len:
            raise RunError(f"cache position {pos} outside the static KV cache of {max_len} positions; export the decode graph with a longer max_cache_len")
        self._captured = {}
        self.router_logits.append([])
        with torch.no_grad():
            out = self.run(torch.tensor([[int(token)]], dtype=torch.long), torch.tensor([int(pos)], dtype=torch.long))
        out = out[0] if isinstance(out, (tuple, list)) else out
        res = {"logits": out.detach().reshape(-1).numpy().astype(np.float32, copy=True)}
        for k, v in self._captured.items():
            res[k] = v.detach().reshape(-1).numpy().astype(np.float32, copy=True)
        return res

    # ---------------------------------------------------------------- interpreter hooks
    def get_attr(self, target, args, kwargs):
        if target in self.caches:
            return self.caches[target]
        if target in self.recurrent.states:
            return self.recurrent.states[target]
        return super().get_attr(target, args, kwargs)

    def run_node(self, n: torch.fx.Node):
        if n.op == "call_function" and getattr(n.target, "_opname", None) == "linear":
            self._current_weight_node = n.args[1]  # _weight names the linear's weight by its graph constant
        self._current_node = n
        out = super().run_node(n)
        if n.name in self.acts:
            self._captured[self.acts[n.name]] = out
        return out

    def call_function(self, target, args, kwargs):
        ns = getattr(target, "namespace", None)
        op = getattr(target, "_opname", None)
        if ns == "nhil" and op == "linear":
            return self._linear(*args, **kwargs)
        if ns == "nhil" and op == "attention_kv" and self.mode == "device":
            return self._attention_kv(*args, **kwargs)
        if ns == "nhil" and op == "moe":
            return self._moe(*args, **kwargs)
        if ns == "nhil" and op == "attention_scores" and self.mode == "device":
            return self._attention_scores(*args, **kwargs)
        if ns == "nhil" and op == "attention_values" and self.mode == "device":
            return self._attention_values(*args, **kwargs)
        if ns == "nhil" and op == "moe_experts":
            return self._moe_experts(*args, **kwargs)
        if ns == "nhil" and op == "mla_kv" and self.mode == "device":
            return self._mla_kv(*args, **kwargs)
        if ns == "nhil" and op == "silu_mul" and self.mode == "device" and self._current_node.name in self.ew_silu:
            from nhil.golden.quant_ew import ew_silu_mul

            return ew_silu_mul(*args)
        if ns == "nhil" and op in RECURRENT_OPS and self.mode == "device":
            return self.recurrent.call(op, args, kwargs)  # bf16-stored states, S·C as a bf16 MAC (quant_recurrent)
        # every other nhil primitive, getitem, and ATen left in the graph (host regions the lowering runs as
        # exported): executed as the graph says, which is what the host does
        return super().call_function(target, args, kwargs)

    # ---------------------------------------------------------------- device numerics
    def _weight(self, w: torch.Tensor) -> MacWeight:
        node = self._current_weight_node
        name = node.target if node.op == "get_attr" else node.name
        if name not in self.weights:
            qt = self.plan.weight(name, w) if self.plan is not None else None
            self.weights[name] = MacWeight(w, qt)
        return self.weights[name]

    def _linear(self, x, w, bias=None):
        mw = self._weight(w)
        lead = x.shape[:-1]
        if self.mode == "fake-quant":
            if mw.act:  # the format's own loss: activations fake-quantized per token, fp32 otherwise
                x = torch.stack([q * sc for q, sc in (act_quant_torch(v, mw.act) for v in x.reshape(-1, x.shape[-1]))]).reshape(x.shape)
            y = F.linear(x, mw.deq)
        else:
            rows = [mw.gemv(v) for v in x.reshape(-1, x.shape[-1])]  # one GEMV per token
            y = torch.stack(rows).reshape(*lead, mw.n_out)
        if bias is not None:
            y = torch.ops.nhil.add(y, bias.expand_as(y))
        return y

    def _attention_kv(self, q, k, v, k_cache, v_cache, cache_position, num_heads, num_kv_heads, scale, window=None, softcap=None, *, sinks=None):
        hkv, L, hd = int(k_cache.shape[1]), int(k_cache.shape[2]), int(k_cache.shape[3])
        if q.shape[0] != 1 or q.shape[1] != 1:
            raise CompileError(f"the quantized reference runs one decode token at a time, got q of shape {tuple(q.shape)}")
        pos = int(cache_position.reshape(-1)[0])
        fp8 = self.plan is not None and getattr(self.plan, "kv_cache", "bf16") == "fp8"
        rep = num_heads // num_kv_heads
        if fp8:  # E4M3 codes' values in the cache, the per-head scale applied per burst (nhil.numerics.kv_fp8)
            k_cache[0, :, pos], v_cache[0, :, pos] = _fp8_values(k.reshape(hkv, hd), self._kv_scale(0, hkv)), _fp8_values(v.reshape(hkv, hd), self._kv_scale(1, hkv))
            ks, vs = (self._kv_scale(i, hkv).repeat_interleave(rep) for i in (0, 1))
        else:
            k_cache[0, :, pos] = round_bf16(k.reshape(hkv, hd))  # WR_SBK stores bf16
            v_cache[0, :, pos] = round_bf16(v.reshape(hkv, hd))
        qh = q.reshape(num_heads, hd)
        kh = k_cache[0].repeat_interleave(rep, dim=0)  # [Hq, L, hd]
        scores = bf16_mac_rows(kh, qh, ks[:, None, None] if fp8 else None)  # [Hq, L]
        s = scores * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        vis = visible_mask(torch.tensor([pos]), L, window)[0]
        s = s.masked_fill(~vis, float("-inf"))
        if sinks is not None:  # sink logit per head as an extra softmax column, dropped after
            comb = torch.cat([s, sinks.reshape(num_heads, 1).to(torch.float32)], dim=-1)
            p = torch.softmax(comb - comb.max(dim=-1, keepdim=True).values, dim=-1)[:, :-1]
        else:
            p = torch.softmax(s, dim=-1)  # host masked_softmax
        vt = v_cache[0].transpose(1, 2).repeat_interleave(rep, dim=0)  # [Hq, hd, L]: Vᵀ rows
        out = bf16_mac_rows(vt, p, vs[:, None, None] if fp8 else None)  # [Hq, hd]
        return out.reshape(1, 1, num_heads * hd)


    def _attention_scores(self, q, k, k_cache, cache_position, num_heads, num_kv_heads):
        """Eager attention's q·Kᵀ as ``lower_attention.attention_scores`` runs it: k stored bf16 at the position,
        a bf16 MAC of every cache row (rows beyond the position are zero) -> [1, Hq, 1, L]."""
        hkv, L, hd = int(k_cache.shape[1]), int(k_cache.shape[2]), int(k_cache.shape[3])
        if q.shape[0] != 1 or q.shape[1] != 1:
            raise CompileError(f"the quantized reference runs one decode token at a time, got q of shape {tuple(q.shape)}")
        pos = int(cache_position.reshape(-1)[0])
        k_cache[0, :, pos] = round_bf16(k.reshape(hkv, hd))
        kh = k_cache[0].repeat_interleave(num_heads // num_kv_heads, dim=0)  # [Hq, L, hd]
        return bf16_mac_rows(kh, q.reshape(num_heads, hd)).reshape(1, num_heads, 1, L)

    def _attention_values(self, probs, v, v_cache, cache_position, num_heads, num_kv_heads):
        """Eager attention's p·V as ``lower_attention.attention_values`` runs it: v stored bf16, the host-ATen
        probabilities (bf16 in the global buffer) against the Vᵀ rows -> [1, 1, Hq*hd]."""
        hkv, L, hd = int(v_cache.shape[1]), int(v_cache.shape[2]), int(v_cache.shape[3])
        pos = int(cache_position.reshape(-1)[0])
        v_cache[0, :, pos] = round_bf16(v.reshape(hkv, hd))
        vt = v_cache[0].transpose(1, 2).repeat_interleave(num_heads // num_kv_heads, dim=0)  # [Hq, hd, L]
        return bf16_mac_rows(vt, probs.reshape(num_heads, L)).reshape(1, 1, num_heads * hd)

    def _kv_scale(self, which: int, hkv: int) -> torch.Tensor:
        """k (0) or v (1) scales [hkv] of the current attention layer (``QuantPlan.kv_scales``; layers numbered in graph
        order, as ``LowerCtx.next_attention_layer``)."""
        layers = self.__dict__.setdefault("_attn_layer", {})
        layer = layers.setdefault(self._current_node.name, len(layers))
        return torch.from_numpy(np.asarray(self.plan.kv_scales(layer, hkv)[which], np.float32))

    def _bf16_weight(self, key, w: torch.Tensor, name: str | None = None) -> MacWeight:
        """The MAC weight of a matrix the lowering places itself (MoE experts, MLA's split kv_b_proj), built once per
        ``key``: in the plan's format for ``name`` when a plan and a name are given (quantized experts), else bf16."""
        if key not in self.weights:
            w = w.contiguous()
            qt = self.plan.weight(name, w) if (self.plan is not None and name is not None) else None
            self.weights[key] = MacWeight(w, qt)
        return self.weights[key]

    def _gemv_bf16(self, key, w: torch.Tensor, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
        mw = self._bf16_weight(key, w, name)
        return mw.gemv(x) if self.mode == "device" else F.linear(x.reshape(1, -1), mw.deq).reshape(-1)

    def _moe(self, x, router_weight, gate_up_proj, down_proj, num_experts, top_k, score_func="softmax", norm_topk_prob=True, act="silu",
             score_bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, *, shared_gate_proj=None, shared_up_proj=None,
             shared_down_proj=None, shared_expert_gate=None, router_bias=None, softmax_after_topk=False, gate_up_bias=None, down_bias=None,
             experts_layout="concat", swiglu_alpha=1.702, swiglu_limit=7.0):
        from nhil.compiler.primitives import moe_routing, swiglu_clamp

        fx = self._current_node
        node = fx.name
        nm = lambda a: a.target if isinstance(a, torch.fx.Node) and a.op == "get_attr" else getattr(a, "name", None)  # noqa: E731
        gn, dn = nm(fx.args[2]), nm(fx.args[3])
        h = int(x.shape[-1])
        hs = x.reshape(-1)
        if x.numel() != h:
            raise CompileError(f"the quantized reference runs one decode token at a time, got moe input of shape {tuple(x.shape)}")
        shared = None
        if shared_gate_proj is not None:
            kw = fx.kwargs  # shared expert matrices in the plan's format; its sigmoid gate stays bf16 (lower_moe)
            g = self._gemv_bf16((node, "shared.gate"), shared_gate_proj, hs, nm(kw["shared_gate_proj"]))
            u = self._gemv_bf16((node, "shared.up"), shared_up_proj, hs, nm(kw["shared_up_proj"]))
            shared = self._gemv_bf16((node, "shared.down"), shared_down_proj, torch.ops.nhil.silu_mul(g, u), nm(kw["shared_down_proj"]))
            gate = self._gemv_bf16((node, "shared.expert_gate"), shared_expert_gate, hs) if shared_expert_gate is not None else None
        logits = self._gemv_bf16((node, "router"), router_weight, hs)
        if router_bias is not None:
            logits = logits + router_bias
        self.router_logits[-1].append(logits.numpy().astype(np.float32, copy=True))
        w, ids = moe_routing(logits.reshape(1, -1), top_k, score_func, norm_topk_prob, score_bias, n_group, topk_group, routed_scaling_factor,
                             softmax_after_topk=softmax_after_topk)
        ys = []
        for e in (int(i) for i in ids.reshape(-1)):
            if experts_layout == "transposed_interleaved":  # GPT-OSS: [H, 2I] interleaved gate/up columns, down [I, H], biases
                g = self._gemv_bf16((node, e, "gate"), gate_up_proj[e, :, 0::2].t(), hs, f"{gn}.{e}.gate")
                u = self._gemv_bf16((node, e, "up"), gate_up_proj[e, :, 1::2].t(), hs, f"{gn}.{e}.up")
                a = swiglu_clamp(g + gate_up_bias[e, 0::2], u + gate_up_bias[e, 1::2], swiglu_alpha, swiglu_limit)
                ys.append(self._gemv_bf16((node, e, "down"), down_proj[e].t(), a, f"{dn}.{e}") + down_bias[e])
            else:
                inter = int(gate_up_proj.shape[1]) // 2
                g = self._gemv_bf16((node, e, "gate"), gate_up_proj[e, :inter], hs, f"{gn}.{e}.gate")
                u = self._gemv_bf16((node, e, "up"), gate_up_proj[e, inter:], hs, f"{gn}.{e}.up")
                ys.append(self._gemv_bf16((node, e, "down"), down_proj[e], torch.ops.nhil.silu_mul(g, u), f"{dn}.{e}"))
        y = torch.stack(ys) * w.reshape(-1).unsqueeze(-1)
        out = y.view(1, top_k, -1).sum(dim=1).reshape(-1)
        if shared is not None:
            out = out + (torch.sigmoid(gate) * shared if gate is not None else shared)
        return out.reshape(x.shape)

    def _moe_experts(self, x, ids, weights, gate_up_proj, down_proj, num_experts, top_k):
        """``nhil::moe_experts`` as ``lower_moe`` runs it with a given route: each routed expert's gate / up / down
        as GEMVs in the device's numerics (plan format of ``<gate_up>.<e>.gate`` etc.), ``silu_mul`` on the host,
        ``y * w`` summed over the slots in order (the ``moe_dispatch`` combine)."""
        fx = self._current_node
        nm = lambda a: a.target if isinstance(a, torch.fx.Node) and a.op == "get_attr" else getattr(a, "name", None)  # noqa: E731
        gn, dn = nm(fx.args[3]), nm(fx.args[4])
        h = int(x.shape[-1])
        if x.numel() != h:
            raise CompileError(f"the quantized reference runs one decode token at a time, got moe_experts input of shape {tuple(x.shape)}")
        hs, inter = x.reshape(-1), int(gate_up_proj.shape[1]) // 2
        ys = []
        for e in (int(i) for i in ids.reshape(-1)):
            g = self._gemv_bf16((fx.name, e, "gate"), gate_up_proj[e, :inter], hs, f"{gn}.{e}.gate")
            u = self._gemv_bf16((fx.name, e, "up"), gate_up_proj[e, inter:], hs, f"{gn}.{e}.up")
            ys.append(self._gemv_bf16((fx.name, e, "down"), down_proj[e], torch.ops.nhil.silu_mul(g, u), f"{dn}.{e}"))
        y = torch.stack(ys) * weights.reshape(-1).unsqueeze(-1)
        return y.view(1, top_k, -1).sum(dim=1).reshape(x.shape)

    def _mla_kv(self, q, kv_latent, k_rope, latent_cache, rope_cache, cache_position, cos, sin, kv_b_weight, num_heads, kv_lora_rank,
                qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale, rope_interleave=True, q_lora_rank=None):
        from nhil.compiler.primitives import mla_rope_parts

        node = self._current_node.name
        h, r, nope, rope, v = int(num_heads), int(kv_lora_rank), int(qk_nope_head_dim), int(qk_rope_head_dim), int(v_head_dim)
        st = self.mla_state[node]
        L, kd = int(st["k"].shape[0]), int(st["k"].shape[1])
        if q.shape[0] != 1 or q.shape[1] != 1:
            raise CompileError(f"the quantized reference runs one decode token at a time, got q of shape {tuple(q.shape)}")
        pos = int(cache_position.reshape(-1)[0])
        q_pass, q_rot, k_rot = mla_rope_parts(q, k_rope, cos, sin, h, nope, rope, rope_interleave)  # fp32 on the host
        w = kv_b_weight.detach().to(torch.float32).view(h, nope + v, r)
        q_nope = q.reshape(h, nope + rope)[:, :nope]
        q_abs = torch.stack([self._gemv_bf16((node, j, "uk_t"), w[j, :nope].t(), q_nope[j]) for j in range(h)])  # [H, r]
        kcat = torch.zeros(kd)
        kcat[:r] = kv_latent.reshape(-1)
        kcat[r : r + rope] = k_rot.reshape(-1)
        st["k"][pos] = round_bf16(kcat)  # WR_SBK stores bf16
        st["v"][pos] = round_bf16(kv_latent.reshape(-1))
        qcat = torch.zeros(h, kd)
        qcat[:, :r] = q_abs
        qcat[:, r : r + rope] = q_rot.reshape(h, rope)
        scores = bf16_mac_rows(st["k"].unsqueeze(0).expand(h, L, kd), qcat)  # [H, L]
        vis = visible_mask(torch.tensor([pos]), L, None)[0]
        p = torch.softmax((scores * scale).masked_fill(~vis, float("-inf")), dim=-1)  # host masked_softmax
        ctx = bf16_mac_rows(st["v"].t().unsqueeze(0).expand(h, r, L), p)  # [H, r]: Σ_t p(t) latent_t per channel
        out = torch.stack([self._gemv_bf16((node, j, "uv"), w[j, nope:], ctx[j]) for j in range(h)])  # [H, v]
        return out.reshape(1, 1, h * v)
