"""``nhil fpga-emu``: serve the device side of the FPGA link on a pseudo-terminal (or TCP).

The first line on stdout is where to connect (a pty path such as ``/dev/pts/7``, or
``socket://127.0.0.1:PORT`` in TCP mode); everything else goes to stderr. Runs until
interrupted (Ctrl-C / SIGTERM). Also runnable as ``python -m nhil.targets.fpga.cli``.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer

from nhil.errors import NhilError, SetupError


def fpga_emu(
    device: Annotated[str, typer.Option(help="device preset served (aim-like fits the real SmolLM2 program)")] = "aim-like",
    faults: Annotated[str, typer.Option(help="fault injection: per wire byte byte_flip/byte_drop/byte_dup=RATE, per frame "
                                             "frame_flip/frame_drop/frame_dup/frame_delay=RATE (delay_ms=20), reset_after=N, "
                                             "dir=both|rx|tx, seed=S; e.g. byte_flip=0.01,byte_drop=0.002,seed=1 (docs/link-protocol.md section 11)")] = "",
    rtl: Annotated[bool, typer.Option(help="execute programs on the RTL target instead of the functional simulator")] = False,
    tcp: Annotated[int, typer.Option(help="listen on this TCP port instead of a pty (0: pty)")] = 0,
    host: Annotated[str, typer.Option(help="address to bind in TCP mode")] = "127.0.0.1",
    verbose: Annotated[bool, typer.Option(help="log rejected frames and device errors to stderr")] = False,
) -> None:
    """Board emulator: serves the FPGA link protocol on a pty (default) or on TCP port ``tcp``.

    Args:
        device: device preset served (``aim-like`` fits the real SmolLM2 program).
        faults: fault injection, e.g. ``byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,seed=1`` (per wire byte) or
            ``frame_flip=0.01,frame_delay=0.001,reset_after=500`` (per frame); see ``faults.py``.
        rtl: execute on the RTL target instead of the functional simulator.
        tcp: listen on this TCP port instead of a pty (0: pty).
        host: address to bind in TCP mode (loopback unless given explicitly).
        verbose: log rejected frames and device errors to stderr.
    """
    from nhil.isa.device import DEVICE_PRESETS
    from nhil.targets.fpga.emulator import Board, serve_pty, serve_tcp
    from nhil.targets.fpga.faults import FaultSpec

    try:
        if device not in DEVICE_PRESETS:
            raise SetupError(f"unknown device {device!r}; presets: {', '.join(DEVICE_PRESETS)}")
        spec = FaultSpec.parse(faults)
        board = Board(DEVICE_PRESETS[device], faults=spec, rtl=rtl, log=sys.stderr if verbose else None)
    except NhilError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    def _term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)

    def announce(where: str) -> None:
        print(where, flush=True)
        print(f"fpga-emu: serving device {device} ({board.backend.name} backend) on {where}; faults: {spec}; Ctrl-C to stop", file=sys.stderr, flush=True)

    try:
        if tcp:
            serve_tcp(board, tcp, host=host, announce=announce)
        else:
            serve_pty(board, announce=announce)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def main() -> None:
    import typer

    typer.run(fpga_emu)


if __name__ == "__main__":
    main()
