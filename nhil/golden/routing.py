"""MoE expert selections: the golden's (fp32) against the device's, and whether a difference is a near tie.

A MoE layer picks its top-k experts from router logits; when two experts' scores are
nearly equal at the cut (the k-th vs the (k+1)-th), bf16 activations can flip the
selection, and that token's hidden state then differs by a whole expert's output even
though nothing is wrong. Verify tells the two apart:

* :class:`RouterProbe` runs the raised decode graph in fp32 (the graph IR's own reference
  kernels, the same graph that was checked bit-exact against the exported one) teacher-
  forced, and records each ``nhil::moe`` layer's router logits ``F.linear(x, W_r, b_r)``
  at every position: the golden's routing;
* the device-numerics reference (:class:`nhil.golden.quant_reference.QuantReference`)
  records the router logits the device computes (bf16 GEMV), equal to the target's when
  the tight tier passes;
* :func:`routing_differences` compares the selected expert sets per (position, layer)
  with the routing rule itself (:func:`nhil.compiler.primitives.moe_routing`) and calls a
  difference a **near tie** when the golden's own routing picks the device's experts
  after every router logit is moved by at most the noise ``sigma`` the accuracy tier
  allows (the experts only the device picked up by ``sigma``, those only the golden
  picked down by ``sigma``). ``sigma`` = RMS(golden router logits) x 10^(-S/20) with S
  the hidden-state SQNR floor of the tolerance profile: the router is a linear map of
  the hidden state, so an input within the hidden tier's noise moves the logits by that
  relative amount (for noise uncorrelated with the router's rows).
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["RouterProbe", "moe_nodes", "routing_differences"]

_ROUTING_ARGS = ("score_func", "norm_topk_prob", "act", "score_bias", "n_group", "topk_group", "routed_scaling_factor")


def moe_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``nhil::moe`` nodes of a raised graph, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "nhil"
            and getattr(n.target, "_opname", None) == "moe"]


def _attr(gm, target: str) -> torch.Tensor:
    t = gm
    for part in target.split("."):
        t = getattr(t, part)
    return t


def _const(gm, a):
    return _attr(gm, a.target) if isinstance(a, torch.fx.Node) and a.op == "get_attr" else a


def routing_rule(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict:
    """The routing attributes of one ``nhil::moe`` node: ``top_k``, ``score_func``,
    ``norm_topk_prob``, ``score_bias`` (tensor or None), ``n_group``, ``topk_group``,
    ``routed_scaling_factor``, ``softmax_after_topk``, and ``layer`` (the decoder layer
    index from the module path, None when the path names none)."""
    attrs = dict(zip(_ROUTING_ARGS, node.args[6:]))
    m = re.search(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)", node.meta.get("nn_module_stack_path", ""))
    return {"top_k": int(node.args[5]), "score_func": attrs.get("score_func", "softmax"), "norm_topk_prob": bool(attrs.get("norm_topk_prob", True)),
            "score_bias": _const(gm, attrs.get("score_bias")), "n_group": int(attrs.get("n_group", 1) or 1),
            "topk_group": int(attrs.get("topk_group", 1) or 1), "routed_scaling_factor": float(attrs.get("routed_scaling_factor", 1.0) or 1.0),
            "softmax_after_topk": bool(node.kwargs.get("softmax_after_topk", False)), "layer": int(m.group(1)) if m else None,
            "module": node.meta.get("nn_module_stack_path", node.name)}


def select(logits: np.ndarray, rule: dict) -> list[int]:
    """Expert ids the routing rule picks from router logits [E] (slot order)."""
    from nhil.compiler.primitives import moe_routing

    bias = rule["score_bias"]
    if bias is not None and not isinstance(bias, torch.Tensor):
        bias = torch.tensor(bias, dtype=torch.float32)
    _, ids = moe_routing(torch.from_numpy(np.asarray(logits, np.float32)).reshape(1, -1), rule["top_k"], rule["score_func"], rule["norm_topk_prob"],
                         bias, rule["n_group"], rule["topk_group"], rule["routed_scaling_factor"], softmax_after_topk=rule["softmax_after_topk"])
    return [int(i) for i in ids.reshape(-1)]


class RouterProbe(torch.fx.Interpreter):
    """Runs a raised decode graph in fp32 and records every MoE layer's router logits.

    Has the ``reset()`` / ``step(token, pos)`` interface of :class:`nhil.runtime.Runner`
    (so ``nhil.runtime.generate.run_teacher_forced`` drives it); the KV caches are its own
    zero-initialised copies, the graph module's buffers are never written.
    :attr:`router_logits` holds, per step, one float32 [E] array per MoE layer (graph order).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.nodes = moe_nodes(gm)
        self.cache_names = set()
        for n in gm.graph.nodes:
            if n.op == "call_function" and getattr(n.target, "_opname", None) in ("attention_kv", "mla_kv"):
                self.cache_names.update(a.target for a in n.args[3:5])
        self.router_logits: list[list[np.ndarray]] = []
        self.caches: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        self.caches = {name: torch.zeros_like(_attr(self.module, name)) for name in self.cache_names}
        self.router_logits = []

    def step(self, token: int, pos: int) -> dict[str, np.ndarray]:
        self.router_logits.append([])
        with torch.no_grad():
            out = self.run(torch.tensor([[int(token)]], dtype=torch.long), torch.tensor([int(pos)], dtype=torch.long))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return {"logits": out.detach().reshape(-1).numpy().astype(np.float32, copy=True)}

    def get_attr(self, target, args, kwargs):
        if target in self.caches:
            return self.caches[target]
        return super().get_attr(target, args, kwargs)

    def call_function(self, target, args, kwargs):
        if getattr(target, "namespace", None) == "nhil" and getattr(target, "_opname", None) == "moe":
            x, rw = args[0], args[1]
            lg = F.linear(x.reshape(-1, x.shape[-1]), rw, kwargs.get("router_bias"))
            self.router_logits[-1].append(lg.reshape(-1).numpy().astype(np.float32, copy=True))
        return super().call_function(target, args, kwargs)


def routing_rules(gm: torch.fx.GraphModule) -> list[dict]:
    """JSON-able routing rules of every ``nhil::moe`` node (graph order): :func:`routing_rule` with ``score_bias`` as a list."""
    out = []
    for n in moe_nodes(gm):
        r = routing_rule(gm, n)
        if r["score_bias"] is not None:
            r["score_bias"] = [float(v) for v in torch.as_tensor(r["score_bias"]).reshape(-1).tolist()]
        out.append(r)
    return out


def routing_differences(rules, golden: list[list[np.ndarray]], device: list[list[np.ndarray]], prompt_len: int,
                        hidden_sqnr_floor_db: float) -> list[dict]:
    """Every (position, MoE layer) where the device's expert selection differs from the golden's.

    Args:
        rules: :func:`routing_rules` of the raised graph (or the graph itself).
        golden / device: per position (teacher-forced, positions 0..), per MoE layer,
            router logits float32 [E] (:class:`RouterProbe` and the reference's).
        prompt_len: P (position ``p >= P - 1`` is decode step ``p - P + 1``).
        hidden_sqnr_floor_db: S of the module docstring's ``sigma``.

    Returns:
        One dict per difference: ``position``, ``step`` (None in the prompt), ``moe_layer``,
        ``layer`` (decoder layer), ``module``, ``golden_experts``, ``device_experts``,
        ``gap`` (golden router-logit gap between the swapped experts: the smallest
        ``logit[golden-only] - logit[device-only]``), ``sigma``, ``near_tie`` (bool).
    """
    if isinstance(rules, torch.fx.GraphModule) or hasattr(rules, "graph"):
        rules = [routing_rule(rules, n) for n in moe_nodes(rules)]
    rel = 10.0 ** (-hidden_sqnr_floor_db / 20.0)
    out = []
    for pos, (gl, dl) in enumerate(zip(golden, device)):
        for li, (g, d) in enumerate(zip(gl, dl)):
            rule = rules[li]
            gs, ds = select(g, rule), select(d, rule)
            if set(gs) == set(ds):
                continue
            sigma = float(np.sqrt(np.mean(np.square(g.astype(np.float64))))) * rel
            only_d, only_g = sorted(set(ds) - set(gs)), sorted(set(gs) - set(ds))
            moved = g.astype(np.float32).copy()
            moved[only_d] += np.float32(sigma)
            moved[only_g] -= np.float32(sigma)
            near = set(select(moved, rule)) == set(ds)
            gap = min(float(g[a]) - float(g[b]) for a in only_g for b in only_d)
            out.append({"position": pos, "step": pos - prompt_len + 1 if pos >= prompt_len - 1 else None, "moe_layer": li, "layer": rule["layer"],
                        "module": rule["module"], "golden_experts": gs, "device_experts": ds, "gap": gap, "sigma": sigma, "near_tie": bool(near)})
    return out
