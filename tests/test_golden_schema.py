"""Goldens are validated on load (shapes/dtypes against the metadata and the model), the writer
refuses what it could not read back, --regen compares like with like, temp files are cleaned,
files honour the umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from nhil.errors import GoldenError
from nhil.golden.schema import golden_shapes, why_not_comparable
from nhil.golden.store import load_golden, write_golden


@pytest.fixture(scope="module")
def tiny():
    from nhil.golden.generate import generate_golden
    from nhil.models import get_model

    b = get_model("llama-tiny")
    ids = b.encode(None)
    t, meta = generate_golden(b, ids, 4)
    return b, ids, t, meta


def test_golden_shapes_of_the_tiny_model(tiny):
    b, _, _, meta = tiny
    assert golden_shapes(b.model) == {"vocab_size": 256, "num_layers": 2, "hidden_size": 64}
    assert {k: int(meta[k]) for k in ("vocab_size", "num_layers", "hidden_size")} == golden_shapes(b.model)


def test_a_real_golden_loads_with_the_models_shapes(tiny, tmp_path):
    b, _, t, meta = tiny
    write_golden(tmp_path / "g.safetensors", t, meta)
    t2, _ = load_golden(tmp_path / "g.safetensors", shapes=golden_shapes(b.model))
    assert torch.equal(t2["logits"], t["logits"])


def test_logits_of_another_vocabulary_are_refused_against_the_model(tiny, tmp_path):
    """The issue's case: a golden with logits [T, 10] (its metadata says vocab 10) for a model of vocab 256."""
    b, _, t, meta = tiny
    t = dict(t, logits=t["logits"][:, :10].contiguous(), tokens=t["tokens"] % 10)
    write_golden(tmp_path / "g.safetensors", t, dict(meta, vocab_size="10"))
    load_golden(tmp_path / "g.safetensors")  # consistent with itself
    with pytest.raises(GoldenError, match=r"metadata vocab_size is 10 but the model's is 256.*regenerate"):
        load_golden(tmp_path / "g.safetensors", shapes=golden_shapes(b.model))


@pytest.mark.parametrize("name,bad,match", [
    ("logits", lambda t: t[:, :10].contiguous(), r"'logits' has shape \[4, 10\], expected \[n_tokens, vocab_size\] = \[4, 256\]"),
    ("logits", lambda t: t[:3].contiguous(), r"'logits' has shape \[3, 256\]"),
    ("tokens", lambda t: t[:2].contiguous(), r"'tokens' is torch.int64 \[2\], expected int64 \[4\]"),
    ("tokens", lambda t: t.to(torch.int32), r"'tokens' is torch.int32"),
    ("tokens", lambda t: t + 256, r"ids outside the vocabulary \[0, 256\)"),
    ("prompt_ids", lambda t: t[:1].contiguous(), r"'prompt_ids' is torch.int64 \[1\]"),
    ("act.model.layers.1", lambda t: t[:, :8].contiguous(), r"'act.model.layers.1' has shape \[\d+, 8\]"),
    ("act.model.layers.1", None, r"layers \[0\], expected layers 0..1"),
    ("act.model.embed_tokens", lambda t: t[:2].contiguous(), r"'act.model.embed_tokens' has shape \[2, 64\]"),
])
def test_tensors_that_disagree_with_the_metadata_are_refused(tiny, tmp_path, name, bad, match):
    _, _, t, meta = tiny
    t = dict(t)
    if bad is None:
        del t[name]
    else:
        t[name] = bad(t[name])
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    with pytest.raises(GoldenError, match=match) as e:
        load_golden(p)
    assert str(p) in str(e.value) and "regenerate" in str(e.value)


def test_verify_refuses_a_golden_of_another_shape_at_the_golden_stage(tiny, tmp_path):
    """Before: every stage ran and the compare stage ended as CRASH; now LOAD_FAIL at stage golden."""
    from nhil.golden.store import golden_key, golden_path
    from nhil.verify import VerifyOptions, verify

    b, ids, t, meta = tiny
    gdir = tmp_path / "goldens"
    path = golden_path(gdir, "llama-tiny", golden_key(ids, 4, b.weights_id, seed=0))
    write_golden(path, dict(t, logits=t["logits"][:, :10].contiguous(), tokens=t["tokens"] % 10), dict(meta, vocab_size="10"))
    rep = verify(VerifyOptions(model="llama-tiny", target="sim", tokens=4, goldens_dir=gdir, runs_dir=tmp_path / "runs"))
    assert rep["outcome"] == "LOAD_FAIL" and rep["stage"] == "golden", rep.get("error")
    assert "vocab_size is 10 but the model's is 256" in rep["error"]


def test_writer_refuses_reserved_names_and_low_precision_logits(tmp_path):
    p = tmp_path / "g.safetensors"
    with pytest.raises(GoldenError, match="'__metadata__' is reserved"):
        write_golden(p, {"__metadata__": torch.zeros(2)}, {})
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        with pytest.raises(GoldenError, match=f"'logits' is {dt}.*float32"):
            write_golden(p, {"logits": torch.zeros(2, 3, dtype=dt)}, {})
    with pytest.raises(GoldenError, match="'act.model.layers.0' is torch.bfloat16"):
        write_golden(p, {"act.model.layers.0": torch.zeros(2, 3, dtype=torch.bfloat16)}, {})
    assert not p.exists() and not (tmp_path / "MANIFEST.json").exists()  # refused before anything is written


def test_stale_temp_files_are_cleaned_on_the_next_write(tmp_path):
    stale = [tmp_path / ".g.safetensors.abc123.tmp", tmp_path / ".MANIFEST.json.xyz.tmp"]
    for s in stale:
        s.write_bytes(b"half a file")
    other = tmp_path / ".notes.tmp"  # not ours: left alone
    other.write_text("x")
    write_golden(tmp_path / "h.safetensors", {"logits": torch.zeros(1, 2)}, {})
    assert not any(s.exists() for s in stale) and other.exists()


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        write_golden(tmp_path / "g.safetensors", {"logits": torch.zeros(1, 2)}, {})
    finally:
        os.umask(old)
    for name in ("g.safetensors", "MANIFEST.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_why_not_comparable():
    a = {"logits": torch.zeros(4, 256)}
    assert why_not_comparable(a, {"logits": torch.ones(4, 256)}) is None
    assert "old logits are torch.float32 [4, 10], new ones torch.float32 [4, 256]" in why_not_comparable({"logits": torch.zeros(4, 10)}, a)
    assert why_not_comparable({}, a) == "the old golden has no logits"


def test_regen_over_a_golden_of_another_shape_says_why_not_compared(tiny, tmp_path):
    """Before: `nhil golden --regen` wrote the new golden, then printed a traceback comparing [4, 10] with [4, 256]."""
    from nhil.golden.store import golden_key, golden_path

    b, ids, t, meta = tiny
    gdir = tmp_path / "goldens"
    path = golden_path(gdir, "llama-tiny", golden_key(ids, 4, b.weights_id, seed=0))
    write_golden(path, dict(t, logits=t["logits"][:, :10].contiguous(), tokens=t["tokens"] % 10), dict(meta, vocab_size="10"))
    r = subprocess.run([sys.executable, "-m", "nhil.cli", "golden", "-m", "llama-tiny", "--tokens", "4", "--regen", "--goldens-dir", str(gdir)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "not compared (old logits are torch.float32 [4, 10], new ones torch.float32 [4, 256]" in r.stdout
    t2, _ = load_golden(path, shapes=golden_shapes(b.model))
    assert torch.equal(t2["logits"], t["logits"])
