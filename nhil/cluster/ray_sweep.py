"""``nhil sweep --ray auto|ADDRESS``: every manifest row as one Ray task.

Each row becomes a task with the resources of :func:`nhil.cluster.resources.row_resources`
(CPU, memory, ``rtl``, ``fpga_board:<name>``) and ``max_retries=0``: a row runs once, like
in the local sweep, and the task runs the same :func:`nhil.sweep.run_one` (``nhil verify``
in a subprocess with the row's timeout). The driver (this process) is the only writer of
the sweep folder: it logs every row INCOMPLETE when it is submitted and again when it
starts (with its node), then the row's outcome as soon as the task ends, and rewrites the
aggregated reports (``results.jsonl``, ``matrix.md``, ``junit.xml``, ``report.html``,
``summary.json``; :func:`nhil.sweep.write_aggregate`) after every row, printing progress.

What cannot end normally still ends as a row, never as a lost sweep:

* the task's worker or node dies (killed, out of memory, node lost): CRASH naming the
  node and Ray's error, with the row's reproducer and its last stage if its run folder
  is readable;
* the row runs past ``timeout_s`` plus a grace period (a hung worker; ``run_one`` already
  turns a hung ``nhil verify`` into TIMEOUT): the task is cancelled, TIMEOUT;
* no live node offers what the row needs (no ``rtl`` host, its board's node lost) for
  ``infeasible_s``: the task is cancelled, INCOMPLETE naming the missing resource and the
  ``ray start`` flag that offers it.

Goldens go between workers by content (:mod:`nhil.cluster.golden_share`): the driver's
goldens of the sweep's models go to each row's task as arguments and a golden a worker
made comes back with its row. Tasks never block in ``ray.get`` (Ray would lend their CPU
to another row). ``address="auto"`` starts a local Ray instance
(``ray.init(address="local")``) offering ``rtl`` when Verilator and cocotb are installed
and the boards of the boards file that name no other node, and stops it at the end; any
other address connects to a running cluster (``ray start --head`` ...) and leaves it up.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from nhil.errors import SetupError
from nhil.sweep import _append, _iso, _now, _point_latest, git_commit, pending_row, read_log, reproducer, row_id, write_aggregate

INSTALL_HINT = "pip install -e '.[cluster]' (make venv installs it)"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise SetupError(f"`nhil sweep --ray` needs Ray: {INSTALL_HINT}") from None
    return ray


def local_resources() -> dict:
    """Custom resources a local (``--ray auto``) node offers: ``rtl`` (one per CPU) when
    the RTL toolchain is installed, and ``fpga_board:<name>`` for each board of the boards
    file whose ``node`` is unset or this host."""
    res: dict[str, float] = {}
    try:
        import cocotb  # noqa: F401

        from nhil.targets.rtl.build import _verilator_root

        if _verilator_root() is not None:
            res["rtl"] = float(os.cpu_count() or 1)
    except ImportError:
        pass
    try:
        from nhil.boards import load_boards

        for b in load_boards().values():
            if b.node in (None, "", "local", socket.gethostname()):
                res[f"fpga_board:{b.name}"] = 1.0
    except (ImportError, SetupError):
        pass
    return res


def _make_start_actor(ray):
    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
    class RowStarts:
        """Row id -> the node (id, host, pid, start time) its task started on (restarted
        empty if killed, e.g. by Ray's memory monitor; the rows are unaffected)."""

        def __init__(self):
            self.starts: dict[str, dict] = {}

        def started(self, rid: str, node: dict) -> None:
            self.starts[rid] = node

        def start_records(self) -> dict:
            return dict(self.starts)

    return RowStarts


def _row_task(row: dict, run_seed: int, out_dir: str, timeout_s: float, root: str, starts, shared: dict, *blobs: bytes) -> dict:
    """Body of one row's Ray task (runs on the worker node).

    Never blocks in ``ray.get``: Ray lends a blocked task's CPU to the next queued task, which
    would run more rows at once than the node has CPUs. The start notice is fire-and-forget
    and the shared goldens arrive as task arguments (``shared``: name -> sha256, in the order
    of ``blobs``), which Ray fetches to the node before the task starts."""
    import ray

    from nhil.cluster.golden_share import golden_of, install
    from nhil.errors import GoldenError
    from nhil.sweep import run_one

    node = {"id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid(), "t": time.time()}
    starts.started.remote(row_id(row), node)
    here = Path(os.environ.get("NHIL_ROOT") or root)
    notes = []
    for (name, sha), data in zip(shared.items(), blobs):
        try:
            if install(here / "goldens", name, sha, data):
                notes.append(f"installed shared golden {name}")
        except GoldenError as e:
            notes.append(str(e))
    rep = run_one(row, run_seed, Path(out_dir), timeout_s, cwd=here, kill_with_parent=True)
    rep["node"] = node
    if notes:
        rep["golden_share"] = notes
    g = golden_of(rep)
    if g is not None and g[0] not in shared:
        rep["_golden"] = g  # handed to the driver, which keeps it for later rows and sweeps
    return rep


def _seed_goldens(ray, root: Path, rows: list[dict]) -> dict:
    """Name -> (sha256, object ref of the bytes) of the driver's goldens of the sweep's models
    whose bytes match the golden manifest (others are left out, not shared)."""
    import hashlib
    import re

    from nhil.errors import GoldenError
    from nhil.golden.store import read_manifest

    try:
        files = read_manifest(root / "goldens")
    except GoldenError:
        return {}
    prefixes = tuple((re.sub(r"[^A-Za-z0-9._-]", "_", r["model"]) or "model") + "-" for r in rows)
    out = {}
    for name, entry in files.items():
        p = root / "goldens" / name
        if name.startswith(prefixes) and p.is_file():
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() == entry.get("sha256"):
                out[name] = (entry["sha256"], ray.put(data))
    return out


def _lost_row(row: dict, run_seed: int, out: Path, outcome: str, why: str, node: dict | None) -> dict:
    """The record of a row that did not end normally (see the module docstring)."""
    rep = pending_row(row, run_seed)
    rep.update(outcome=outcome, error=why, node=node, reproducer=reproducer(row, run_seed))
    if node and node.get("t"):
        rep["wall_s"] = round(time.time() - node["t"], 2)  # from the row's start to its loss
    reports = sorted((out / row_id(row)).glob("*/report.json"))
    if reports:
        try:
            last = json.loads(reports[-1].read_text())
            rep.update(stage=last.get("stage"), run_dir=last.get("run_dir"))
            rep["error"] += f" (last stage reached: {last.get('stage')})"
        except (OSError, ValueError):
            pass
    from nhil.expectations import apply_expectation

    apply_expectation(rep)
    return rep


def _keep_golden(root: Path, golden: tuple, rep: dict) -> None:
    """Install a golden a worker made into the driver's ``goldens/`` (sha256 verified), for
    the next sweeps' rows on any node; a refusal is noted in the row, never fatal."""
    from nhil.cluster.golden_share import install
    from nhil.errors import GoldenError

    try:
        install(root / "goldens", *golden)
    except GoldenError as e:
        rep.setdefault("golden_share", []).append(str(e))


def _node_table(ray) -> list[dict]:
    return [{"id": n["NodeID"], "host": n.get("NodeManagerHostname"), "alive": bool(n.get("Alive")),
             "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:") and k != "object_store_memory"}}
            for n in ray.nodes()]


def ray_sweep(rows: list[dict], run_seed: int = 0, out_root: Path = Path("runs/sweeps"), timeout_s: float = 3600, address: str = "auto",
              local_cpus: int | None = None, infeasible_s: float = 30.0, grace_s: float = 120.0, poll_s: float = 1.0,
              log=sys.stderr) -> tuple[Path, list[dict]]:
    """Run ``rows`` as Ray tasks; returns the sweep folder and the final row records.

    Args:
        rows: manifest rows (:mod:`nhil.expectations`).
        run_seed: combined with each row's id (:func:`nhil.sweep.row_seed`).
        out_root: the folder gets ``<UTC stamp>-ray/`` and ``latest`` points at it.
        timeout_s: per row, as in the local sweep.
        address: ``"auto"`` (start and stop a local Ray instance) or a cluster address
            (``host:6379``, ``ray://host:10001``).
        local_cpus: CPUs of the ``auto`` instance (default: all).
        infeasible_s: seconds a queued row may wait with no live node offering its
            resources before it is INCOMPLETE.
        grace_s: seconds past ``timeout_s`` (after the row started) before its task is
            cancelled as TIMEOUT.
        poll_s: seconds between checks of queued/running rows.

    Raises:
        SetupError: Ray is not installed, or the cluster cannot be reached (names the
            address and how to start one).
    """
    ray = _import_ray()
    from nhil.cluster.resources import missing_resources, row_resources

    started_here = address == "auto"
    try:
        if started_here:
            # a shared workstation: Ray's memory monitor would kill this sweep's workers when *other* processes fill the memory
            os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
            ray.init(address="local", num_cpus=local_cpus, resources=local_resources(), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SetupError(f"cannot reach the Ray cluster at {address!r} ({type(e).__name__}: {str(e)[:300]}); start one with "
                         f"`ray start --head --num-cpus N` and pass its address, or use --ray auto for a local one; a cluster with token authentication "
                         f"(Ray's default) needs RAY_AUTH_MODE=token and its token (~/.ray/auth_token or RAY_AUTH_TOKEN) on every node and here") from None
    try:
        return _drive(ray, rows, run_seed, Path(out_root), timeout_s, address, infeasible_s, grace_s, poll_s, log, missing_resources, row_resources)
    finally:
        ray.shutdown()  # disconnects; stops the instance only when ray.init started it (auto)


def _drive(ray, rows, run_seed, out_root, timeout_s, address, infeasible_s, grace_s, poll_s, log, missing_resources, row_resources):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out = (out_root / f"{_now().strftime('%Y%m%dT%H%M%S')}-ray").resolve()
    out.mkdir(parents=True, exist_ok=True)
    _point_latest(out)
    t0 = time.time()
    nodes = _node_table(ray)
    meta = {"kind": "ray", "address": address, "started": _iso(t0), "started_epoch": t0, "workers": int(sum(n["resources"].get("CPU", 0) for n in nodes if n["alive"])),
            "nodes": nodes, "rows_total": len(rows), "rows_done": 0, "run_seed": run_seed, "wall_s": 0.0, "git_commit": git_commit()}
    log_path = out / "results.jsonl"
    index = _make_start_actor(ray).options(scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)).remote()
    task = ray.remote(_row_task)
    root = str(Path.cwd())
    goldens = _seed_goldens(ray, Path(root), rows)
    pending: dict = {}  # ObjectRef -> [row, request, since-infeasible or None]
    results: dict[str, dict] = {}

    def record(rep: dict) -> None:
        _append(log_path, rep)
        if rep.get("outcome") != "INCOMPLETE" or rep.get("final"):
            results[row_id(rep)] = rep
        t1 = time.time()
        meta.update(rows_done=len(results), finished=_iso(t1), wall_s=round(t1 - t0, 2), nodes=_node_table(ray))
        write_aggregate(out, read_log(out), meta, title="nhil sweep (ray)")

    for row in rows:
        req = row_resources(row)
        record(dict(pending_row(row, run_seed), error="queued on the Ray cluster, not started yet", node=None))
        prefix = (re.sub(r"[^A-Za-z0-9._-]", "_", row["model"]) or "model") + "-"
        mine = {n: g for n, g in goldens.items() if n.startswith(prefix)}
        ref = task.options(num_cpus=req["num_cpus"], memory=req["memory"], resources=req["resources"], max_retries=0, retry_exceptions=False,
                           name=row_id(row)).remote(dict(row), run_seed, str(out), timeout_s, root, index, {n: g[0] for n, g in mine.items()}, *(g[1] for g in mine.values()))
        pending[ref] = [row, req, None]
    print(f"[ray] {len(rows)} rows submitted to {address} ({meta['workers']} CPUs on {sum(n['alive'] for n in nodes)} nodes); folder {out}", file=log, flush=True)

    seen_start: dict[str, dict] = {}
    try:
        _poll(ray, pending, results, seen_start, rows, run_seed, out, timeout_s, grace_s, infeasible_s, poll_s, log, index, root, record, missing_resources)
    except (ray.exceptions.RayError, ConnectionError, OSError) as e:  # the cluster itself went away: every row still out is CRASH, the folder stays
        for row, _, _ in list(pending.values()):
            record(_lost_row(row, run_seed, out, "CRASH", f"lost the Ray cluster at {address} while the row was queued or running: {type(e).__name__}: {str(e)[:200]}",
                             seen_start.get(row_id(row))))
        print(f"[ray] lost the Ray cluster ({type(e).__name__}); {len(pending)} row(s) recorded as CRASH", file=log, flush=True)
    return out, [results[row_id(r)] for r in rows if row_id(r) in results]


def _poll(ray, pending, results, seen_start, rows, run_seed, out, timeout_s, grace_s, infeasible_s, poll_s, log, index, root, record, missing_resources):
    """Collect finished rows, note started ones, cancel hung or unplaceable ones (see the module docstring)."""
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
        for ref in ready:
            row, _, _ = pending.pop(ref)
            node = seen_start.get(row_id(row))
            try:
                rep = ray.get(ref)
            except ray.exceptions.TaskCancelledError:
                continue  # recorded when it was cancelled
            except ray.exceptions.RayError as e:
                where = f"node {node['id'][:12]} ({node['host']})" if node else "its node"
                rep = _lost_row(row, run_seed, out, "CRASH", f"the row's Ray task died on {where}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", node)
            if rep.get("_golden"):
                _keep_golden(Path(root), rep.pop("_golden"), rep)
            record(rep)
            print(f"[ray] {len(results)}/{len(rows)} {row_id(row)} -> {rep['outcome']} ({rep.get('wall_s', '?')} s on {(rep.get('node') or {}).get('host', '?')}); "
                  f"{len(pending)} left", file=log, flush=True)
        if not pending:
            break
        try:
            starts = ray.get(index.start_records.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:  # the start book was lost: rows go on, their start notes may be missing
            print(f"[ray] warning: row start records unavailable ({type(e).__name__}); rows go on", file=log, flush=True)
            starts = {}
        for rid, node in starts.items():
            if rid not in seen_start:
                seen_start[rid] = node
                for row, _, _ in pending.values():
                    if row_id(row) == rid:
                        record(dict(pending_row(row, run_seed), error=f"running on node {node['id'][:12]} ({node['host']}) since {_iso(node['t'])}", node=node))
        try:
            live = ray.nodes()
        except Exception as e:  # noqa: BLE001 - the GCS not answering for one poll is not a reason to lose the sweep
            print(f"[ray] warning: cannot list the cluster's nodes ({type(e).__name__}: {e})", file=log, flush=True)
            continue
        now = time.time()
        for ref, entry in list(pending.items()):
            row, req, since = entry
            rid = row_id(row)
            if rid in seen_start:
                if now - seen_start[rid]["t"] > timeout_s + grace_s:
                    ray.cancel(ref, force=True)
                    pending.pop(ref)
                    record(_lost_row(row, run_seed, out, "TIMEOUT", f"no result {timeout_s + grace_s:.0f} s after the row started; its Ray task was cancelled", seen_start[rid]))
                continue
            miss = missing_resources(live, req)
            if not miss:
                entry[2] = None
                continue
            if since is None:
                entry[2] = now
            elif now - since > infeasible_s:
                ray.cancel(ref, force=True)
                pending.pop(ref)
                flag = f"--resources '{{\"{miss}\": 1}}'" if ":" in miss or miss == "rtl" else f"--num-cpus/--memory large enough for {miss}"
                record(_lost_row(row, run_seed, out, "INCOMPLETE", f"not run: no live node of the Ray cluster offers {miss} (waited {infeasible_s:.0f} s); "
                                 f"start one with `ray start --address <head> {flag}` and rerun", None) | {"final": True})
                print(f"[ray] {row_id(row)} -> INCOMPLETE (no live node offers {miss})", file=log, flush=True)
