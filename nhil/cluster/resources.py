"""What one manifest row asks of a Ray node.

Ray schedules a task only on a node whose free resources cover the request
(https://docs.ray.io/en/latest/ray-core/scheduling/resources.html), so the lab's set-up is
the node's ``ray start`` flags:

* every row: ``num_cpus`` (manifest ``cpus``, default 1) and ``memory`` in bytes (manifest
  ``memory_gb``; default 1.5 GiB for the tiny zoo models, 6 GiB for the real ``llama``);
* ``target: rtl`` rows: the custom resource ``rtl`` (1 per row): only hosts with Verilator
  and cocotb offer it, ``ray start ... --resources '{"rtl": 2}'`` (two RTL rows at once);
* rows with a ``board``: ``fpga_board:<name>`` (1): the node that owns the board's serial
  port offers exactly ``{"fpga_board:<name>": 1}``, so one task at a time uses a board.
"""

from __future__ import annotations

GIB = 1 << 30
REAL_MODELS = frozenset({"llama"})


def row_resources(row: dict) -> dict:
    """Ray resource request of a manifest row.

    Returns:
        ``{"num_cpus": float, "memory": int (bytes), "resources": {name: float}}``, the
        keyword arguments of ``ray.remote(...).options``.

    Raises:
        ValueError: ``cpus`` or ``memory_gb`` is not a positive number (names the row).
    """
    try:
        cpus = float(row.get("cpus", 1))
        mem_gb = float(row.get("memory_gb", 6.0 if row["model"] in REAL_MODELS else 1.5))
    except (TypeError, ValueError):
        raise ValueError(f"row {row['model']}/{row['target']}: cpus and memory_gb must be numbers, got {row.get('cpus')!r}, {row.get('memory_gb')!r}") from None
    if cpus <= 0 or mem_gb <= 0:
        raise ValueError(f"row {row['model']}/{row['target']}: cpus and memory_gb must be positive, got {cpus}, {mem_gb}")
    custom: dict[str, float] = {}
    if row["target"] == "rtl":
        custom["rtl"] = 1.0
    if row.get("board"):
        custom[f"fpga_board:{row['board']}"] = 1.0
    return {"num_cpus": cpus, "memory": int(mem_gb * GIB), "resources": custom}


def node_offers(node_resources: dict, request: dict) -> bool:
    """Whether a node's *total* resources (``ray.nodes()[i]["Resources"]``) can ever hold
    ``request`` (:func:`row_resources`); False means the row must wait for another node."""
    need = {"CPU": request["num_cpus"], "memory": request["memory"], **request["resources"]}
    return all(float(node_resources.get(k, 0.0)) >= v for k, v in need.items())


def missing_resources(nodes: list[dict], request: dict) -> str:
    """The first resource of ``request`` that no live node offers, as ``"rtl"`` or
    ``"memory 6.0 GiB"`` ("" when some live node can hold the row)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if any(node_offers(r, request) for r in alive):
        return ""
    for k, v in request["resources"].items():
        if not any(float(r.get(k, 0.0)) >= v for r in alive):
            return k
    if not any(float(r.get("CPU", 0.0)) >= request["num_cpus"] for r in alive):
        return f"CPU {request['num_cpus']:g}"
    return f"memory {request['memory'] / GIB:.1f} GiB"
