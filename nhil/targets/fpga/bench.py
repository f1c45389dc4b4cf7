"""Link benchmark for ``make bench``: protocol efficiency, throughput vs the raw pty, and goodput on a noisy line."""

from __future__ import annotations

import os
import threading
import time

import numpy as np


def raw_pty_throughput(nbytes: int, chunk: int = 65536) -> float:
    """MB/s of pyserial writes into a raw pty drained by a reader thread (the ceiling for the link)."""
    import serial

    from nhil.targets.fpga.emulator import open_pty

    master, slave, path = open_pty()
    got = [0]
    done = threading.Event()

    def drain():
        while got[0] < nbytes:
            b = os.read(master, 1 << 20)
            if not b:
                break
            got[0] += len(b)
        done.set()

    th = threading.Thread(target=drain, daemon=True)
    th.start()
    ser = serial.Serial(path, baudrate=3_000_000, timeout=1)
    buf = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        k = min(chunk, nbytes - sent)
        ser.write(buf[:k])
        sent += k
    done.wait(60)
    dt = time.perf_counter() - t0
    ser.close()
    os.close(slave)
    os.close(master)
    return nbytes / dt / 1e6


def synthetic_program(nbytes: int, device: str = "aim-like", seed: int = 0):
    """A program with ``ceil(nbytes / row image bytes)`` rows of random non-zero bf16 bits and no instructions but EOC."""
    from nhil.isa.device import DEVICE_PRESETS
    from nhil.isa.instr import Instr, Op
    from nhil.isa.program import BankImage, Program

    d = DEVICE_PRESETS[device]
    row_bytes = d.channels * d.banks * d.cols * 2
    rows = max(1, -(-nbytes // row_bytes))
    rng = np.random.default_rng(seed)
    imgs = []
    for r in range(rows):
        a = rng.integers(1, 0x7F00, (d.channels, d.banks, d.cols), dtype=np.uint16)
        imgs.append(BankImage(r, a))
    return Program(d, [Instr(Op.EOC)], [], [], {}, imgs, {}, {"inputs": {}, "outputs": {}}, {"synthetic": True})


BENCH_FAULTS = "byte_flip=0.01,byte_drop=0.01,byte_dup=0.01,seed=1"  # per wire byte, both directions
BENCH_FAULTS_LIGHT = "byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,seed=1"


def link_benchmark(nbytes: int = 64 << 20, device: str = "aim-like", faults: str = "", verify_rows: int = 2) -> dict:
    """Load ``nbytes`` of random bank rows into a board emulator over a pty and measure.

    Returns a dict: ``link_MBps`` (image bytes / load time), ``raw_pty_MBps`` (pyserial
    into a pty, same call), ``link_vs_raw``, ``wire_efficiency`` (request payload bytes /
    wire bytes sent), ``payload_efficiency`` (image bytes / all wire bytes both ways),
    frame and retry counters; ``verified_rows`` rows are read back and compared.
    """
    from nhil.targets.fpga.target import FpgaTarget

    prog = synthetic_program(nbytes, device)
    image = sum(img.data.nbytes for img in prog.bank_images)
    raw = raw_pty_throughput(min(image, 256 << 20), chunk=min(65536, image))
    t = FpgaTarget(device=device, faults=faults, progress=False)
    with t:
        before = dict(t.link)
        t0 = time.perf_counter()
        t.load(prog)
        dt = time.perf_counter() - t0
        link = {k: t.link[k] - before[k] for k in t.link}
        d = prog.device
        ok = True
        t1 = time.perf_counter()
        nread = 0
        for img in prog.bank_images[:verify_rows]:
            for ch, bank in ((0, 0), (d.channels - 1, d.banks - 1)):
                ok &= bool(np.array_equal(t.read_row(ch, bank, img.row), img.data[ch, bank]))
                nread += d.cols * 2
        read_s = time.perf_counter() - t1
    mbps = image / dt / 1e6
    return {
        "nbytes": image,
        "rows": len(prog.bank_images),
        "device": device,
        "faults": faults or "none",
        "seconds": round(dt, 3),
        "link_MBps": round(mbps, 1),
        "link_kBps": round(mbps * 1e3, 2),
        "readback_kBps": round(nread / read_s / 1e3, 2),
        "raw_pty_MBps": round(raw, 1),
        "link_vs_raw": round(mbps / raw, 3),
        "wire_efficiency": round(link["payload_tx"] / link["bytes_tx"], 4),
        "payload_efficiency": round(image / (link["bytes_tx"] + link["bytes_rx"]), 4),
        "frames_tx": link["frames_tx"],
        "retries": link["retries"],
        "crc_errors": link["crc_errors"],
        "naks": link["naks"],
        "timeouts": link["timeouts"],
        "fragment_budget_min": t.session.budget_min_seen,
        "cell_up": t.link["cell_up"],
        "cell_down": t.link["cell_down"],
        "short_frames": link["short_tx"],
        "verified": ok,
    }


def goodput_benchmark(nbytes: int = 128 << 10, device: str = "fpga-small", faults: str = BENCH_FAULTS) -> dict:
    """Load ``nbytes`` of random (incompressible, no zero runs) bank rows through a faulty line; see :func:`link_benchmark`.

    ``link_kBps`` is then the goodput: image bytes delivered per second (read back bit-exactly afterwards);
    ``readback_kBps`` the goodput of those READ_MEM replies (fetched in pieces).
    """
    return link_benchmark(nbytes, device=device, faults=faults)


def reload_benchmark(nbytes: int = 64 << 20, device: str = "aim-like", faults: str = "") -> dict:
    """Seconds of a full load of ``nbytes`` of random bank rows and of a warm reload of the same program
    (RESET_KEEP_ROWS + MEM_CRC, docs/link-protocol.md section 4a) over a pty, in one session."""
    from nhil.targets.fpga.target import FpgaTarget

    prog = synthetic_program(nbytes, device)
    with FpgaTarget(device=device, faults=faults, progress=False) as t:
        t0 = time.perf_counter()
        t.load(prog)
        full = time.perf_counter() - t0
        t0 = time.perf_counter()
        t.reload(prog)
        warm = time.perf_counter() - t0
        ok = t.reloads["warm"] == 1 and t.reloads["mismatch"] == 0
    return {"nbytes": nbytes, "full_s": round(full, 3), "warm_s": round(warm, 4), "verified": ok}


def bench_rows(clean_bytes: int = 64 << 20, noisy_bytes: int = 1 << 20) -> list[tuple[str, str, str, str]]:
    """Rows (stage, value, ratio, note) for ``nhil bench``: clean-link throughput vs raw pty, efficiency, warm reload
    vs full load, and goodput with 1% of the wire bytes corrupted + 1% dropped + 1% duplicated, and with 1% / 0.2% / 0.2%."""
    b = link_benchmark(clean_bytes)
    rows = [
        (f"fpga link: bulk write {clean_bytes >> 20} MiB over a pty", f"{b['link_MBps']:.1f} MB/s", f"{b['link_vs_raw']:.2f}", f"x raw pty write ({b['raw_pty_MBps']:.1f} MB/s)"),
        ("fpga link: protocol efficiency", f"{b['wire_efficiency']:.4f}", "", "payload bytes / wire bytes"),
    ]
    w = reload_benchmark(clean_bytes)
    rows.append((f"fpga link: warm reload of a {clean_bytes >> 20} MiB program", f"{w['warm_s']:.3f} s", f"{w['warm_s'] / w['full_s']:.4f}",
                 f"x full load ({w['full_s']:.2f} s); rows kept after MEM_CRC" + ("" if w["verified"] else "; NOT WARM")))
    for faults, what, n in ((BENCH_FAULTS, "1% corrupted + 1% dropped + 1% duplicated", noisy_bytes), (BENCH_FAULTS_LIGHT, "1% corrupted + 0.2% dropped + 0.2% duplicated", 2 * noisy_bytes)):
        g = goodput_benchmark(n, faults=faults)
        rows.append((f"fpga link: goodput, {n >> 10} KiB, bytes {what}", f"{g['link_kBps']:.1f} kB/s", f"{g['link_kBps'] / b['link_kBps']:.5f}",
                     f"x clean link; reads {g['readback_kBps']:.1f} kB/s; {g['retries']} retries, {g['crc_errors']} CRC errors, short-frame cells {g['cell_up']} B up / {g['cell_down']} B down"
                     + ("" if g["verified"] else "; READBACK MISMATCH")))
    return rows


if __name__ == "__main__":
    import json
    import sys

    n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 64 << 20
    faults = sys.argv[2] if len(sys.argv) > 2 else ""
    print(json.dumps(link_benchmark(n, device="fpga-small" if faults else "aim-like", faults=faults), indent=1))
