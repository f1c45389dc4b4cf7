"""``nhil quant-report``: accuracy and footprint of every quantization recipe on one model.

For each recipe the decode-step program is compiled (``nhil.compiler.quantize``) and run
on the functional simulator, teacher-forced on the fp32 golden's greedy tokens for each
prompt of :data:`PROMPTS`; the logits are compared with the fp32 golden:

* top-1 agreement (fraction of steps whose argmax is the golden token);
* KL(golden || target) per step, mean and 99th percentile (nats);
* logits SQNR over all steps (dB) and the worst step's;
* greedy match length: steps until the first top-1 disagreement (free-running greedy
  decoding is identical to the teacher-forced run up to that step), mean over prompts
  and the minimum;
* worst per-layer hidden-state SQNR / cosine (first prompt), for the verify thresholds;
* weight bytes: stored bytes of the PIM linears (formats' scales and headers included);
  modelled decode bytes per token = those weight bytes (every weight is read once per
  token) + the bf16 K and V cache read by attention at the mean context length;
* the format-only reference (``reference=True``): the same prompts teacher-forced through
  the quantized PyTorch reference in ``fake-quant`` mode (``nhil.golden.quant_reference``:
  the recipe's dequantized weights, fp32 activations, fp32 attention), compared with the
  golden the same way. Its loss is the format's own; the rest of the device's loss is
  bf16 activations and the MAC's summation (the device-numerics reference equals the
  simulator bit for bit, ``tests/test_quant.py``, so it would repeat the sim columns).
  ``device_vs_reference_sqnr_db`` is the SQNR of the simulator's logits against the
  format-only reference's.

``sim=False`` measures only the reference: rows of an existing ``<output>.json`` for the
same model, weights, prompts and tokens keep their simulator columns (so the reference
columns can be refreshed without the simulator's hour on SmolLM2).

Writes ``<output>.json`` and ``<output>.md``. On the real SmolLM2 this takes tens of
minutes on 2 CPUs (model export once, then one simulator run per recipe and prompt).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _log(msg: str) -> None:
    print(f"[quant-report] {msg}", file=sys.stderr, flush=True)


def _sqnr(ref: np.ndarray, err: np.ndarray) -> float:
    p, e = float(np.sum(ref.astype(np.float64) ** 2)), float(np.sum(err.astype(np.float64) ** 2))
    return math.inf if e == 0 else 10 * math.log10(p / e)


def run_quant_report(model: str = "llama", recipes: list[str] | None = None, tokens: int = 16, output: Path | str = Path("docs/quant-report"),
                     prompts: list[str] | None = None, sim: bool = True, reference: bool = True) -> dict:
    """Measure ``recipes`` (default: all of ``RECIPES``) on ``model``; returns the JSON dict and writes the files.

    Args:
        sim: run every recipe on the simulator (the main columns).
        reference: also run the format-only (fake-quant) reference (module docstring).
    Raises:
        SetupError: neither ``sim`` nor ``reference``.
    """
    from nhil.compiler import pipeline
    from nhil.compiler.quantize import RECIPES
    from nhil.golden import metrics
    from nhil.golden.generate import generate_golden
    from nhil.isa import DEVICE_PRESETS
    from nhil.models import get_model
    from nhil.runtime import Runner, run_teacher_forced
    from nhil.targets import get_target

    from nhil.errors import SetupError
    from nhil.golden.quant_reference import QuantReference

    if not (sim or reference):
        raise SetupError("quant-report with neither the simulator nor the reference measures nothing; drop --no-sim or --no-reference")
    recipes = list(recipes or RECIPES)
    t0 = time.perf_counter()
    bundle = get_model(model)
    if bundle.tokenizer is not None:
        prompt_ids = [bundle.encode(p) for p in (prompts or PROMPTS)]
        prompt_text = list(prompts or PROMPTS)
    else:
        prompt_ids = [bundle.encode(None)]
        prompt_text = [",".join(map(str, prompt_ids[0]))]
    goldens = [generate_golden(bundle, ids, tokens, prompt_text=txt)[0] for ids, txt in zip(prompt_ids, prompt_text)]
    max_len = int(math.ceil(max(len(p) + tokens for p in prompt_ids) / 16) * 16)
    _, raised = pipeline.export_and_raise(bundle, max_len)
    gm = raised.gm
    device = DEVICE_PRESETS["aim-like"]
    cfg = bundle.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mean_ctx = float(np.mean([len(p) + tokens / 2 for p in prompt_ids]))
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * mean_ctx
    _log(f"model, goldens and export ready in {time.perf_counter() - t0:.0f} s; {len(recipes)} recipes x {len(prompt_ids)} prompts")
    src = str(bundle.source)
    previous, sim_from = ({}, None) if sim else _previous_rows(output, model, bundle.weights_id, prompt_text, tokens)
    rows = []
    for rec in recipes:
        t1 = time.perf_counter()
        if rec.split(":")[0] == "native" and not src.endswith(".gguf"):
            _log(f"{rec}: skipped ({model} was not loaded from a GGUF file)")
            continue
        plan = pipeline.quant_plan(rec, raised, bundle)
        ref_cols, ref_logits = _reference_columns(QuantReference(gm, plan, mode="fake-quant"), prompt_ids, goldens) if reference else ({}, None)
        if not sim:
            if rec not in previous:
                _log(f"{rec}: no simulator row in {Path(output).with_suffix('.json')} for these prompts; run with the simulator first")
                continue
            rows.append({**previous[rec], **ref_cols})
            _log(f"{rec}: format-only reference top1 {ref_cols['ref_top1_agreement']:.3f} SQNR {ref_cols['ref_logits_sqnr_db']:.1f} dB")
            write_report(_assemble(model, bundle, device, prompt_text, tokens, mean_ctx, kv_bytes, rows, t0, sim_from), output)
            continue
        prog, _ = pipeline.lower(raised, device, plan=plan, model_name=model)
        qinfo = prog.info.get("quant", {})
        kls, top1, match, all_ref, all_err, worst_step = [], [], [], [], [], math.inf
        layer_sqnr, layer_cos = math.inf, 1.0
        sim_logits = []
        for pi, (ids, g) in enumerate(zip(prompt_ids, goldens)):
            tgt = get_target("sim", device=device)
            with tgt:
                runner = Runner(prog, tgt)
                runner.reset()
                gtok = [int(t) for t in g["tokens"].tolist()]
                tf = run_teacher_forced(runner, ids, gtok)
            ref = g["logits"].numpy()
            sim_logits.append(np.asarray(tf.logits, np.float64)[: ref.shape[0]])
            cmp = metrics.compare_logits(ref, tf.logits)
            kls += [s["kl"] for s in cmp["steps"]]
            top1 += [s["top1_agree"] for s in cmp["steps"]]
            fm = cmp.get("first_top1_mismatch")
            match.append(len(gtok) if fm is None else int(fm))
            all_ref.append(ref)
            all_err.append(np.asarray(tf.logits, np.float64)[: ref.shape[0]] - ref)
            worst_step = min(worst_step, min(float(s["sqnr_db"]) for s in cmp["steps"]))
            if pi == 0:
                for name in (k for k in g if k.startswith("act.model.layers.")):
                    if name in tf.acts:
                        m = metrics.compare_tensors(g[name].numpy(), tf.acts[name][: g[name].shape[0]])
                        layer_sqnr = min(layer_sqnr, float(m["sqnr_db"]))
                        layer_cos = min(layer_cos, float(m["cosine"]))
        wbytes = int(qinfo["weight_bytes"])
        fmts = qinfo["matrices_per_format"]
        n_w = sum(_linear_sizes(prog))
        row = {
            "recipe": rec,
            "about": RECIPES.get(rec, {}).get("about", ""),
            "formats": fmts,
            "top1_agreement": float(np.mean(top1)),
            "kl_mean": float(np.mean(kls)),
            "kl_p99": float(np.percentile(kls, 99)),
            "kl_max": float(np.max(kls)),
            "logits_sqnr_db": _sqnr(np.concatenate(all_ref), np.concatenate(all_err)),
            "worst_step_sqnr_db": worst_step,
            "greedy_match_mean": float(np.mean(match)),
            "greedy_match_min": int(np.min(match)),
            "worst_layer_sqnr_db": layer_sqnr,
            "worst_layer_cosine": layer_cos,
            "weight_bytes": int(wbytes),
            "bits_per_weight": 8 * wbytes / max(1, n_w),
            "kv_cache": prog.info.get("kv_cache", "bf16"),
            "kv_bytes_per_token": int(_kv_bytes(prog, cfg, head_dim, mean_ctx, kv_bytes)),
            "decode_bytes_per_token": int(wbytes + _kv_bytes(prog, cfg, head_dim, mean_ctx, kv_bytes)),
            "seconds": round(time.perf_counter() - t1, 1),
            **ref_cols,
        }
        if ref_logits is not None:
            fq = np.concatenate(ref_logits)
            row["device_vs_reference_sqnr_db"] = _sqnr(fq, np.concatenate(sim_logits) - fq)
        rows.append(row)
        _log(f"{rec}: top1 {row['top1_agreement']:.3f} KL mean {row['kl_mean']:.4f} SQNR {row['logits_sqnr_db']:.1f} dB greedy {row['greedy_match_min']}/{tokens} {row['bits_per_weight']:.2f} b/w ({row['seconds']} s)")
        write_report(_assemble(model, bundle, device, prompt_text, tokens, mean_ctx, kv_bytes, rows, t0), output)  # after every recipe
    rep = _assemble(model, bundle, device, prompt_text, tokens, mean_ctx, kv_bytes, rows, t0, sim_from)
    write_report(rep, output)
    return rep


def _reference_columns(qref, prompt_ids: list, goldens: list) -> tuple[dict, list]:
    """Teacher-force the format-only reference on every prompt: (its columns, its logits per prompt)."""
    from nhil.golden import metrics
    from nhil.runtime import run_teacher_forced

    kls, top1, all_ref, all_err, logits = [], [], [], [], []
    for ids, g in zip(prompt_ids, goldens):
        gtok = [int(t) for t in g["tokens"].tolist()]
        tf = run_teacher_forced(qref, ids, gtok)
        ref = g["logits"].numpy()
        cmp = metrics.compare_logits(ref, tf.logits)
        kls += [s["kl"] for s in cmp["steps"]]
        top1 += [s["top1_agree"] for s in cmp["steps"]]
        logits.append(np.asarray(tf.logits, np.float64)[: ref.shape[0]])
        all_ref.append(ref)
        all_err.append(logits[-1] - ref)
    cols = {
        "ref_top1_agreement": float(np.mean(top1)),
        "ref_kl_mean": float(np.mean(kls)),
        "ref_logits_sqnr_db": _sqnr(np.concatenate(all_ref), np.concatenate(all_err)),
    }
    return cols, logits


def _previous_rows(output, model: str, weights_id: str, prompts: list[str], tokens: int) -> tuple[dict, str | None]:
    """Rows (by recipe) of an existing report JSON measured with the same model, weights, prompts and tokens, and a
    note of when its simulator columns were measured; ({}, None) if there is none."""
    path = Path(output).with_suffix(".json")
    if not path.exists():
        return {}, None
    old = json.loads(path.read_text())
    if (old.get("model"), old.get("weights_id"), old.get("prompts"), old.get("tokens_per_prompt")) != (model, weights_id, prompts, tokens):
        _log(f"{path} was measured with another model/weights/prompts/tokens; its simulator rows are not reused")
        return {}, None
    when = old.get("simulator_columns_from") or f"{old.get('date')}, {old.get('seconds', 0):.0f} s"
    return {r["recipe"]: r for r in old.get("rows", [])}, when


def _kv_bytes(prog, cfg, head_dim: int, mean_ctx: float, bf16_bytes: float) -> float:
    """KV-cache bytes read per decoded token at the mean context: the bf16 cache's, or for an fp8 cache
    (``nhil.numerics.kv_fp8``) per layer and position K ``hkv * (hd + 4)`` (codes + per-head fp32 scale) plus V ``hkv * hd``."""
    if prog.info.get("kv_cache") != "fp8":
        return bf16_bytes
    hkv = cfg.num_key_value_heads
    return cfg.num_hidden_layers * (hkv * (head_dim + 4) + hkv * head_dim) * mean_ctx


def _assemble(model, bundle, device, prompt_text, tokens, mean_ctx, kv_bytes, rows, t0, sim_from: str | None = None) -> dict:
    extra = {"simulator_columns_from": sim_from} if sim_from else {}
    return {**extra,
        "model": model,
        "weights_id": bundle.weights_id,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "target": "sim",
        "device": device.name,
        "prompts": prompt_text,
        "tokens_per_prompt": tokens,
        "mean_context": mean_ctx,
        "kv_bytes_per_token": kv_bytes,
        "golden": "PyTorch eager fp32 (the GGUF checkpoint dequantized by transformers)",
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _linear_sizes(prog) -> list[int]:
    """Element counts of the PIM linears of a program (from its bank-image placements)."""
    return [int(v) for v in prog.info.get("linear_sizes", [])] or [0]


def write_report(rep: dict, output: Path | str) -> None:
    from nhil.util import atomic_write_text

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps(rep, indent=1, default=str))
    atomic_write_text(out.with_suffix(".md"), render_markdown(rep))


def render_markdown(rep: dict) -> str:
    lines = [
        f"# Quantization accuracy and footprint: {rep['model']}",
        "",
        f"Generated by `nhil quant-report` on {rep['date']} (target `{rep['target']}`, device `{rep['device']}`), "
        f"{len(rep['prompts'])} prompts x {rep['tokens_per_prompt']} teacher-forced tokens, against the {rep['golden']}. "
        f"Weights `{rep['weights_id'][:23]}...`. Total {rep['seconds']:.0f} s"
        + (f" for the reference columns; the simulator columns are from an earlier run ({rep['simulator_columns_from']})." if rep.get("simulator_columns_from") else "."),
        "",
        "Prompts: " + "; ".join(f"`{p}`" for p in rep["prompts"]),
        "",
        "| recipe | formats | top-1 | KL mean | KL p99 | logits SQNR dB | worst step dB | greedy match mean / min | worst layer SQNR dB | weight MB | bits/weight | decode MB/token | KV kB/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        fm = ", ".join(f"{k} x{v}" for k, v in sorted(r["formats"].items()))
        lines.append(
            f"| `{r['recipe']}` | {fm} | {r['top1_agreement']:.3f} | {r['kl_mean']:.4f} | {r['kl_p99']:.4f} | {r['logits_sqnr_db']:.1f} | {r['worst_step_sqnr_db']:.1f} | "
            f"{r['greedy_match_mean']:.1f} / {r['greedy_match_min']} | {r['worst_layer_sqnr_db']:.1f} | {r['weight_bytes'] / 1e6:.1f} | {r['bits_per_weight']:.2f} | {r['decode_bytes_per_token'] / 1e6:.1f} | "
            f"{r.get('kv_bytes_per_token', rep['kv_bytes_per_token']) / 1e3:.0f} |"
        )
    lines += [
        "",
        "Definitions: top-1 = fraction of teacher-forced steps whose argmax equals the golden token; KL = KL(golden || target) "
        "per step in nats; logits SQNR over every step of every prompt; greedy match = steps until the first top-1 disagreement "
        "(free-running greedy decoding equals the teacher-forced run up to there); KV kB/token = KV-cache bytes read per token at the mean context (bf16, or an fp8 cache's "
        "E4M3 codes + per-head scales, docs/numerics.md \"FP8 KV cache\"); worst layer = lowest per-layer hidden-state SQNR "
        "on the first prompt; weight bytes = stored bytes of the PIM linears incl. scales/headers (bf16: 2 B/weight); decode "
        f"bytes/token = weight bytes + the bf16 KV cache read at the mean context ({rep['mean_context']:.1f} positions, "
        f"{rep['kv_bytes_per_token'] / 1e3:.0f} kB). In ISA v0's layout a quantized chunk occupies the start of a bank row "
        "(rows are not packed denser), so the bytes are what the MAC bursts read, not DRAM rows allocated.",
        "",
    ]
    ref_rows = [r for r in rep["rows"] if "ref_top1_agreement" in r]
    if ref_rows:
        lines += [
            "## Format vs device",
            "",
            "The format-only reference (`nhil.golden.quant_reference`, mode `fake-quant`: the recipe's dequantized weights, "
            "fp32 activations, fp32 attention) over the same prompts and teacher-forced tokens, against the same golden: the "
            "accuracy the format itself allows. The simulator's columns above add bf16 activations and the MAC's fixed-order "
            "fp32 summation; `device vs reference` is the SQNR of the simulator's logits against the reference's (higher = the "
            "device adds less). The device-numerics reference equals the simulator bit for bit (`tests/test_quant.py`), so "
            "it is not a separate row.",
            "",
            "| recipe | top-1 (format only) | top-1 (sim) | KL mean (format only) | KL mean (sim) | logits SQNR dB (format only) | logits SQNR dB (sim) | device vs reference SQNR dB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in ref_rows:
            dv = r.get("device_vs_reference_sqnr_db")
            lines.append(
                f"| `{r['recipe']}` | {r['ref_top1_agreement']:.3f} | {r['top1_agreement']:.3f} | {r['ref_kl_mean']:.4f} | {r['kl_mean']:.4f} | "
                f"{r['ref_logits_sqnr_db']:.1f} | {r['logits_sqnr_db']:.1f} | {'–' if dv is None else f'{dv:.1f}'} |"
            )
        lines.append("")
    return "\n".join(lines)
