"""Fault injection for the board emulator: flipped bits, dropped/duplicated bytes, delays, a board reset.

Spec string (``FPGA_FAULTS`` / ``nhil fpga-emu --faults``), comma-separated ``key=value``::

    flip=0.01,drop=0.002,dup=0.002,delay=0.001,reset_after=500,seed=1

* ``flip``, ``drop``, ``dup``, ``delay``: probabilities. With ``unit=frame`` (default)
  each frame the emulator receives or sends is, independently per fault kind, hit with
  that probability: one random bit flipped / one random byte dropped / one random byte
  sent twice / the frame held back ``delay_ms`` (default 20) before delivery. With
  ``unit=byte`` the rates apply to every byte (a 1% byte rate destroys almost every
  frame longer than a few hundred bytes: use it with small rates).
* ``reset_after=N``: after N valid frames received, the board "reboots" once (new
  session nonce, memory cleared), as a power glitch or watchdog would.
* ``seed``: RNG seed (default 0), so a failing run can be replayed.
* ``dir``: ``both`` (default), ``rx`` (host->board only) or ``tx`` (board->host only).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from nhil.errors import SetupError
from nhil.targets.fpga.frame import END


@dataclasses.dataclass
class FaultSpec:
    flip: float = 0.0
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    delay_ms: float = 20.0
    reset_after: int = 0
    seed: int = 0
    unit: str = "frame"
    dir: str = "both"

    @classmethod
    def parse(cls, spec: str | None) -> "FaultSpec":
        """Parse ``key=value,...``.

        Raises:
            SetupError: unknown key, bad number, rate outside [0, 1].
        """
        f = cls()
        if not spec:
            return f
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, val = item.partition("=")
            key = key.strip()
            if not sep or key not in {x.name for x in dataclasses.fields(cls)}:
                raise SetupError(f"bad fault spec item {item!r}; keys: flip, drop, dup, delay, delay_ms, reset_after, seed, unit, dir (e.g. flip=0.01,drop=0.002,seed=1)")
            try:
                if key in ("unit", "dir"):
                    v = val.strip()
                    if (key == "unit" and v not in ("frame", "byte")) or (key == "dir" and v not in ("both", "rx", "tx")):
                        raise ValueError(v)
                elif key in ("reset_after", "seed"):
                    v = int(val)
                    if v < 0:
                        raise ValueError(val)
                else:
                    v = float(val)
                    if key != "delay_ms" and not 0.0 <= v <= 1.0:
                        raise ValueError(val)
                    if v < 0:
                        raise ValueError(val)
            except ValueError:
                raise SetupError(f"bad value in fault spec item {item!r}") from None
            setattr(f, key, v)
        return f

    @property
    def active(self) -> bool:
        return any((self.flip, self.drop, self.dup, self.delay, self.reset_after))

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v and v != getattr(FaultSpec, k, None)) or "none"


class FaultInjector:
    """Applies a :class:`FaultSpec` to byte streams. ``counts`` tallies what was injected."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.counts = {"flip": 0, "drop": 0, "dup": 0, "delay": 0}
        self._rx_pending = bytearray()

    def _on(self, direction: str) -> bool:
        return self.spec.dir in ("both", direction)

    def _frame(self, data: bytes) -> bytes:
        s, r = self.spec, self.rng
        b = bytearray(data)
        if s.flip and r.random() < s.flip and b:
            i = int(r.integers(len(b)))
            b[i] ^= 1 << int(r.integers(8))
            self.counts["flip"] += 1
        if s.drop and r.random() < s.drop and b:
            del b[int(r.integers(len(b)))]
            self.counts["drop"] += 1
        if s.dup and r.random() < s.dup and b:
            i = int(r.integers(len(b)))
            b.insert(i, b[i])
            self.counts["dup"] += 1
        if s.delay and r.random() < s.delay:
            self.counts["delay"] += 1
            time.sleep(s.delay_ms / 1000)
        return bytes(b)

    def _bytes(self, data: bytes) -> bytes:
        s, r = self.spec, self.rng
        a = np.frombuffer(data, np.uint8).copy()
        n = a.size
        if not n:
            return data
        if s.flip:
            m = r.random(n) < s.flip
            a[m] ^= (1 << r.integers(0, 8, int(m.sum()))).astype(np.uint8)
            self.counts["flip"] += int(m.sum())
        rep = np.ones(n, np.int64)
        if s.drop:
            m = r.random(n) < s.drop
            rep[m] = 0
            self.counts["drop"] += int(m.sum())
        if s.dup:
            m = (r.random(n) < s.dup) & (rep > 0)
            rep[m] = 2
            self.counts["dup"] += int(m.sum())
        if s.delay:
            k = int((r.random(n) < s.delay).sum())
            if k:
                self.counts["delay"] += k
                time.sleep(k * s.delay_ms / 1000)
        return np.repeat(a, rep).tobytes()

    def tx(self, frame: bytes) -> bytes:
        """Faults on one outgoing frame."""
        if not self._on("tx"):
            return frame
        return self._frame(frame) if self.spec.unit == "frame" else self._bytes(frame)

    def rx(self, chunk: bytes) -> bytes:
        """Faults on received bytes; in frame mode, applied per END-terminated run (held back until its END arrives)."""
        if not self._on("rx") or not chunk:
            return chunk
        if self.spec.unit == "byte":
            return self._bytes(chunk)
        self._rx_pending += chunk
        j = self._rx_pending.rfind(END)
        if j < 0:
            if len(self._rx_pending) > (1 << 22):  # no END for 4 MiB: pass through
                out = bytes(self._rx_pending)
                self._rx_pending.clear()
                return out
            return b""
        done = bytes(self._rx_pending[: j + 1])
        del self._rx_pending[: j + 1]
        out = []
        start = 0
        while start < len(done):
            k = done.index(END, start)
            run = done[start : k + 1]
            out.append(self._frame(run) if len(run) > 1 else run)
            start = k + 1
        return b"".join(out)
