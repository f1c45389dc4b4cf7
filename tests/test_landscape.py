"""``nhil landscape``: tiny configs, buckets, blocker ranking, rows in their own processes, resume, timeout."""

from __future__ import annotations

import json

import pytest

from nhil.landscape.report import blocker_keys, summarize
from nhil.landscape.row import bucket_of
from nhil.landscape.tiny_config import SHRINK, causal_lm_architectures, tiny_config


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral", "gemma3_text", "bloom", "opt", "qwen3_moe"])
def test_tiny_config_shrinks_through_attribute_maps(arch):
    cfg = tiny_config(arch)
    assert cfg.hidden_size == SHRINK["hidden_size"] and cfg.num_hidden_layers == 2 and cfg.vocab_size == 256  # GPT-2 via n_embd / n_layer
    assert cfg.num_attention_heads == 4
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, key, None)
        assert v is None or (v if isinstance(v, int) else max(v)) < 256, (key, v)
    if getattr(cfg, "layer_types", None) is not None:
        assert len(cfg.layer_types) == 2  # gemma3_text: 26 default layer types cut to 2
    for k in ("num_local_experts", "num_experts"):
        if isinstance(getattr(cfg, k, None), int):
            assert getattr(cfg, k) == 4 and cfg.num_experts_per_tok == 2


# each case: a config whose shrink the class's own validators (transformers' strict dataclasses) refused before,
# and the relation those validators check, read back from the round-tripped config.json
_VALIDATED = {
    "zaya": lambda c: c.num_experts_per_tok == 1,  # the shrink to 2 experts per token goes back to ZAYA's only value
    "dory": lambda c: (c.n_input_layers, c.n_recurrent_layers, c.n_output_layers, c.num_hidden_layers) == (1, 1, 1, 3),
    "xlnet": lambda c: c.d_head * c.n_head == c.d_model,
    "bamba": lambda c: c.mamba_n_heads * c.mamba_d_head == c.mamba_expand * c.hidden_size,
    "falcon_h1": lambda c: c.mamba_n_heads * c.mamba_d_head == c.mamba_expand * c.hidden_size == c.mamba_d_ssm,
    "ministral": lambda c: c.head_dim == 16,  # None by default, read as a number by the attention
    "nemotron": lambda c: c.num_key_value_heads == 2,
    "bert": lambda c: c.is_decoder is True,  # BertLMHeadModel is causal (and caches) only as a decoder
    # heterogeneous (per_layer_config): the kept global layer's head dim scaled as the global one was (512/256 -> 32/16)
    "gemma4_text": lambda c: c.to_dict()["head_dim"] == 16 and c.layer_types == ["sliding_attention", "full_attention"]
    and c.to_dict()["per_layer_config"] == {"1": {"head_dim": 32}},
}


@pytest.mark.parametrize("arch", sorted(_VALIDATED))
def test_tiny_config_passes_the_config_class_validators(arch, tmp_path):
    """The tiny config survives ``save_pretrained`` -> ``AutoConfig.from_pretrained`` (which runs the class's
    validators) and builds its causal-LM class."""
    import transformers
    from transformers import AutoConfig

    tiny_config(arch).save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert _VALIDATED[arch](cfg), arch
    getattr(transformers, causal_lm_architectures()[arch])(cfg)


def test_architecture_list_is_transformers_causal_lm_mapping():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = causal_lm_architectures()
    assert archs == dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())) and archs["gpt2"] == "GPT2LMHeadModel"


def test_buckets():
    full = {"share": 1.0}
    assert bucket_of({"outcome": "PASS", "stage": "compare"}, full) == "PASS"
    assert bucket_of({"outcome": "PASS", "stage": "compare"}, {"share": 0.9}) == "COMPILE_FAIL"  # a GEMV off PIM is not a PASS
    assert bucket_of({"outcome": "PASS", "stage": "compare"}, None) == "COMPILE_FAIL"
    assert bucket_of({"outcome": "COMPILE_FAIL", "stage": "export"}, None) == "EXPORT_FAIL"
    assert bucket_of({"outcome": "COMPILE_FAIL", "stage": "raise"}, None) == "COMPILE_FAIL"
    assert bucket_of({"outcome": "LOAD_FAIL", "stage": "load_model"}, None) == "CONFIG"
    assert bucket_of({"outcome": "LOAD_FAIL", "stage": "golden"}, None) == "LOAD_FAIL"
    assert bucket_of({"outcome": "MISMATCH", "stage": "compare"}, full) == "MISMATCH"


def _u(cls, op, module="model.layers.0.x"):
    return {"op": op, "module": module, "class": cls, "source": "/x/site-packages/transformers/models/a/modeling_a.py:1", "reason": "r"}


def test_blockers_are_named_without_the_family_and_ranked_by_unlocks():
    rows = [
        {"arch": "a", "class": "AForCausalLM", "bucket": "COMPILE_FAIL", "unraised": [_u("AAttention", "aten.view.default")]},
        {"arch": "b", "class": "BLMHeadModel", "bucket": "COMPILE_FAIL", "unraised": [_u("BAttention", "aten.view.default"), _u("BAttention", "aten.view.default")]},
        {"arch": "c", "class": "CForCausalLM", "bucket": "COMPILE_FAIL", "unraised": [_u("CMLP", "aten.mul.Tensor"), _u("Conv1D", "aten.addmm.default")]},
        {"arch": "d", "class": "DForCausalLM", "bucket": "COMPILE_FAIL", "unraised": [_u("DMLP", "aten.mul.Tensor")]},
        {"arch": "e", "class": "EForCausalLM", "bucket": "COMPILE_FAIL", "unraised": [_u("EMLP", "aten.mul.Tensor"), _u("EAttention", "aten.view.default")]},
        {"arch": "f", "class": "FForCausalLM", "bucket": "PASS", "pim": {"share": 1.0}},
    ]
    assert blocker_keys(rows[2]) == ["MLP: aten.mul.Tensor", "Conv1D: aten.addmm.default"]
    s = summarize(rows)
    ranked = [(b["blocker"], b["unlocks"], b["appears_in"]) for b in s["blockers"]]
    # view unlocks a and b (2), mul unlocks d (1) though it appears in 3; Conv1D unlocks nothing
    assert ranked == [("Attention: aten.view.default", 2, 3), ("MLP: aten.mul.Tensor", 1, 3), ("Conv1D: aten.addmm.default", 0, 1)]
    assert s["totals"]["PASS"] == 1 and s["totals"]["COMPILE_FAIL"] == 5 and s["totals"]["rows"] == 6
    assert s["blockers"][0]["source"] == "transformers/models/a/modeling_a.py:1"


def test_only_refuses_unknown_types(tmp_path):
    from nhil.errors import SetupError
    from nhil.landscape import run_landscape

    with pytest.raises(SetupError, match="not-a-model"):
        run_landscape(["llama", "not-a-model"], workdir=tmp_path, output=None)


def test_row_past_its_timeout_is_timeout_and_resumes(tmp_path):
    from nhil.landscape.runner import _row

    row = _row("llama", tmp_path, timeout_s=0.5, rerun=False)
    assert row["bucket"] == "TIMEOUT" and row["error"].startswith("no verdict within")
    again = _row("llama", tmp_path, timeout_s=0.5, rerun=False)
    assert again["bucket"] == "TIMEOUT" and again.get("resumed") is True  # resume reuses row.json


@pytest.mark.slow
def test_landscape_rows_end_to_end(tmp_path):
    """Three architectures, each in its own process: a PASS (Llama), an unraised op with its source
    line (DiffLlama's two attention maps), an export failure (CTRL); then a resumed run reuses every row."""
    from nhil.landscape import run_landscape

    out = tmp_path / "landscape"
    s = run_landscape(["llama", "diffllama", "ctrl"], jobs=2, workdir=tmp_path / "work", output=out)
    rows = {r["arch"]: r for r in s["rows"]}
    assert rows["llama"]["bucket"] == "PASS" and rows["llama"]["pim"]["share"] == 1.0 and rows["llama"]["top1"] == "8/8"
    assert rows["diffllama"]["bucket"] == "COMPILE_FAIL"
    u = rows["diffllama"]["unraised"][0]
    assert u["source"].endswith(".py:" + u["source"].rsplit(":", 1)[1]) and "modeling_diffllama.py" in u["source"] and u["class"].startswith("DiffLlama")
    assert rows["ctrl"]["bucket"] == "EXPORT_FAIL" and "torch.export" in rows["ctrl"]["error"]
    assert "CRASH" not in {r["bucket"] for r in s["rows"]}
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["totals"] == s["totals"] and "| llama | LlamaForCausalLM | PASS | 100% |" in out.with_suffix(".md").read_text()
    again = run_landscape(["llama", "diffllama", "ctrl"], jobs=1, workdir=tmp_path / "work", output=None)
    assert all(r.get("resumed") for r in again["rows"]) and again["totals"] == s["totals"]


@pytest.mark.nightly  # ~130 s on 2 cores (~190 s on CI): a sweep; test_landscape_rows_end_to_end keeps 3 rows in the default run
def test_landscape_default_subset(tmp_path):
    """The representative subset (17 architectures, one process each): the rows the full run measured
    as PASS still pass with every weight matrix on PIM; every other row names its cause; nothing crashes."""
    from nhil.landscape import DEFAULT_SUBSET, run_landscape
    from nhil.landscape.runner import SUBSET_PASS

    s = run_landscape(list(DEFAULT_SUBSET), jobs=2, workdir=tmp_path / "work", output=None)
    rows = {r["arch"]: r for r in s["rows"]}
    assert set(rows) == set(DEFAULT_SUBSET) and s["totals"].get("CRASH", 0) == 0
    for a in SUBSET_PASS:
        assert rows[a]["bucket"] == "PASS" and rows[a]["pim"]["share"] == 1.0, (a, rows[a].get("error"))
    for r in rows.values():
        assert r["bucket"] == "PASS" or r.get("unraised") or r.get("error"), r["arch"]


@pytest.mark.nightly
def test_landscape_full(tmp_path):
    """Every causal-LM architecture (hours on 2 cores): no CRASH, every non-PASS row names its cause."""
    from nhil.landscape import run_landscape

    s = run_landscape(None, jobs=2, workdir=tmp_path / "work", output=tmp_path / "landscape")
    assert s["totals"].get("CRASH", 0) == 0
    for r in s["rows"]:
        assert r["bucket"] == "PASS" or r.get("error") or r.get("unraised"), r["arch"]


@pytest.mark.slow
def test_row_from_a_cached_program_keeps_its_pim_share(tmp_path):
    """A second row of the same architecture reuses the content-addressed program (no compile, so no raise to
    probe): its PIM share comes from the share recorded with the program, and the row is still PASS."""
    from nhil.landscape.row import run_row

    first = run_row("llama", tmp_path)
    again = run_row("llama", tmp_path)  # the same config path: the program and the reference come from the cache
    assert first["bucket"] == again["bucket"] == "PASS", (first.get("error"), again.get("error"))
    assert again["pim"] == first["pim"] and again["pim"]["share"] == 1.0
