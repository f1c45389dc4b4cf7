"""Start and stop the board emulator (``nhil fpga-emu``) as a subprocess on a pseudo-terminal.

Used by :class:`~nhil.targets.fpga.target.FpgaTarget` when no port is given: the emulator
prints its pty path on stdout, and the target opens that path as a serial port
(``transport.py``).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from nhil.targets.fpga.errors import TransportError


def stop_emulator(proc: subprocess.Popen | None) -> None:
    """Terminate ``proc`` (kill it after 5 s); nothing if it is ``None`` or has exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def start_emulator(device: str, faults: str = "", rtl: bool = False, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start ``nhil fpga-emu`` serving the device preset ``device``; returns (process, pty path).

    Args:
        faults: fault spec of the emulated line (``faults.py``).
        rtl: the emulator executes on the RTL target.
        timeout: seconds to wait for the pty path (an RTL emulator builds first).

    Raises:
        TransportError: the emulator exited, or did not announce its pty in ``timeout`` seconds.
    """
    cmd = [sys.executable, "-m", "nhil.targets.fpga.cli", "--device", device, "--faults", faults or ""]
    if rtl:
        cmd.append("--rtl")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    path = line.decode(errors="replace").strip()
    if not path:
        code = proc.poll()
        stop_emulator(proc)
        raise TransportError(f"board emulator ({' '.join(cmd[2:])}) " + (f"exited with code {code}" if code is not None else f"did not announce its pty within {timeout:.0f} s") + " (its stderr is above)")
    return proc, path
