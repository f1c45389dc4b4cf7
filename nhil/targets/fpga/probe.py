"""Probe a lab board of the boards file (``nhil boards``): HELLO + INFO, and the capabilities it claims."""

from __future__ import annotations

import time

from nhil.boards import Board, boards_path
from nhil.errors import NhilError
from nhil.targets.fpga.target import FpgaTarget


def probe(board: Board, open_timeout: float = 3.0) -> dict:
    """HELLO + INFO with one board; never raises for link problems.

    Returns:
        ``{"name", "url", "ok": bool, "outcome": "PASS" | "LINK_FAIL" | ..., "error",
        "capabilities": {isa_version, formats, ops, device} (when ok), "seconds"}``.
    """
    t0 = time.perf_counter()
    rep = {"name": board.name, "url": board.url, "baud": board.baud, "device": board.device, "node": board.node, "ok": False}
    t = None
    try:
        t = FpgaTarget(port=board.url, baud=board.baud, device=board.device, open_timeout=open_timeout, max_retries=4)
        t.open()
        caps = t.capabilities().to_json()
        rep.update(ok=True, outcome="PASS", capabilities=caps)
        claimed = caps.get("device", {}).get("name") if isinstance(caps.get("device"), dict) else None
        if claimed and claimed != board.device:
            rep["warning"] = f"the board reports device {claimed!r} but {boards_path()} says {board.device!r}"
    except NhilError as e:
        rep.update(outcome=e.outcome, error=str(e))
    finally:
        if t is not None:
            t.close()
    rep["seconds"] = round(time.perf_counter() - t0, 2)
    return rep
