"""Plots for reports (matplotlib, Agg backend, PNG): error per layer and per decode step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def plot_report(report: dict, folder: Path) -> list[str]:
    """Write ``layers.png`` (SQNR and 1-cosine per layer) and ``steps.png`` (SQNR and KL per
    step) into ``folder`` when the report has those rows; returns the file names written.

    Files are written to a temp name and renamed (atomic).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nhil.util import atomic_write_bytes

    written = []
    layers = report.get("layers") or []
    if layers:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        xs = list(range(len(layers)))
        sq = [_f(d.get("sqnr_db")) for d in layers]
        sq = [60.0 if math.isinf(v) else v for v in sq]
        ax.plot(xs, sq, marker="o", label="SQNR (dB, inf shown as 60)")
        th = (((report.get("thresholds") or {}).get("hidden") or {}).get("sqnr_db") or {}).get("min")
        if th is not None:
            ax.axhline(float(th), color="red", ls="--", label=f"threshold {th} dB")
        fd = report.get("first_divergent_layer")
        if fd:
            names = [d.get("layer") for d in layers]
            if fd.get("layer") in names:
                ax.axvline(names.index(fd["layer"]), color="orange", label=f"first divergent: {fd['layer']}")
        ax.set_xlabel("layer (0 = embedding)")
        ax.set_ylabel("SQNR dB vs golden")
        ax.set_title(f"{report.get('model')} on {report.get('target')}: hidden-state error per layer")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, folder / "layers.png", atomic_write_bytes))
    steps = report.get("steps") or []
    if steps:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        xs = [s.get("step") for s in steps]
        ax.plot(xs, [_f(s.get("sqnr_db")) for s in steps], marker="o", label="logits SQNR (dB)")
        ax.set_xlabel("decode step")
        ax.set_ylabel("SQNR dB")
        ax2 = ax.twinx()
        ax2.plot(xs, [_f(s.get("kl")) for s in steps], color="gray", marker="x", label="KL (nats)")
        ax2.set_ylabel("KL (nats)")
        bad = [s.get("step") for s in steps if not s.get("top1_agree")]
        for b in bad:
            ax.axvline(b, color="red", alpha=0.4)
        ax.set_title(f"{report.get('model')} on {report.get('target')}: logits per step (red: top-1 differs)")
        ax.grid(alpha=0.3)
        fig.legend(loc="lower right", fontsize=8)
        written.append(_save(fig, folder / "steps.png", atomic_write_bytes))
    return written


def _save(fig, path: Path, writer) -> str:
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    writer(path, buf.getvalue())
    return path.name
