"""Framing between RtlTarget (host) and the cocotb testbench server inside the simulator.

One message = ``<u32 header_len><u32 blob_len>`` (little-endian) + a UTF-8 JSON object +
raw bytes. Requests carry ``{"cmd": ...}``; every reply carries ``{"ok": bool, ...}``.
Only JSON and raw bytes cross the socket (never pickle). Standard library only: the
simulator's embedded Python imports this module.

Requests (``docs/rtl-interface.md`` section "Host <-> testbench protocol"):

* ``reset`` ``{"load": bool}``: pulse rst_n, clear the banks (backdoor) and, when ``load``,
  $readmemh the bank images from the run's ``mem/`` folder. Reply ``{"cycles"}``.
* ``exec``: blob = stream beats (``beat_bytes`` each, little-endian) to push through the
  command port. Reply ``{"beats": n, "cycles": c, "err": 0|1}`` + blob of n readback beats.
* ``close``: end the test (the simulator exits).
"""

from __future__ import annotations

import json
import socket
import struct

_HDR = struct.Struct("<II")
MAX_HEADER = 1 << 20
MAX_BLOB = 1 << 30


def send(sock: socket.socket, header: dict, blob: bytes = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(_HDR.pack(len(h), len(blob)) + h + blob)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the connection ({len(buf)} of {n} bytes received)")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[dict, bytes]:
    hl, bl = _HDR.unpack(_exact(sock, _HDR.size))
    if hl > MAX_HEADER or bl > MAX_BLOB:
        raise ConnectionError(f"frame too large (header {hl} B, blob {bl} B)")
    header = json.loads(_exact(sock, hl).decode())
    if not isinstance(header, dict):
        raise ConnectionError("frame header is not a JSON object")
    return header, _exact(sock, bl) if bl else b""
