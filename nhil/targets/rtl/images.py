"""Bank images for the RTL's documented backdoor (``$readmemh`` / binary segments, ``docs/rtl-interface.md``).

One file per bank slot (``ch * banks + bank``, ``pim_bank``'s ``BANK_ID``); one burst = ``lanes`` bf16
values, most significant lane first (big-endian bf16).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from nhil.errors import LoadError
from nhil.isa.device import DeviceConfig
from nhil.isa.program import Program


def write_bank_images(mem: Path, program: Program, d: DeviceConfig, image_format: str) -> dict:
    """Bank images for the backdoor (``docs/rtl-interface.md``): binary ``.seg``/``.bin`` or ``.hex``.

    Empties the folder ``mem`` first, then writes each bank slot's file from ``program``'s bank images
    (uint16 bf16 bit patterns [channels, banks, cols] per row); ``image_format``: ``bin`` or ``hex``.

    Returns:
        The load info: ``rows``, ``segments`` (contiguous row runs), ``format``, ``bytes`` written, ``write_s``.

    Raises:
        LoadError: a bank image whose shape is not the device's [channels, banks, cols].
    """
    L, n_bursts = d.lanes, d.cols // d.lanes
    t0 = time.perf_counter()
    for f in mem.iterdir():
        f.unlink()
    rows = sorted((img for img in program.bank_images if img.data is not None), key=lambda img: img.row)
    for img in rows:
        shape = np.shape(img.data)
        if shape != (d.channels, d.banks, d.cols):
            raise LoadError(f"bank image of row {img.row} has shape {shape}, expected {(d.channels, d.banks, d.cols)}")
    # contiguous runs of rows -> (first row, number of rows)
    runs: list[list[int]] = []
    for img in rows:
        if runs and runs[-1][0] + runs[-1][1] == img.row:
            runs[-1][1] += 1
        else:
            runs.append([img.row, 1])
    nbytes = 0
    if image_format == "bin":
        seg = "".join(f"{r * n_bursts} {n * n_bursts}\n" for r, n in runs)
        chunk = 1024  # rows per conversion chunk (bounds the temporary memory)
        # bank files are named by slot (ch * banks + bank, pim_bank's BANK_ID)
        files = [open(mem / f"bank{b}.bin", "wb") for b in range(d.slots)]
        try:
            for i in range(0, len(rows), chunk):
                block = np.stack([np.asarray(img.data, np.uint16).reshape(d.slots, d.cols) for img in rows[i : i + chunk]])  # (R, slots, cols)
                # one burst = BW/8 bytes, most significant first: lane L-1 first, big-endian bf16
                be = block.reshape(len(block), d.slots, n_bursts, L)[..., ::-1].astype(">u2")
                for b in range(d.slots):
                    data = np.ascontiguousarray(be[:, b]).tobytes()
                    files[b].write(data)
                    nbytes += len(data)
        finally:
            for f in files:
                f.close()
        for b in range(d.slots):
            (mem / f"bank{b}.seg").write_text(seg)
    else:
        w = 4 * L
        for b in range(d.slots):
            lines = ["// nhil bank image (one burst per line, lane 0 in the low 16 bits)"]
            for img in rows:
                bursts = np.ascontiguousarray(np.asarray(img.data, np.uint16).reshape(d.slots, d.cols)[b].reshape(n_bursts, L)[:, ::-1]).astype(">u2")
                hx = bursts.tobytes().hex()
                lines.append(f"@{img.row * n_bursts:x}")
                lines.extend(hx[i : i + w] for i in range(0, len(hx), w))
            text = "\n".join(lines) + "\n"
            nbytes += len(text)
            (mem / f"bank{b}.hex").write_text(text)
    return {"rows": len(rows), "segments": len(runs), "format": image_format, "bytes": nbytes,
            "write_s": round(time.perf_counter() - t0, 3)}
