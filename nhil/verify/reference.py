"""The tight tier's other side: the device-numerics reference (``nhil.golden.quant_reference``) run
teacher-forced on the target's inputs, content-addressed with the program."""

from __future__ import annotations

import numpy as np

__all__ = ["reference_outputs", "layer_names"]


def reference_outputs(run, bundle, built: dict, device, max_len: int, prompt_ids: list[int], golden_tokens: list[int], cache_info: dict) -> dict:
    """The tight tier's other side: the device-numerics reference teacher-forced on the same inputs, and for MoE
    models the golden's (fp32 graph) and the device's router logits (``nhil.golden.routing``).

    Content-addressed with the program (``nhil.compiler.cache.cached_tensors``: the program key + prompt + golden
    tokens), so a warm run needs no graph; a miss uses the graph of this run's compile, or exports and raises again.

    Returns:
        ``{"logits" [T, V], "acts" {name: [positions, H]}, "rules" [routing rule per MoE layer],
        "router_golden" / "router_device" [positions][layer] -> [E]}`` (float32 numpy).
    """
    from nhil.compiler import cache as pcache
    from nhil.compiler import pipeline
    from nhil.golden.quant_reference import QuantReference
    from nhil.golden.routing import RouterProbe, routing_rules
    from nhil.runtime import run_teacher_forced

    def build():
        c = built.get("compiled")
        with run.stage("reference"):
            if c is None:  # program from the cache, reference not yet: the graph again
                _, raised = pipeline.export_and_raise(bundle, max_len)
                gm, plan = raised.gm, (pipeline.quant_plan(run.o.quant, raised, bundle) if run.o.quant not in ("", "bf16") else None)
            else:
                gm, plan = c.gm, c.plan
            qr = QuantReference(gm, plan, ew_silu=built.get("ew_silu", ()))  # silu_mul nodes lowered in-device (ew-swiglu)
            out = run_teacher_forced(qr, prompt_ids, golden_tokens)
            arrays = {"logits": out.logits, **{f"acts/{k}": v for k, v in out.acts.items()}}
            rules = routing_rules(gm)
            if rules:
                probe = RouterProbe(gm)
                run_teacher_forced(probe, prompt_ids, golden_tokens)
                arrays["router/golden"] = np.stack([np.stack(p) for p in probe.router_logits])
                arrays["router/device"] = np.stack([np.stack(p) for p in qr.router_logits])
        return arrays, {"rules": rules}

    if pcache.enabled() and cache_info.get("key"):
        parts = {"kind": "device-reference", "program": cache_info["key"], "prompt_ids": list(prompt_ids), "golden_tokens": list(golden_tokens)}
        arrays, meta, info = pcache.cached_tensors(parts, build)
        run.report["reference_cache"] = info
        if info.get("hit"):
            from nhil.util import log

            log(f"reference cache: hit {info['path']}")
    else:
        arrays, meta = build()
    rules = meta.get("rules") or []
    unstack = lambda a: [list(p) for p in a] if a is not None else []  # noqa: E731
    return {"logits": arrays["logits"], "acts": {k.removeprefix("acts/"): v for k, v in arrays.items() if k.startswith("acts/")}, "rules": rules,
            "router_golden": unstack(arrays.get("router/golden")), "router_device": unstack(arrays.get("router/device"))}


def layer_names(gt) -> list[str]:
    """The golden's activation names in layer order: the embedding, then ``act.model.layers.<l>``."""
    return ["act.model.embed_tokens"] + sorted((k for k in gt if k.startswith("act.model.layers.")), key=lambda k: int(k.rsplit(".", 1)[1]))
