"""Model cache (``nhil.models.load_cache``): a cached GGUF load is the direct load bit for bit; bad entries are refused and rebuilt.

Reference: the direct transformers load of the same tiny GGUF (``nhil.models.from_path._load_gguf_direct``:
``from_pretrained(folder, gguf_file=name)`` + its tokenizer), written by gguf-py with a byte-level BPE vocabulary
(``tests/gguf_files.py``). Compared: every state-dict tensor and buffer as int32 bits, the tied embedding, the
config JSON (and the program cache key built from it), the generation config, the attention implementation, the
tokenizer's ids and text on a few strings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gguf_files import CHAT_TEMPLATE, tokenizer_vocab_size, write_gguf  # tests/gguf_files.py
from nhil.models import load_cache
from nhil.util import file_sha256

TEXTS = ["The capital of France is", "the thin  tea\n\tin a tin", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def tok_model():
    """A tiny seeded Llama whose vocabulary is the test GGUF tokenizer's (264 tokens)."""
    from transformers import LlamaForCausalLM

    from nhil.models.llama import tiny_llama_config

    torch.manual_seed(3)
    cfg = tiny_llama_config()
    cfg.vocab_size = tokenizer_vocab_size()
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model.eval()


@pytest.fixture()
def gguf_path(tmp_path, tok_model) -> Path:
    path = tmp_path / "src" / "tiny-tok.gguf"
    path.parent.mkdir()
    write_gguf(path, tok_model, tokenizer=True)
    return path


class _Direct:
    """The direct load as ``load_fn``, counting its calls."""

    def __init__(self, path: Path):
        self.path, self.calls = path, 0

    def __call__(self):
        from nhil.models.from_path import _load_gguf_direct

        self.calls += 1
        return _load_gguf_direct(self.path)


def _cached(path: Path, cache_dir: Path, logs: list, direct: _Direct | None = None):
    direct = direct or _Direct(path)
    model, tok, info = load_cache.cached_gguf_load(path, file_sha256(path), direct, cache_dir, logs.append)
    return model, tok, info, direct


def _entry(cache_dir: Path, path: Path) -> Path:
    from nhil.compiler.cache import key_of

    key = key_of(load_cache.key_parts(file_sha256(path)))
    return cache_dir / key[:2] / key


def _program_key(model, path: Path) -> str:
    from nhil.compiler.cache import key_of, verify_key_parts
    from nhil.isa import DEVICE_PRESETS
    from nhil.models.registry import ModelBundle

    b = ModelBundle(name="t", model=model, tokenizer=None, weights_id="sha256:" + file_sha256(path), source=str(path))
    return key_of(verify_key_parts("t", b, "bf16", DEVICE_PRESETS["rtl-tiny"], 64))


def assert_same_load(ref, ref_tok, model, tok, path: Path) -> None:
    """``model`` / ``tok`` are the direct load ``ref`` / ``ref_tok``: bits, ties, config JSON, program key, tokenizer behaviour."""
    a, b = ref.state_dict(), model.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32, k
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
    ba, bb = dict(ref.named_buffers()), dict(model.named_buffers())  # non-persistent ones too (rotary inv_freq)
    assert list(ba) == list(bb) and all(torch.equal(ba[k].view(torch.int32), bb[k].view(torch.int32)) for k in ba)
    assert model.lm_head.weight is model.model.embed_tokens.weight and ref.lm_head.weight is ref.model.embed_tokens.weight
    assert type(model) is type(ref) and not model.training
    assert model.config.to_json_string(use_diff=False) == ref.config.to_json_string(use_diff=False)
    assert _program_key(model, path) == _program_key(ref, path)
    assert model.generation_config.to_json_string() == ref.generation_config.to_json_string()
    assert model.config._attn_implementation == ref.config._attn_implementation
    assert ref_tok is not None and type(tok) is type(ref_tok)
    for s in TEXTS:
        for special in (False, True):
            ids = ref_tok(s, add_special_tokens=special)["input_ids"]
            assert tok(s, add_special_tokens=special)["input_ids"] == ids, s
            assert tok.decode(ids) == ref_tok.decode(ids) and tok.decode(ids, skip_special_tokens=True) == ref_tok.decode(ids, skip_special_tokens=True)
    assert tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
    assert tok.special_tokens_map == ref_tok.special_tokens_map and tok.get_vocab() == ref_tok.get_vocab()
    with torch.no_grad():
        ids = torch.tensor([ref_tok(TEXTS[1])["input_ids"]])
        assert torch.equal(model(ids).logits.view(torch.int32), ref(ids).logits.view(torch.int32))


def test_cold_then_warm_load_is_the_direct_load_bit_for_bit(gguf_path, tmp_path):
    ref, ref_tok = _Direct(gguf_path)()
    logs: list[str] = []
    cold, cold_tok, i1, d1 = _cached(gguf_path, tmp_path / "c", logs)
    warm, warm_tok, i2, d2 = _cached(gguf_path, tmp_path / "c", logs)
    assert (d1.calls, d2.calls, i1["hit"], i2["hit"]) == (1, 0, False, True)
    assert [m.split(":")[0] for m in logs] == ["model cache", "model cache"] and "stored" in logs[0] and "hit" in logs[1], logs
    for m, t in ((cold, cold_tok), (warm, warm_tok)):
        assert_same_load(ref, ref_tok, m, t, gguf_path)
    assert json.loads(warm.config.to_json_string(use_diff=False))["quantization_config"]["gguf_file"] == gguf_path.name
    # the entry is transformers' save_pretrained folder: the tied embedding stored once, every file in the manifest
    from safetensors import safe_open

    entry = _entry(tmp_path / "c", gguf_path)
    man = json.loads((entry / "manifest.json").read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(man["files"])
    assert sorted(p.name for p in entry.iterdir()) == sorted([*man["files"], "manifest.json"])
    assert all(man["files"][n]["sha256"] == file_sha256(entry / n) for n in man["files"])
    with safe_open(str(entry / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert man["ties"] == [["lm_head.weight", "model.embed_tokens.weight"]] and i2["bytes"] == sum(f["bytes"] for f in man["files"].values())


def test_the_same_file_elsewhere_is_one_entry_with_its_own_location(gguf_path, tmp_path):
    logs: list[str] = []
    _cached(gguf_path, tmp_path / "c", logs)
    other = tmp_path / "elsewhere" / "renamed.gguf"
    other.parent.mkdir()
    shutil.copy(gguf_path, other)
    model, tok, info, direct = _cached(other, tmp_path / "c", logs)
    assert info["hit"] and direct.calls == 0
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    assert cfg["_name_or_path"] == str(other.parent) and cfg["quantization_config"]["gguf_file"] == "renamed.gguf"
    assert_same_load(*_Direct(other)(), model, tok, other)


def _flip_byte(entry: Path) -> Path:
    p = entry / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's data: same size, another sha256
    p.write_bytes(bytes(data))
    return p


def _damage(entry: Path, case: str) -> tuple[Path, str]:
    """Damage the entry as ``case``; the path and the words the refusal must name."""
    man_p = entry / "manifest.json"
    if case == "flipped_byte":
        return _flip_byte(entry), "sha256"
    if case == "truncated_tokenizer":
        p = entry / "tokenizer.json"
        p.write_bytes(p.read_bytes()[:-10])
        return p, "bytes"
    if case == "missing_file":
        (entry / "tokenizer.json").unlink()
        return entry, "missing ['tokenizer.json']"
    if case == "extra_file":  # a file from_pretrained would read (a PEFT adapter)
        (entry / "adapter_config.json").write_text("{}")
        return entry, "extra ['adapter_config.json']"
    if case == "no_manifest":
        man_p.unlink()
        return entry, "no manifest"
    if case == "garbage_manifest":
        man_p.write_text("{not json")
        return man_p, "unreadable manifest"
    man = json.loads(man_p.read_text())
    if case == "stale_key_parts":
        man["key_parts"]["transformers"] = "4.0.0"
        man_p.write_text(json.dumps(man))
        return man_p, "stale: key parts differ in ['transformers']"
    if case == "stale_schema":
        man["schema"] = load_cache.LOADER_SCHEMA + 1
        man_p.write_text(json.dumps(man))
        return man_p, "stale: manifest schema"
    if case == "bad_files_table":
        man["files"]["model.safetensors"] = "ok"
        man_p.write_text(json.dumps(man))
        return man_p, "no table of files"
    if case == "other_config":  # a manifest recording another config than the folder loads
        cfg = json.loads(man["config_json"])
        cfg["rms_norm_eps"] = 1e-3
        man["config_json"] = json.dumps(cfg)
        man_p.write_text(json.dumps(man))
        return entry, "config differs in ['rms_norm_eps']"
    raise AssertionError(case)


CASES = ["flipped_byte", "truncated_tokenizer", "missing_file", "extra_file", "no_manifest", "garbage_manifest", "stale_key_parts",
         "stale_schema", "bad_files_table", "other_config"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_or_stale_entry_is_refused_with_a_message_and_rebuilt(gguf_path, tmp_path, case):
    ref, ref_tok = _Direct(gguf_path)()
    _cached(gguf_path, tmp_path / "c", [])
    entry = _entry(tmp_path / "c", gguf_path)
    where, words = _damage(entry, case)
    logs: list[str] = []
    model, tok, info, direct = _cached(gguf_path, tmp_path / "c", logs)
    refusals = [m for m in logs if "refusing" in m]
    assert len(refusals) == 1 and "\n" not in refusals[0], logs
    assert f"refusing entry {where}:" in refusals[0] and words in refusals[0] and "rebuilding it" in refusals[0], refusals
    assert direct.calls == 1 and not info["hit"] and any("stored" in m for m in logs)
    assert_same_load(ref, ref_tok, model, tok, gguf_path)
    _, _, again, d = _cached(gguf_path, tmp_path / "c", [])  # the rebuilt entry is a clean hit
    assert again["hit"] and d.calls == 0


def test_a_crash_while_writing_leaves_no_entry(gguf_path, tmp_path, monkeypatch):
    """The manifest is the last write of a temporary folder that is renamed into place: a build that dies before it leaves a miss."""
    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(load_cache, "atomic_write_text", crash)
    logs: list[str] = []
    model, tok, info, direct = _cached(gguf_path, tmp_path / "c", logs)
    assert direct.calls == 1 and not info["hit"] and model is not None and tok is not None
    assert len(logs) == 1 and "not caching" in logs[0] and "No space left" in logs[0]
    entry = _entry(tmp_path / "c", gguf_path)
    assert not entry.exists() and not list(entry.parent.glob(f".{entry.name}.*"))
    monkeypatch.undo()
    leftover = entry.parent / f".{entry.name}.999.tmp"  # what a killed process leaves: ignored, then removed
    shutil.copytree(gguf_path.parent, leftover)
    _, _, info, direct = _cached(gguf_path, tmp_path / "c", [])
    assert direct.calls == 1 and not leftover.exists() and (entry / "manifest.json").exists()


def test_nhil_cache_0_bypasses_the_cache(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("NHIL_CACHE", "0")
    logs: list[str] = []
    for _ in range(2):
        _, tok, info, direct = _cached(gguf_path, tmp_path / "c", logs)
        assert direct.calls == 1 and info == {"enabled": False, "hit": False, "seconds": info["seconds"]} and tok is not None
    assert not (tmp_path / "c").exists() and logs == []


def test_an_unusable_cache_folder_is_the_direct_load_with_a_message(gguf_path, tmp_path):
    (tmp_path / "c").write_text("a file where the cache folder should be")
    logs: list[str] = []
    _, tok, info, direct = _cached(gguf_path, tmp_path / "c", logs)
    assert direct.calls == 1 and not info["enabled"] and tok is not None
    assert len(logs) == 1 and "model cache: cannot use" in logs[0] and str(gguf_path) in logs[0]


def test_prune_drops_least_recently_used_model_entries(tmp_path, tok_model):
    import copy
    import os
    import time

    tok_model = copy.deepcopy(tok_model)
    paths, keys = [], []
    for i in range(3):
        p = tmp_path / f"m{i}" / "m.gguf"
        p.parent.mkdir()
        with torch.no_grad():
            tok_model.model.norm.weight.fill_(1.0 + i)  # three files, three keys
        write_gguf(p, tok_model, tokenizer=True)
        _cached(p, tmp_path / "c", [])
        paths.append(p)
        keys.append(_entry(tmp_path / "c", p).name)
        os.utime(_entry(tmp_path / "c", p) / "manifest.json", (time.time() - 100 + i, time.time() - 100 + i))
    _cached(paths[0], tmp_path / "c", [])  # a hit: m0 is now the most recently used
    sizes = [sum(f.stat().st_size for f in _entry(tmp_path / "c", p).iterdir()) for p in paths]  # equal to a few manifest bytes
    logs: list[str] = []
    gone = load_cache.prune(tmp_path / "c", max_bytes=sizes[0] + sizes[2], log=logs.append)
    assert gone == [keys[1]] and "model cache: pruned" in logs[0]
    assert not _entry(tmp_path / "c", paths[1]).exists() and _entry(tmp_path / "c", paths[2]).exists()
    assert _cached(paths[0], tmp_path / "c", [])[2]["hit"] and not _cached(paths[1], tmp_path / "c", [])[2]["hit"]


def test_build_llama_and_gguf_paths_load_through_the_cache(gguf_path, tmp_path, monkeypatch):
    """The registry's ``llama`` (its GGUF swapped for the tiny one) and ``--model x.gguf``: the bundle as with ``NHIL_CACHE=0``, the second load a hit."""
    from nhil.models import llama
    from nhil.models.from_path import load_model_path

    monkeypatch.setattr(llama, "smollm2_gguf_path", lambda: gguf_path)
    monkeypatch.setenv("NHIL_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("NHIL_CACHE", "0")
    ref, ref_path = llama.build_llama(), load_model_path(str(gguf_path), layers=1)
    monkeypatch.setenv("NHIL_CACHE", "1")
    assert ref.load["enabled"] is False
    for i in range(2):
        b = llama.build_llama()
        assert b.load["enabled"] and b.load["hit"] == (i == 1)  # what verify's report.json records as model_cache
        assert (b.weights_id, b.source, b.default_prompt, b.name) == (ref.weights_id, ref.source, ref.default_prompt, ref.name)
        assert b.weights_id == "sha256:" + file_sha256(gguf_path)
        assert_same_load(ref.model, ref.tokenizer, b.model, b.tokenizer, gguf_path)
        assert b.encode(None) == ref.encode(None) and b.decode(b.encode("the tin")) == ref.decode(ref.encode("the tin"))
        p = load_model_path(str(gguf_path), layers=1)
        assert p.weights_id == ref_path.weights_id and len(p.model.model.layers) == 1
        assert p.model.config.to_json_string(use_diff=False) == ref_path.model.config.to_json_string(use_diff=False)
    assert len(list((tmp_path / "root" / "models").glob("*/*/manifest.json"))) == 1  # one file, one entry, both loaders
