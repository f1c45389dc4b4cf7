"""Golden store, comparison metrics, tolerance profiles and report writers (tiny model only)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from nhil.errors import GoldenError
from nhil.golden import metrics as M
from nhil.golden import tolerances as TOL
from nhil.golden.store import MANIFEST_NAME, golden_key, golden_path, load_golden, read_manifest, write_golden

# ---------------------------------------------------------------- metrics


def test_cosine_orthogonal_parallel_and_zero():
    assert M.cosine([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert M.cosine([1.0, 2.0], [2.0, 4.0]) == pytest.approx(1.0)
    assert M.cosine([1.0, 2.0], [-1.0, -2.0]) == pytest.approx(-1.0)
    assert M.cosine([0.0, 0.0], [0.0, 0.0]) == 1.0
    assert M.cosine([0.0, 0.0], [1.0, 0.0]) == 0.0


def test_sqnr_by_hand():
    # ref=[3,4]: sum ref^2 = 25; diff=[0,-0.5]: sum diff^2 = 0.25; 10 log10(100) = 20 dB
    assert M.sqnr_db([3.0, 4.0], [3.0, 4.5]) == pytest.approx(20.0)
    assert M.sqnr_db(torch.tensor([3.0, 4.0]), np.array([3.0, 4.0])) == math.inf
    assert M.sqnr_db([0.0, 0.0], [1.0, 0.0]) == -math.inf


def test_error_norms_by_hand():
    ref, test = [3.0, 4.0], [3.0, 4.5]
    assert M.max_abs(ref, test) == 0.5
    assert M.mae(ref, test) == 0.25
    assert M.rel_l2(ref, test) == pytest.approx(0.5 / 5.0)
    assert M.rel_l2([0.0], [0.0]) == 0.0
    assert M.rel_l2([0.0], [1.0]) == math.inf


def test_bf16_input_is_widened():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s = M.sqnr_db(x, x.to(torch.bfloat16))
    assert 50.0 < s < 62.0  # one bf16 rounding ~55.6 dB (tolerances.py derivation)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes"):
        M.max_abs([1.0, 2.0], [1.0])


def test_pcc_guards_and_values():
    x = np.arange(10.0)
    assert M.pcc(x, 2 * x + 1) == pytest.approx(1.0)  # blind to scale/offset, as documented
    assert M.pcc(x, -x) == pytest.approx(-1.0)
    assert M.pcc_detail(np.ones(5), np.ones(5)) == (1.0, "both_constant")
    assert M.pcc_detail(np.ones(5), 2 * np.ones(5)) == (0.0, "both_constant")
    assert M.pcc_detail(np.ones(5), x[:5]) == (0.0, "one_constant")  # tt-metal#24928 returned 1.0 here
    assert M.pcc_detail([3.0], [3.0]) == (1.0, "both_constant")  # single element: no NaN
    v, flag = M.pcc_detail([1.0, math.nan, 3.0], [1.0, 2.0, 3.0])
    assert math.isnan(v) and flag == "nan"


def test_nan_reported_not_raised():
    ref, test = [1.0, 2.0, 3.0], [1.0, math.nan, 3.0]
    assert math.isnan(M.max_abs(ref, test))
    assert math.isnan(M.cosine(ref, test))
    assert math.isnan(M.sqnr_db(ref, test))
    d = M.compare_tensors(ref, test)
    assert d["nan_test"] == 1 and d["sqnr_db"] == "nan" and d["pcc_flag"] == "nan"
    json.dumps(d, allow_nan=False)  # JSON-safe
    assert M.compare_tensors(ref, ref)["sqnr_db"] == "inf"
    assert float(M.compare_tensors(ref, ref)["sqnr_db"]) == math.inf


def test_kl_two_class_by_hand():
    # logits [0, 0] -> p = (1/2, 1/2); logits [ln 3, 0] -> q = (3/4, 1/4)
    # KL(p||q) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3)
    kl = M.kl_divergence([[0.0, 0.0]], [[math.log(3.0), 0.0]])
    assert kl.shape == (1,)
    assert kl[0] == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-12)
    assert M.kl_divergence([0.0, 0.0], [0.0, 0.0])[0] == 0.0


def test_kl_matches_torch_kl_div():
    g = torch.Generator().manual_seed(1)
    ref, test = torch.randn(5, 50, generator=g) * 3, torch.randn(5, 50, generator=g) * 3
    lr = torch.log_softmax(ref.double(), -1)
    lt = torch.log_softmax(test.double(), -1)
    # kl_div(input=log q, target=log p, log_target=True) = sum p (log p - log q)
    expect = torch.nn.functional.kl_div(lt, lr, reduction="none", log_target=True).sum(-1)
    np.testing.assert_allclose(M.kl_divergence(ref, test), expect.numpy(), rtol=1e-10, atol=1e-14)


def test_top1_and_first_divergent_token():
    ref = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    test = np.array([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    assert M.top1_match(ref, test).tolist() == [True, False, True]
    assert M.top1_agreement(ref, test) == pytest.approx(2 / 3)
    assert M.first_divergent_token([1, 2, 3], [1, 2, 3]) is None
    assert M.first_divergent_token([1, 2, 3], torch.tensor([1, 5, 3])) == 1
    assert M.first_divergent_token([1, 2, 3], [1, 2]) == 2
    d = M.compare_logits(ref, test)
    assert d["first_top1_mismatch"] == 1 and len(d["steps"]) == 3
    json.dumps(d, allow_nan=False)


# ---------------------------------------------------------------- tolerances


def test_tolerance_check_names_metric_value_threshold_reason():
    good = {"cosine": 0.9999, "sqnr_db": 40.0, "kl": 0.001, "top1_agree": True, "max_abs": 0.1}
    assert TOL.check("bf16-act-fp32-acc", "logits", good) == []
    bad = dict(good, sqnr_db=12.0, top1_agree=False, max_abs=5.0)
    v = TOL.check("bf16-act-fp32-acc", "logits", bad)
    names = {x.metric: x for x in v}
    assert set(names) == {"sqnr_db", "top1_agree", "max_abs"}
    assert names["sqnr_db"].value == 12.0 and names["sqnr_db"].threshold == 25.0 and names["sqnr_db"].reason
    assert names["max_abs"].asserted is False  # observe-only
    assert {x.metric for x in TOL.failing(v)} == {"sqnr_db", "top1_agree"}
    assert "sqnr_db" in str(names["sqnr_db"])


def test_tolerance_nan_missing_and_inf_strings():
    v = TOL.check("bf16-act-fp32-acc", "hidden", {"cosine": "nan", "sqnr_db": "inf"})
    metrics = {x.metric for x in TOL.failing(v)}
    assert "cosine" in metrics and "sqnr_db" not in metrics  # NaN fails, inf (bit-exact) passes
    v = TOL.check("bf16-act-fp32-acc", "hidden", {})
    assert {"cosine", "sqnr_db"} <= {x.metric for x in TOL.failing(v)}  # not measured is not a pass
    with pytest.raises(ValueError, match="known"):
        TOL.check("no-such-profile", "hidden", {})


def test_tolerance_table_is_well_formed():
    for prof, kinds in TOL.PROFILES.items():
        for kind, table in kinds.items():
            if not isinstance(table, dict):
                continue
            for metric, th in table.items():
                assert ("min" in th) != ("max" in th), (prof, kind, metric)
                assert isinstance(th["asserted"], bool) and th["reason"], (prof, kind, metric)


# ---------------------------------------------------------------- store


def _sample():
    return {"logits": torch.randn(3, 7), "tokens": torch.tensor([1, 2, 3])}, {"model": "m", "weights_id": "seed:0", "n_tokens": "3"}


def test_store_round_trip_and_manifest(tmp_path):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    digest = write_golden(p, t, meta)
    assert read_manifest(tmp_path)["g.safetensors"]["sha256"] == digest
    t2, m2 = load_golden(p, expect={"model": "m", "n_tokens": "3"})
    assert torch.equal(t2["logits"], t["logits"]) and torch.equal(t2["tokens"], t["tokens"])
    for k in ("schema_version", "created", "torch_version", "transformers_version", "nhil_version", "safetensors_version"):
        assert k in m2
    assert m2["schema_version"] == "1" and m2["model"] == "m"
    assert sorted(os.listdir(tmp_path)) == sorted(["g.safetensors", MANIFEST_NAME, MANIFEST_NAME + ".lock"])  # no temp files


def test_store_missing_file(tmp_path):
    with pytest.raises(GoldenError, match="does not exist.*--regen"):
        load_golden(tmp_path / "nope.safetensors")


def test_store_corrupted_byte_mentions_sha256(tmp_path):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # inside tensor data: still parses
    p.write_bytes(bytes(data))
    with pytest.raises(GoldenError, match="sha256") as e:
        load_golden(p)
    assert str(p) in str(e.value) and "corrupt or was edited" in str(e.value) and "regen" in str(e.value).lower()


def test_store_truncated_file(tmp_path):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(GoldenError, match="not a valid safetensors") as e:
        load_golden(p)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_store_not_in_manifest(tmp_path):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(GoldenError, match="not recorded"):
        load_golden(p)


def test_store_metadata_mismatch_lists_keys(tmp_path):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    with pytest.raises(GoldenError) as e:
        load_golden(p, expect={"model": "other", "weights_id": "seed:0", "prompt": "hi"})
    msg = str(e.value)
    assert "model: stored 'm' vs expected 'other'" in msg
    assert "prompt: stored <absent> vs expected 'hi'" in msg
    assert "weights_id" not in msg


def test_store_unknown_schema(tmp_path, monkeypatch):
    import nhil.golden.store as S

    monkeypatch.setattr(S, "SCHEMA_VERSION", "99")
    t, meta = _sample()
    write_golden(tmp_path / "g.safetensors", t, meta)
    monkeypatch.undo()
    with pytest.raises(GoldenError, match="schema_version '99'"):
        load_golden(tmp_path / "g.safetensors")


def test_store_crash_during_write_keeps_old_golden(tmp_path, monkeypatch):
    t, meta = _sample()
    p = tmp_path / "g.safetensors"
    write_golden(p, t, meta)
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        write_golden(p, {"logits": torch.zeros(2)}, meta)
    monkeypatch.undo()
    assert p.read_bytes() == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    tensors, _ = load_golden(p)  # manifest still matches the old file
    assert torch.equal(tensors["logits"], t["logits"])


def test_store_rejects_non_str_metadata(tmp_path):
    with pytest.raises(TypeError, match="str -> str"):
        write_golden(tmp_path / "g.safetensors", {"x": torch.zeros(1)}, {"n": 3})


def test_golden_path_stable():
    k = golden_key([1, 2, 3], 8, "seed:0")
    a = golden_path("/g", "llama-tiny", k)
    assert a == golden_path("/g", "llama-tiny", golden_key([1, 2, 3], 8, "seed:0"))
    assert a != golden_path("/g", "llama-tiny", golden_key([1, 2, 4], 8, "seed:0"))
    assert a.name.startswith("llama-tiny-") and a.suffix == ".safetensors"


# ---------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def tiny_golden():
    from nhil.golden.generate import generate_golden
    from nhil.models import get_model

    bundle = get_model("llama-tiny")
    ids = bundle.encode(None)
    tensors, meta = generate_golden(bundle, ids, 6)
    return bundle, ids, tensors, meta


def test_generate_golden_shapes_and_argmax(tiny_golden):
    bundle, ids, t, meta = tiny_golden
    cfg = bundle.model.config
    P, T, H, V = len(ids), 6, cfg.hidden_size, cfg.vocab_size
    assert t["prompt_ids"].dtype == torch.int64 and t["prompt_ids"].tolist() == ids
    assert t["tokens"].dtype == torch.int64 and t["tokens"].shape == (T,)
    assert t["logits"].dtype == torch.float32 and t["logits"].shape == (T, V)
    assert torch.equal(t["logits"].argmax(-1), t["tokens"])
    assert meta["teacher_forced_argmax_matches"] == "true"
    names = ["act.model.embed_tokens"] + [f"act.model.layers.{i}" for i in range(cfg.num_hidden_layers)]
    for n in names:
        assert t[n].dtype == torch.float32 and t[n].shape == (P + T - 1, H), n
    assert all(isinstance(v, str) for v in meta.values())
    assert json.loads(meta["prompt_ids"]) == ids and meta["n_tokens"] == "6" and meta["generator"] == "pytorch-eager"


def test_generate_golden_last_layer_reproduces_logits(tiny_golden):
    bundle, ids, t, _ = tiny_golden
    m = bundle.model
    last = t[f"act.model.layers.{m.config.num_hidden_layers - 1}"]
    with torch.no_grad():
        logits = m.lm_head(m.model.norm(last))[len(ids) - 1 :]
    torch.testing.assert_close(logits, t["logits"], rtol=1e-5, atol=1e-5)
    # embeddings hook captured the embedding of the teacher-forced sequence
    seq = torch.cat([t["prompt_ids"], t["tokens"][:-1]])
    torch.testing.assert_close(t["act.model.embed_tokens"], m.model.embed_tokens(seq).detach())


def test_generate_golden_store_round_trip(tiny_golden, tmp_path):
    bundle, ids, t, meta = tiny_golden
    p = golden_path(tmp_path, bundle.name, golden_key(ids, 6, bundle.weights_id))
    write_golden(p, t, meta)
    t2, m2 = load_golden(p, expect={"model": "llama-tiny", "weights_id": bundle.weights_id, "prompt_ids": json.dumps(ids)})
    assert set(t2) == set(t) and torch.equal(t2["logits"], t["logits"])


# ---------------------------------------------------------------- report


def _sample_report():
    return {
        "outcome": "MISMATCH",
        "model": "llama-tiny",
        "target": "sim",
        "reproducer": "make verify MODEL=llama-tiny TARGET=sim QUANT=bf16 SEED=0",
        "checks": [{"name": "logits", "passed": False, "detail": "step 2 sqnr 12 dB < 25"}, {"name": "tokens", "passed": True, "detail": "6/6"}],
        "steps": [
            {"step": 0, "position": 5, "golden_token": 96, "target_token": 96, "cosine": 0.99991, "sqnr_db": 41.25, "kl": 0.0012, "max_abs": 0.031, "top1_agree": True},
            {"step": 1, "position": 6, "golden_token": 120, "target_token": 7, "cosine": 0.91, "sqnr_db": 12.0, "kl": 0.3, "max_abs": 2.5, "top1_agree": False},
        ],
        "layers": [
            {"layer": "model.layers.0", "cosine": 0.9999, "sqnr_db": 48.0, "max_abs": 0.01, "passed": True},
            {"layer": "model.layers.1", "cosine": 0.95, "sqnr_db": 13.0, "max_abs": 1.5, "passed": False},
            {"layer": "model.layers.2", "cosine": 1.0, "sqnr_db": "inf", "max_abs": 0.0, "passed": True},
        ],
        "first_divergent_layer": "model.layers.1",
        "timings": {"compile": 1.5, "run": 0.25},
        "thresholds": TOL.PROFILES["bf16-act-fp32-acc"],
    }


def test_render_markdown_tables():
    from nhil.report import render_markdown

    md = render_markdown(_sample_report())
    assert md.startswith("# nhil verify: MISMATCH")
    assert "| 1 | 6 | 120 | 7 | 0.9100000000 (1-cos 0.09) | 12 | 0.3 | 2.5 | **NO** |" in md  # cosine with enough digits to differ from 1
    assert "| model.layers.1 | 0.9500000000 (1-cos 0.05) | 13 | 1.5 | **FAIL** |" in md
    assert "| model.layers.2 | 1 (exact) |" in md
    assert "| logits | **FAIL** | step 2 sqnr 12 dB < 25 |" in md
    assert "First divergent layer: **model.layers.1**" in md
    assert "make verify MODEL=llama-tiny" in md
    assert "| logits.sqnr_db | >= 25 | asserted |" in md
    assert "| hidden.pcc | >= 0.99 | observe-only |" in md
    assert "<- FAIL" in md and "inf dB" in md
    assert "| compile | 1.5 |" in md


def test_write_json_and_summary(tmp_path, capsys):
    from nhil.report import atomic_write_text, print_summary, write_json

    rep = _sample_report()
    rep["steps"][0]["sqnr_db"] = math.inf
    write_json(tmp_path / "r.json", rep)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["steps"][0]["sqnr_db"] == "inf" and back["thresholds"]["hidden"]["max_abs"]["max"] == "inf"
    atomic_write_text(tmp_path / "sub" / "r.md", "hello\n")
    assert (tmp_path / "sub" / "r.md").read_text() == "hello\n"
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    print_summary(rep)
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "model.layers.1" in err


def test_store_concurrent_writers_keep_all_manifest_entries(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    t, meta = _sample()
    names = [f"g{i}.safetensors" for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        digests = list(ex.map(lambda n: write_golden(tmp_path / n, t, meta), names))
    files = read_manifest(tmp_path)
    assert set(files) == set(names)
    assert [files[n]["sha256"] for n in names] == digests
    for n in names:
        load_golden(tmp_path / n)
