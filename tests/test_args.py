"""Arguments are checked before any work (nhil.args): names are never paths, bad values are
usage errors before the model is built, run folders are unique, one golden per key."""

import json
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from nhil.args import EXIT_USAGE, UsageError, check_verify_args, new_run_dir, safe_component
from nhil.models import registry
from nhil.verify import VerifyOptions, verify

PATH_NAMES = ["../evil", "../../etc/passwd", "/tmp/abs", "a\x00b", "..", "a/b", "", " llama-tiny"]


@pytest.fixture
def no_build(monkeypatch):
    """Every registered builder fails the test if called: a usage error must come before any model is built."""
    registry._load_builtin()
    for name, (fn, desc) in list(registry._REGISTRY.items()):
        def boom(n=name):
            raise AssertionError(f"model {n} was built before the arguments were checked")

        monkeypatch.setitem(registry._REGISTRY, name, (boom, desc))
    monkeypatch.setattr(registry, "_CACHE", {})


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("field", ["model", "target", "device", "quant"])
@pytest.mark.parametrize("name", PATH_NAMES)
def test_a_name_that_is_a_path_is_refused_before_any_folder(tmp_path, no_build, field, name):
    work = tmp_path / "work"
    work.mkdir()
    opts = VerifyOptions(model="llama-tiny", target="sim", tokens=2, goldens_dir=work / "goldens", runs_dir=work / "runs")
    setattr(opts, field, name)
    with pytest.raises(UsageError) as e:
        verify(opts)
    assert _tree(tmp_path) == ["work"]  # no run folder, no golden folder, nothing written next to it
    msg = str(e.value)
    assert repr(name)[:40] in msg or "not a recipe" in msg or "unknown" in msg


def test_run_folder_names_are_sanitised(tmp_path):
    runs = tmp_path / "runs"
    for parts in (("../evil", "sim"), ("/etc", "../../x"), ("a\x00b", "sim", "mxfp4:lm_head=bf16")):
        d = new_run_dir(runs, *parts)
        assert d.resolve().parent == runs.resolve(), d
        assert "\x00" not in d.name and "/" not in d.name and not d.name.startswith(".")
    assert safe_component("../../etc") == "_.._etc"
    assert safe_component("\x00") == "_" and safe_component("") == "_"


def _bad(**kw):
    base = dict(model="llama-tiny", target="sim", tokens=4)
    base.update(kw)
    return VerifyOptions(**base)


BAD_ARGS = [
    (dict(target="nope"), "unknown target 'nope'"),
    (dict(model="no-such-model"), "unknown model 'no-such-model'"),
    (dict(quant="nope"), "QUANT='nope'"),
    (dict(quant="mxfp4:lm_head"), "bad quantization override"),
    (dict(quant="native"), "not loaded from a GGUF"),
    (dict(prompt="hello world"), "must be comma-separated token ids"),
    (dict(prompt="1,2,999"), "[999] outside the vocabulary [0, 256) of model 'llama-tiny'"),
    (dict(prompt="1,-3"), "[-3] outside"),
    (dict(prompt=""), "PROMPT '' is empty"),
    (dict(tokens=0), "TOKENS=0 must be an integer >= 1"),
    (dict(repeat=0), "REPEAT=0"),
    (dict(seed=-1), "SEED=-1"),
    (dict(device="no-such-device"), "unknown device preset 'no-such-device'"),
    (dict(target_options={"device": "../x"}), "is not a device preset name"),
]


@pytest.mark.parametrize("kw,msg", BAD_ARGS, ids=[str(k) for k, _ in BAD_ARGS])
def test_bad_arguments_are_usage_errors_before_the_model_is_built(tmp_path, no_build, kw, msg):
    with pytest.raises(UsageError) as e:
        verify(_bad(goldens_dir=tmp_path / "g", runs_dir=tmp_path / "runs", **kw))
    assert msg in str(e.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "g").exists()


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_bad_sim_thread_count_is_a_usage_error_before_the_model_is_built(tmp_path, no_build, monkeypatch, value):
    monkeypatch.setenv("NHIL_SIM_THREADS", value)
    with pytest.raises(UsageError, match=f"NHIL_SIM_THREADS='{value}': give a positive integer"):
        verify(_bad(goldens_dir=tmp_path / "g", runs_dir=tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv("NHIL_SIM_THREADS", "1")
    check_verify_args(_bad())
    assert "NHIL_SIM_THREADS=1" in _bad().reproducer()  # the reproducer carries it


def test_valid_arguments_pass_the_check(no_build):
    check_verify_args(_bad(prompt="1,2,255", quant="mxfp4:lm_head=bf16", device="aim-like", repeat=2, seed=7))
    check_verify_args(_bad(model="qwen2", target="rtl"))
    check_verify_args(_bad(model="llama", prompt="any text", quant="native"))  # the real model: text prompt, GGUF


def test_out_of_vocab_prompt_is_a_setup_error_even_past_the_check():
    """ModelBundle.encode itself refuses ids outside the vocabulary (an IndexError in the embedding before)."""
    from nhil.errors import SetupError

    b = registry.get_model("llama-tiny")
    assert b.encode("1,2,255") == [1, 2, 255]
    with pytest.raises(SetupError, match=r"\[256\] outside the vocabulary \[0, 256\)"):
        b.encode("1,256")


def test_cli_usage_error_has_its_own_exit_code_and_no_traceback(tmp_path):
    for args, msg in ((["--tokens", "0"], "TOKENS=0"), (["--prompt", "1,2,999"], "999"), (["-t", "nope"], "unknown target"),
                      (["-m", "../../x"], "is not a model name")):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "nhil.cli", "verify", "-m", "llama-tiny", "--runs-dir", str(tmp_path / "runs"), *args],
                           capture_output=True, text=True, cwd=tmp_path)
        dt = time.perf_counter() - t0
        print(f"{args}: exit {r.returncode} after {dt:.2f} s")  # measured, not asserted (machine load)
        assert r.returncode == EXIT_USAGE, r.stderr
        assert "USAGE_ERROR" in r.stderr and msg in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("traceback.txt"))


def test_sweep_refuses_path_names(tmp_path):
    r = subprocess.run([sys.executable, "-m", "nhil.cli", "sweep", "--models", "../x", "--targets", "sim"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == EXIT_USAGE and "is not a model name" in r.stderr and "Traceback" not in r.stderr
    assert _tree(tmp_path) == []


def _mk(args):
    import nhil.args as A

    root, stamp = args
    A._stamp = lambda: stamp  # every process collides on the same base name
    return str(A.new_run_dir(root, "llama-tiny", "sim"))


def test_run_folders_are_unique_in_the_same_second_across_processes(tmp_path):
    with ProcessPoolExecutor(4) as ex:
        dirs = list(ex.map(_mk, [(tmp_path, "20260101T000000")] * 12))
    assert len(set(dirs)) == 12
    names = sorted(Path(d).name for d in dirs)
    assert names[0] == "20260101T000000-llama-tiny-sim" and set(names) == {names[0]} | {f"{names[0]}-{i}" for i in range(2, 13)}


def _obtain(args):
    from nhil.golden.cache import obtain_golden

    import torch

    path, counter = args

    def generate():
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.3)  # widen the window in which a second process would also generate
        return {"logits": torch.ones(2, 5), "tokens": torch.tensor([1, 2])}, {"model": "m", "n_tokens": "2"}

    _, _, info = obtain_golden(path, {"model": "m"}, False, generate)
    return info


def test_golden_for_one_key_is_generated_once_by_concurrent_runs(tmp_path):
    import hashlib

    path, counter = tmp_path / "g" / "m-abc.safetensors", tmp_path / "generated"
    with ProcessPoolExecutor(4) as ex:
        infos = list(ex.map(_obtain, [(path, counter)] * 4))
    assert counter.read_text() == "x"  # generated once
    assert sorted(i["reused"] for i in infos) == [False, True, True, True]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert all(i["sha256"] == sha for i in infos)  # every report's sha256 is the file's


@pytest.mark.slow
def test_two_verifies_started_together_get_two_folders_and_one_golden(tmp_path):
    cmd = [sys.executable, "-m", "nhil.cli", "verify", "-m", "llama-tiny", "--tokens", "3", "--runs-dir", str(tmp_path / "runs")]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("*/report.json"))]
    assert len(reports) == 2 and reports[0]["run_dir"] != reports[1]["run_dir"]
    assert sorted(r["golden"]["reused"] for r in reports) == [False, True]
    import hashlib

    gpath = Path(reports[0]["golden"]["path"])
    gpath = gpath if gpath.is_absolute() else tmp_path / gpath
    assert {r["golden"]["sha256"] for r in reports} == {hashlib.sha256(gpath.read_bytes()).hexdigest()}
