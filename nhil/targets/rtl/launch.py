"""Subprocess entry point: ``python -m nhil.targets.rtl.launch <config.json>``.

Runs the cocotb test ``nhil.targets.rtl.tb_server`` (or another module named in the
config) against a built simulator via ``cocotb_tools.runner``; the test connects back to
the host's socket. Kept in its own process so the host's environment stays untouched.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    from cocotb_tools.runner import get_runner

    runner = get_runner(cfg["simulator"])
    runner.test(
        test_module=cfg["test_module"],
        hdl_toplevel=cfg["toplevel"],
        hdl_toplevel_lang="verilog",
        build_dir=cfg["build_dir"],
        test_dir=cfg["run_dir"],
        waves=cfg["waves"],
        plusargs=cfg["plusargs"],
        extra_env=cfg["env"],
        results_xml=cfg["results_xml"],
        timescale=("1ns", "1ps"),
        parameters=cfg.get("parameters") or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
