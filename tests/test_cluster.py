"""Sweeps on a Ray cluster (nhil/cluster/): resources per row, goldens shared by content,
and a real two-node cluster on this machine (nightly: ~10 min on 2 shared CPUs)."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nhil.cluster.golden_share import golden_of, install
from nhil.cluster.resources import GIB, missing_resources, row_resources
from nhil.errors import GoldenError
from nhil.sweep import read_log, reproducer, row_id, row_seed

REPO = Path(__file__).resolve().parents[1]


def test_row_resources_follow_target_board_and_model():
    assert row_resources({"model": "llama-tiny", "target": "sim"}) == {"num_cpus": 1.0, "memory": int(1.5 * GIB), "resources": {}}
    assert row_resources({"model": "llama-tiny", "target": "rtl"})["resources"] == {"rtl": 1.0}
    r = row_resources({"model": "llama", "target": "fpga", "board": "vcu118-a", "cpus": 2})
    assert r == {"num_cpus": 2.0, "memory": 6 * GIB, "resources": {"fpga_board:vcu118-a": 1.0}}
    with pytest.raises(ValueError, match="must be positive"):
        row_resources({"model": "m", "target": "sim", "cpus": 0})


def test_missing_resources_names_what_no_live_node_offers():
    head = {"Alive": True, "Resources": {"CPU": 1.0, "memory": 4.0 * GIB}}
    rtl = {"Alive": True, "Resources": {"CPU": 1.0, "memory": 4.0 * GIB, "rtl": 1.0}}
    req = row_resources({"model": "llama-tiny", "target": "rtl"})
    assert missing_resources([head, rtl], req) == ""
    assert missing_resources([head, dict(rtl, Alive=False)], req) == "rtl"  # the RTL host was lost
    assert missing_resources([head], row_resources({"model": "llama", "target": "sim"})) == "memory 6.0 GiB"
    assert missing_resources([head], row_resources({"model": "m", "target": "fpga", "board": "b1"})) == "fpga_board:b1"


def test_reproducer_and_row_id_carry_the_faults_of_a_manifest_row():
    row = {"model": "llama-tiny", "target": "fpga", "quant": "bf16", "tokens": 2, "faults": "byte_flip=0.01,seed=1"}
    seed = row_seed("llama-tiny", "fpga", "bf16", 4)
    assert reproducer(row, 4) == f"make verify MODEL=llama-tiny TARGET=fpga TOKENS=2 SEED={seed} FPGA_FAULTS=byte_flip=0.01,seed=1"
    assert row_id(row) == "llama-tiny-fpga-bf16-faults=byte_flip=0.01_seed=1"
    assert row_id({"model": "m", "target": "sim"}) == "m-sim-bf16"


def _golden(tmp_path):
    import torch

    from nhil.golden.store import write_golden

    src = tmp_path / "publisher-goldens" / "g.safetensors"
    write_golden(src, {"logits": torch.arange(4, dtype=torch.float32).reshape(2, 2)}, {"model": "llama-tiny", "n_tokens": "2", "vocab_size": "2"})
    return src.read_bytes()


def test_shared_golden_is_verified_by_sha256_before_it_is_written(tmp_path):
    from nhil.golden.store import load_golden, read_manifest

    data = _golden(tmp_path)
    sha = hashlib.sha256(data).hexdigest()
    node = tmp_path / "node-goldens"
    bad = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(GoldenError, match="refusing to install"):
        install(node, "llama-tiny-0123456789ab.safetensors", sha, bad)
    assert not (node / "llama-tiny-0123456789ab.safetensors").exists()
    assert install(node, "llama-tiny-0123456789ab.safetensors", sha, data) is True
    assert install(node, "llama-tiny-0123456789ab.safetensors", sha, data) is False  # same content already there: nothing moves
    assert read_manifest(node)["llama-tiny-0123456789ab.safetensors"]["sha256"] == sha
    tensors, _ = load_golden(node / "llama-tiny-0123456789ab.safetensors")  # the store verifies it again on read
    assert tensors["logits"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(GoldenError, match="plain .safetensors"):
        install(node, "../evil.safetensors", sha, data)
    assert golden_of({"golden": {"path": str(node / "llama-tiny-0123456789ab.safetensors"), "sha256": sha}}) == ("llama-tiny-0123456789ab.safetensors", sha, data)
    assert golden_of({"golden": {"path": str(node / "llama-tiny-0123456789ab.safetensors"), "sha256": "0" * 64}}) is None


# ---------------------------------------------------------------- two-node cluster
RAY = str(Path(sys.executable).with_name("ray"))
ROWS = [
    {"model": "llama-tiny", "target": "sim", "quant": "bf16", "tokens": 2, "expect": "PASS"},
    {"model": "qwen3", "target": "sim", "quant": "bf16", "tokens": 2, "expect": "PASS"},
    {"model": "gpt2", "target": "sim", "quant": "bf16", "tokens": 2, "expect": "PASS"},
    {"model": "llama-tiny", "target": "rtl", "quant": "bf16", "tokens": 2, "expect": "PASS"},
    {"model": "llama-tiny", "target": "fpga", "quant": "bf16", "tokens": 2, "expect": "PASS"},
    {"model": "llama-tiny", "target": "fpga", "quant": "bf16", "tokens": 2, "expect": "PASS", "faults": "byte_flip=0.002,byte_drop=0.001,seed=3"},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_nodes(address: str, n: int, env: dict, timeout: float = 120) -> None:
    code = f"import ray; ray.init(address={address!r}, log_to_driver=False); print(sum(1 for x in ray.nodes() if x['Alive']))"
    t0 = time.time()
    while time.time() - t0 < timeout:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout.strip().splitlines()
        if out and out[-1].isdigit() and int(out[-1]) >= n:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray cluster at {address} did not reach {n} live nodes in {timeout} s")


def _outcomes(folder: Path) -> dict:
    return {row_id(r): (r["outcome"], r["expected"], r["as_expected"], r["seed"], r["reproducer"]) for r in read_log(folder)}


@pytest.mark.slow
@pytest.mark.nightly
def test_two_node_ray_cluster_sweep_matches_local_and_survives_a_lost_node(tmp_path, monkeypatch):
    from nhil.cluster.ray_sweep import ray_sweep
    from nhil.sweep import sweep

    if shutil.which(RAY) is None and not Path(RAY).exists():
        pytest.skip("Ray is not installed (pip install -e '.[cluster]')")
    monkeypatch.chdir(REPO)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats"]
    worker = None
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard=false", *common], check=True, env=env, capture_output=True, timeout=180)
        worker = subprocess.Popen([RAY, "start", "--address", address, "--resources", json.dumps({"rtl": 1}), "--block", *common], env=env,
                                  stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait_nodes(address, 2, env)

        # the same rows locally (one after another) and on the cluster
        local_out, _ = sweep(ROWS, run_seed=5, out_root=tmp_path / "local")
        ray_out, results = ray_sweep(ROWS, run_seed=5, out_root=tmp_path / "ray", timeout_s=900, address=address)
        local, remote = _outcomes(local_out), _outcomes(ray_out)
        assert set(remote) == {row_id(r) for r in ROWS} and remote == local
        summary = json.loads((ray_out / "summary.json").read_text())
        assert summary["rows_done"] == summary["rows_total"] == 6 and summary["outcomes"] == json.loads((local_out / "summary.json").read_text())["outcomes"]
        for f in ("results.jsonl", "matrix.md", "junit.xml", "report.html"):
            assert (ray_out / f).stat().st_size > 0
        nodes = {n["id"]: n for n in summary["nodes"]}
        rtl_nodes = {i for i, n in nodes.items() if n["resources"].get("rtl")}
        assert len(nodes) == 2 and len(rtl_nodes) == 1
        for r in results:
            node = nodes[r["node"]["id"]]
            need = row_resources(r)["resources"]
            assert all(node["resources"].get(k, 0) >= v for k, v in need.items()), (row_id(r), node)
            if r["target"] == "rtl":
                assert r["node"]["id"] in rtl_nodes
        assert {r["node"]["id"] for r in results} == set(nodes)  # the rows ran across both nodes

        # lose the RTL node while its row runs: that row CRASHes, the RTL row still queued is INCOMPLETE, the rest finish
        kill_rows = [dict(ROWS[3], model="qwen3"), dict(ROWS[3], model="gpt2"), dict(ROWS[2], model="mistral")]
        import threading

        box = {}
        th = threading.Thread(target=lambda: box.update(res=ray_sweep(kill_rows, run_seed=5, out_root=tmp_path / "kill", timeout_s=900, address=address, infeasible_s=10)))
        th.start()
        deadline = time.time() + 600
        killed = False
        while time.time() < deadline and th.is_alive():
            folder = tmp_path / "kill" / "latest"
            running = [r for r in read_log(folder) if r["target"] == "rtl" and "running on node" in (r.get("error") or "")] if folder.exists() else []
            if running:
                time.sleep(5)  # let verify get going
                os.killpg(worker.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(1)
        th.join(900)
        assert killed and not th.is_alive()
        out, res = box["res"]
        by = {r["model"]: r for r in res}
        assert len(res) == 3
        lost = [r for r in res if r["target"] == "rtl"]
        assert sorted(r["outcome"] for r in lost) == ["CRASH", "INCOMPLETE"], [(r["outcome"], r.get("error")) for r in lost]
        for r in lost:
            assert r["reproducer"] == reproducer(next(k for k in kill_rows if k["model"] == r["model"]), 5) and "SEED=" in r["reproducer"]
            assert not r["as_expected"]
        crash = next(r for r in lost if r["outcome"] == "CRASH")
        assert "died" in crash["error"] and crash["node"]["id"] in rtl_nodes
        assert "no live node of the Ray cluster offers rtl" in next(r for r in lost if r["outcome"] == "INCOMPLETE")["error"]
        assert by["mistral"]["outcome"] == "PASS"
        logged = {row_id(r): r["outcome"] for r in read_log(out)}
        assert logged == {row_id(r): r["outcome"] for r in res}
        assert "CRASH" in (out / "matrix.md").read_text() and "INCOMPLETE" in (out / "junit.xml").read_text() or "INCOMPLETE" in (out / "matrix.md").read_text()
    finally:
        if worker is not None and worker.poll() is None:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.slow
def test_ray_auto_starts_a_local_instance_gives_the_local_outcome_and_stops_it(tmp_path, monkeypatch):
    """``--ray auto`` on a row that fails fast: same record as the local sweep, and no Ray
    left running or connected afterwards."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[cluster]')")
    from nhil.cluster.ray_sweep import ray_sweep
    from nhil.sweep import run_one

    monkeypatch.chdir(REPO)
    row = {"model": "no-such-model", "target": "sim", "quant": "bf16", "tokens": 2, "expect": "PASS"}
    other = dict(row, model="no-such-model-2")
    out, (rep, rep2) = ray_sweep([row, other], run_seed=2, out_root=tmp_path / "ray", address="auto", local_cpus=1, log=sys.stderr)
    local = run_one(row, 2, tmp_path / "local")
    assert rep["outcome"] == local["outcome"] == "USAGE_ERROR" and "unknown model 'no-such-model'" in rep["error"]  # nhil.args, before any work
    assert (rep["seed"], rep["reproducer"]) == (local["seed"], local["reproducer"])
    assert rep["node"]["host"] == socket.gethostname()
    assert not ray.is_initialized()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "ray" and summary["address"] == "auto" and summary["workers"] == 1 and summary["outcomes"] == {"USAGE_ERROR": 2}
    # one CPU: the second row starts only after the first one's verify has ended (no CPU lent while a task waits)
    first, second = sorted([rep, rep2], key=lambda r: r["node"]["t"])
    assert second["node"]["t"] >= first["node"]["t"] + first["wall_s"] - 0.5
