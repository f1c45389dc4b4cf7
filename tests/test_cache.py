"""Program cache (``nhil.compiler.cache``): hits, corrupt and stale entries rebuilt with a message, parallel runs share one entry."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nhil.compiler import cache
from nhil.compiler.builder import ProgramBuilder
from nhil.isa import DEVICE_PRESETS

DEV = DEVICE_PRESETS["rtl-tiny"]


def _program(seed: int = 0):
    b = ProgramBuilder(DEV)
    w = np.random.default_rng(seed).normal(size=(20, 40)).astype(np.float32)
    b.buffer("x", 40)
    b.buffer("y", 20)
    b.gemv(b.place_matrix("w", w), "x", "y")
    return b.finish({"inputs": {}, "outputs": {"y": "y"}}, {})


class _Builder:
    def __init__(self, seed=0):
        self.calls = 0
        self.seed = seed

    def __call__(self):
        self.calls += 1
        return _program(self.seed), {"built": self.calls}


PARTS = {"model": "unit", "weights_id": "seed:0", "device": DEV.name, "quant": "bf16"}


def _stem(tmp_path, parts=PARTS) -> Path:
    k = cache.key_of(parts)
    return tmp_path / k[:2] / k


def test_miss_then_hit_returns_the_same_program_without_building(tmp_path):
    build, logs = _Builder(), []
    p1, m1, i1 = cache.cached_compile(PARTS, build, tmp_path, logs.append)
    p2, m2, i2 = cache.cached_compile(PARTS, build, tmp_path, logs.append)
    assert (i1["hit"], i2["hit"], build.calls) == (False, True, 1)
    assert p2.encode() == p1.encode() and m2 == m1 == {"built": 1}
    man = json.loads(_stem(tmp_path).with_suffix(".json").read_text())
    assert man["key_parts"] == PARTS and man["bytes"] == len(p1.encode())
    # any key part changes the key: a different recipe is another entry
    _, _, i3 = cache.cached_compile({**PARTS, "quant": "q4_1"}, build, tmp_path, logs.append)
    assert not i3["hit"] and build.calls == 2


@pytest.mark.parametrize("damage, why", [
    (lambda s: s.with_suffix(".pimb").write_bytes(s.with_suffix(".pimb").read_bytes()[:-7]), "corrupt: .* bytes with sha256"),
    (lambda s: s.with_suffix(".pimb").write_bytes(bytes([s.with_suffix(".pimb").read_bytes()[0] ^ 1]) + s.with_suffix(".pimb").read_bytes()[1:]), "corrupt: .* sha256"),
    (lambda s: s.with_suffix(".pimb").unlink(), "corrupt: program file unreadable"),
    (lambda s: s.with_suffix(".json").write_text("{not json"), "corrupt manifest"),
])
def test_corrupt_entry_is_refused_with_a_message_and_rebuilt(tmp_path, damage, why):
    build, logs = _Builder(), []
    good = cache.cached_compile(PARTS, build, tmp_path, logs.append)[0].encode()
    damage(_stem(tmp_path))
    p, _, info = cache.cached_compile(PARTS, build, tmp_path, logs.append)
    assert not info["hit"] and build.calls == 2 and p.encode() == good
    refused = [m for m in logs if "refusing entry" in m]
    assert len(refused) == 1 and str(_stem(tmp_path)) in refused[0] and "rebuilding" in refused[0]
    assert __import__("re").search(why, refused[0]), refused[0]
    assert cache.cached_compile(PARTS, build, tmp_path, logs.append)[2]["hit"]  # the rebuilt entry is good


def test_entry_whose_sha_matches_but_program_does_not_decode_is_rebuilt(tmp_path):
    import hashlib

    build, logs = _Builder(), []
    cache.cached_compile(PARTS, build, tmp_path, logs.append)
    s = _stem(tmp_path)
    junk = b"NOTAPIMB" * 10
    s.with_suffix(".pimb").write_bytes(junk)
    man = json.loads(s.with_suffix(".json").read_text())
    man.update(bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    s.with_suffix(".json").write_text(json.dumps(man))
    _, _, info = cache.cached_compile(PARTS, build, tmp_path, logs.append)
    assert not info["hit"] and any("does not decode" in m for m in logs)


@pytest.mark.parametrize("edit, what", [
    (lambda m: m["key_parts"].update(nhil_source_sha256="0" * 64), "nhil_source_sha256"),
    (lambda m: m.update(schema=0), "schema 0"),
])
def test_stale_entry_is_refused_with_a_message_and_rebuilt(tmp_path, edit, what):
    """An entry whose manifest records other key parts (written by other code) or another schema is stale."""
    parts = {**PARTS, "nhil_source_sha256": "a" * 64}
    build, logs = _Builder(), []
    cache.cached_compile(parts, build, tmp_path, logs.append)
    mp = _stem(tmp_path, parts).with_suffix(".json")
    man = json.loads(mp.read_text())
    edit(man)
    mp.write_text(json.dumps(man))
    _, _, info = cache.cached_compile(parts, build, tmp_path, logs.append)
    assert not info["hit"] and build.calls == 2
    msg = [m for m in logs if "refusing entry" in m]
    assert len(msg) == 1 and "stale" in msg[0] and what in msg[0], msg


_WORKER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_cache import PARTS, _program
    from nhil.compiler import cache

    def build():
        with open({log!r}, "a") as f:
            f.write("build\\n")
        time.sleep(1.5)  # hold the lock while the other process starts and waits
        return _program(), {{"by": sys.argv[1]}}

    prog, meta, info = cache.cached_compile(PARTS, build, Path({root!r}), lambda m: None)
    print(json.dumps({{"hit": info["hit"], "sha": __import__("hashlib").sha256(prog.encode()).hexdigest(), "meta": meta}}))
""")


def test_two_concurrent_processes_share_one_entry(tmp_path):
    log = tmp_path / "builds.log"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(tests=str(Path(__file__).parent), log=str(log), root=str(tmp_path / "cache")))
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert log.read_text().count("build") == 1  # one build under the lock; the other process read the entry
    assert sorted(o["hit"] for o in outs) == [False, True]
    assert outs[0]["sha"] == outs[1]["sha"] == __import__("hashlib").sha256(_program().encode()).hexdigest()
    assert outs[0]["meta"] == outs[1]["meta"]
    entry = _stem(tmp_path / "cache")
    assert cache._load(entry, cache.key_of(PARTS), PARTS, print) is not None  # the shared entry is intact


def test_verify_second_run_is_a_cache_hit_with_the_same_result(tmp_path, monkeypatch):
    from nhil.verify import VerifyOptions, verify

    monkeypatch.setenv("NHIL_CACHE_DIR", str(tmp_path / "cache"))
    reps = []
    for _ in range(2):
        reps.append(verify(VerifyOptions(model="llama-tiny", tokens=4, goldens_dir=tmp_path / "g", runs_dir=tmp_path / "runs")))
    cold, warm = reps
    assert cold["outcome"] == warm["outcome"] == "PASS", (cold.get("error"), warm.get("error"))
    assert cold["program_cache"]["hit"] is False and warm["program_cache"]["hit"] is True
    assert {"export", "raise", "lower", "encode"} <= set(cold["timings"]) and not {"export", "raise", "lower", "encode"} & set(warm["timings"])
    assert warm["raised_primitives"] == cold["raised_primitives"] and warm["export_nodes"] == cold["export_nodes"]
    assert [s["sqnr_db"] for s in warm["steps"]] == [s["sqnr_db"] for s in cold["steps"]]  # the same program ran
    assert warm["target_tokens"] == cold["target_tokens"]


def test_prune_drops_least_recently_used_entries_beyond_the_cap(tmp_path):
    import os
    import time

    logs = []
    keys = []
    for i in range(3):
        parts = {**PARTS, "quant": f"r{i}"}
        cache.cached_compile(parts, _Builder(i), tmp_path, logs.append)
        keys.append(cache.key_of(parts))
        os.utime(_stem(tmp_path, parts).with_suffix(".json"), (time.time() - 100 + i, time.time() - 100 + i))
    os.utime(_stem(tmp_path, {**PARTS, "quant": "r0"}).with_suffix(".json"))  # r0 used most recently
    size = _stem(tmp_path, {**PARTS, "quant": "r0"}).with_suffix(".pimb").stat().st_size
    gone = cache.prune(tmp_path, max_bytes=2 * size, log=logs.append)
    assert gone == [keys[1]]  # the least recently used one
    assert cache.cached_compile({**PARTS, "quant": "r0"}, _Builder(0), tmp_path, logs.append)[2]["hit"]
    assert not cache.cached_compile({**PARTS, "quant": "r1"}, _Builder(1), tmp_path, logs.append)[2]["hit"]
