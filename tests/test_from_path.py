"""``--model PATH`` (nhil.models.from_path) and generic golden capture (nhil.golden.decoder_stack).

References: the transformers model the checkpoint was saved from (logits compared bit for
bit after the round trip), gguf-py's own tensor-name map for the GGUF writer, and
transformers' ``output_hidden_states`` for the captured per-layer hidden states.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nhil.errors import GoldenError, SetupError
from gguf_files import write_gguf as _write_gguf  # tests/gguf_files.py

IDS = torch.tensor([[3, 17, 42, 99, 5, 250]])


def _verify(model: str, tmp_path: Path, **kw) -> dict:
    from nhil.verify import VerifyOptions, verify

    return verify(VerifyOptions(model=model, target="sim", tokens=4, goldens_dir=tmp_path / "goldens", runs_dir=tmp_path / "runs", **kw))


@pytest.fixture(scope="module")
def tiny():
    from nhil.models import get_model

    return get_model("llama-tiny").model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tiny.save_pretrained(d)
    return d


def test_hf_folder_loads_bit_exact_and_verifies(hf_folder, tiny, tmp_path):
    from nhil.models.from_path import load_model_path

    b = load_model_path(str(hf_folder))
    assert b.name == "tiny-llama" and b.tokenizer is None and b.weights_id.startswith("sha256:")
    with torch.no_grad():
        assert torch.equal(b.model(IDS).logits, tiny(IDS).logits)
    rep = _verify(str(hf_folder), tmp_path)
    assert rep["outcome"] == "PASS", rep.get("error")
    assert Path(rep["run_dir"]).name.endswith("-tiny-llama-sim")
    assert [r["layer"] for r in rep["layers"]] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]


def test_gguf_loads_bit_exact_and_verifies(tmp_path, tiny):
    from nhil.models.from_path import load_model_path

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, tiny)
    b = load_model_path(str(path))
    with torch.no_grad():
        assert torch.equal(b.model(IDS).logits, tiny(IDS).logits)
    rep = _verify(str(path), tmp_path)
    assert rep["outcome"] == "PASS", rep.get("error")


def test_config_only_with_layers(tmp_path):
    from nhil.models.from_path import load_model_path
    from nhil.models.llama import tiny_llama_config

    c = tiny_llama_config()
    c.num_hidden_layers = 4
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "config.json"
    path.write_text(c.to_json_string())
    a, b = load_model_path(str(path), layers=2), load_model_path(str(path), layers=2, seed=0)
    assert a.model.config.num_hidden_layers == 2 and len(a.model.model.layers) == 2
    for (k, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), k  # same seed, same weights
    assert float(a.model.model.layers[0].self_attn.q_proj.weight.std()) == pytest.approx(0.15, rel=0.05)
    rep = _verify(str(path), tmp_path, layers=2)
    assert rep["outcome"] == "PASS", rep.get("error")
    assert rep["reproducer"].endswith("LAYERS=2") and [r["layer"] for r in rep["layers"]][-1] == "model.layers.1"


def test_layers_cuts_per_layer_lists(tmp_path):
    import transformers

    from nhil.models.from_path import load_model_path

    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, layer_types=["full_attention"] * 3 + ["sliding_attention"], sliding_window=8, use_sliding_window=True)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    b = load_model_path(str(path), layers=3)
    assert b.model.config.layer_types == ["full_attention"] * 3 and len(b.model.model.layers) == 3


def _bad(tmp_path, hf_folder, case):
    import shutil

    d = tmp_path / case
    if case == "missing":
        return str(tmp_path / "nope"), ["no such file or folder", "Hugging Face folder"]
    shutil.copytree(hf_folder, d)
    cfg = json.loads((d / "config.json").read_text())
    if case == "no_config":
        (d / "config.json").unlink()
        return str(d), ["has no config.json", "save_pretrained"]
    if case == "no_weights":
        (d / "model.safetensors").unlink()
        return str(d), ["no *.safetensors", "config.json"]
    if case == "bad_json":
        (d / "config.json").write_text("{not json")
        return str(d), [str(d / "config.json"), "not valid JSON"]
    if case == "unknown_type":
        cfg["model_type"] = "llamazing"
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d), ["unknown model_type 'llamazing'", str(d / "config.json"), "fix model_type"]
    if case == "shape":
        cfg["intermediate_size"] = 96
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d), ["disagree with config.json", "model.layers.0.mlp.down_proj.weight: checkpoint [64, 128] vs config [64, 96]", "fix config.json"]
    if case == "missing_weight":
        from safetensors.torch import load_file, save_file

        t = load_file(d / "model.safetensors")
        del t["model.layers.1.mlp.up_proj.weight"]
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        return str(d), ["missing from *.safetensors", "model.layers.1.mlp.up_proj.weight"]
    if case == "layers_range":
        return (str(d), 3), ["--layers 3", "has 2 decoder layers"]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "no_config", "no_weights", "bad_json", "unknown_type", "shape", "missing_weight", "layers_range"])
def test_bad_model_paths_name_the_file_and_the_fix(tmp_path, hf_folder, case):
    from nhil.models.from_path import load_model_path

    spec, needles = _bad(tmp_path, hf_folder, case)
    spec, layers = spec if isinstance(spec, tuple) else (spec, None)
    with pytest.raises(SetupError) as ei:
        load_model_path(spec, layers=layers)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


def test_layers_refused_for_registered_model():
    from nhil.models import get_model

    with pytest.raises(SetupError, match="--layers applies to --model PATH only"):
        get_model("llama-tiny", layers=1)


def test_cli_bad_path_is_a_usage_error_not_crash(tmp_path):
    """A path that does not exist is refused before any work (nhil.args: exit 64, no run folder), naming it."""
    r = subprocess.run([sys.executable, "-m", "nhil.cli", "verify", "--model", str(tmp_path / "absent"), "--runs-dir", str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 64
    assert "USAGE_ERROR" in r.stderr and str(tmp_path / "absent") in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ---- generic golden capture -------------------------------------------------------------

LAYOUTS = {  # families whose decoder stacks are not model.model.layers (each 3 layers)
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=256, hidden_size=64, n_layer=3, n_head=4), "transformer.h"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, ffn_dim=128,
                                                  word_embed_proj_dim=64), "model.decoder.layers"),
    "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=256, d_model=64, n_layers=3, n_heads=4), "transformer.blocks"),
    "bart": ("BartConfig", "BartForCausalLM", dict(vocab_size=256, d_model=64, decoder_layers=3, encoder_layers=3, decoder_attention_heads=4,
                                                    encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128), "model.decoder.layers"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                              intermediate_size=128), "gpt_neox.layers"),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_golden_captures_any_decoder_stack(family):
    import transformers

    from nhil.golden.generate import generate_golden
    from nhil.models.registry import ModelBundle

    cfg_cls, cls, kw, layers_path = LAYOUTS[family]
    torch.manual_seed(0)
    m = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    t, meta = generate_golden(ModelBundle(name=family, model=m, tokenizer=None, weights_id="seed:0", source=""), [1, 2, 3, 4], 3)
    assert meta["layers_path"] == layers_path and meta["num_layers"] == "3"
    full = torch.cat([t["prompt_ids"], t["tokens"][:-1]]).unsqueeze(0)
    with torch.no_grad():
        hs = m(input_ids=full, output_hidden_states=True, use_cache=False).hidden_states
    for i in range(2):  # transformers' hidden_states[i+1] is layer i's output (the last one may be after the final norm)
        assert torch.equal(t[f"act.model.layers.{i}"], hs[i + 1][0]), (family, i)
    assert torch.equal(t["act.model.embed_tokens"], m.get_input_embeddings()(full)[0])


def _no_modulelist_llama():
    from nhil.models.llama import build_llama_tiny

    b = build_llama_tiny()
    b.model.model.layers = torch.nn.Sequential(*b.model.model.layers)  # same forward, no ModuleList to find
    b.name = "llama-seq"
    return b


def test_uncapturable_model_is_a_clear_golden_error():
    from nhil.golden.generate import generate_golden

    with pytest.raises(GoldenError, match="no torch.nn.ModuleList of 2 .*LlamaForCausalLM|LlamaForCausalLM.*no torch.nn.ModuleList of 2"):
        generate_golden(_no_modulelist_llama(), [1, 2, 3], 2)


def test_uncapturable_model_verifies_as_load_fail(tmp_path, monkeypatch):
    from nhil.models import registry

    b = _no_modulelist_llama()
    monkeypatch.setitem(registry._CACHE, "llama-seq", b)
    monkeypatch.setitem(registry._REGISTRY, "llama-seq", (lambda: b, "test"))
    rep = _verify("llama-seq", tmp_path)
    assert rep["outcome"] == "LOAD_FAIL" and rep["stage"] == "golden" and "ModuleList" in rep["error"]


def test_gguf_parsed_once_loads_the_same_model_from_one_parse(tmp_path, tiny):
    """``nhil.models.gguf_once.parsed_once`` (used by the SmolLM2 loader): the same weights and config as a plain
    transformers load, from one GGUFReader instead of one per consumer; the patch is gone afterwards."""
    gguf = pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from nhil.models.gguf_once import parsed_once

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, tiny)
    made = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, *a, **k):
            made.append(a[0])
            super().__init__(*a, **k)

    def load():
        return AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32, local_files_only=True)

    gguf.GGUFReader = Counting
    try:
        plain = load()
        n_plain = len(made)
        made.clear()
        with parsed_once():
            once = load()
        n_once = len(made)
    finally:
        gguf.GGUFReader = real
    assert n_plain >= 2 and n_once == 1, (n_plain, n_once)
    assert gguf.GGUFReader is real and not hasattr(gguf.get_tensor_name_map, "cache_info")
    a, b = plain.state_dict(), once.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain.config.to_dict() == once.config.to_dict()
