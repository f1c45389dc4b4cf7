"""Fault injection for the board emulator: corrupted, dropped and duplicated bytes, delays, a board reset.

Spec string (``FPGA_FAULTS`` / ``nhil fpga-emu --faults``), comma-separated ``key=value``::

    byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,seed=1          # per wire byte
    frame_flip=0.05,frame_drop=0.01,frame_dup=0.01,frame_delay=0.001   # per frame
    reset_after=500

Per **byte** (every wire byte the emulator receives or sends, each independently, in
the directions given by ``dir``):

* ``byte_flip=p``: the byte is replaced by a different byte (XOR with a uniform random
  value in 1..255), so a "flipped byte" is a corrupted byte, not merely one bit;
* ``byte_drop=p``: the byte is lost;
* ``byte_dup=p``: the byte is delivered twice (a dropped byte is never duplicated).

Per **frame** (each END-terminated run received, each frame sent; one draw per kind):

* ``frame_flip=p``: one random bit of the frame is flipped;
* ``frame_drop=p`` / ``frame_dup=p``: one random byte of the frame is dropped / doubled;
* ``frame_delay=p``: the frame is held back ``delay_ms`` (default 20) before delivery.

Both kinds can be combined. Other keys:

* ``reset_after=N``: after N valid frames received, the board "reboots" once (new
  session nonce, memory cleared), as a power glitch or watchdog would.
* ``seed``: RNG seed (default 0), so a failing run can be replayed.
* ``dir``: ``both`` (default), ``rx`` (host->board only) or ``tx`` (board->host only).

The v1 names ``flip``, ``drop``, ``dup``, ``delay`` and ``unit`` were ambiguous (per
frame unless ``unit=byte``) and are refused with a message naming the new keys.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from nhil.errors import SetupError
from nhil.targets.fpga.frame import END

_RATES = ("byte_flip", "byte_drop", "byte_dup", "frame_flip", "frame_drop", "frame_dup", "frame_delay")
_OLD = {"flip": "byte_flip or frame_flip", "drop": "byte_drop or frame_drop", "dup": "byte_dup or frame_dup", "delay": "frame_delay", "unit": "the byte_/frame_ prefix"}


@dataclasses.dataclass
class FaultSpec:
    """Parsed fault spec (see the module docstring); rates are probabilities in [0, 1]."""

    byte_flip: float = 0.0
    byte_drop: float = 0.0
    byte_dup: float = 0.0
    frame_flip: float = 0.0
    frame_drop: float = 0.0
    frame_dup: float = 0.0
    frame_delay: float = 0.0
    delay_ms: float = 20.0
    reset_after: int = 0
    seed: int = 0
    dir: str = "both"

    @classmethod
    def parse(cls, spec: str | None) -> "FaultSpec":
        """Parse ``key=value,...``.

        Raises:
            SetupError: unknown or v1 key, bad number, rate outside [0, 1].
        """
        f = cls()
        if not spec:
            return f
        keys = [x.name for x in dataclasses.fields(cls)]
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, val = item.partition("=")
            key = key.strip()
            if key in _OLD:
                raise SetupError(f"fault spec key {key!r} is ambiguous and no longer accepted: use {_OLD[key]} (e.g. byte_flip=0.01,byte_drop=0.002,byte_dup=0.002)")
            if not sep or key not in keys:
                raise SetupError(f"bad fault spec item {item!r}; keys: {', '.join(keys)} (e.g. byte_flip=0.01,byte_drop=0.002,byte_dup=0.002,seed=1)")
            try:
                if key == "dir":
                    v = val.strip()
                    if v not in ("both", "rx", "tx"):
                        raise ValueError(v)
                elif key in ("reset_after", "seed"):
                    v = int(val)
                    if v < 0:
                        raise ValueError(val)
                else:
                    v = float(val)
                    if not (v >= 0.0) or (key in _RATES and v > 1.0):
                        raise ValueError(val)
            except ValueError:
                raise SetupError(f"bad value in fault spec item {item!r} (rates are probabilities in [0, 1], counts non-negative integers, dir is both|rx|tx)") from None
            setattr(f, key, v)
        return f

    @property
    def per_byte(self) -> bool:
        return bool(self.byte_flip or self.byte_drop or self.byte_dup)

    @property
    def per_frame(self) -> bool:
        return bool(self.frame_flip or self.frame_drop or self.frame_dup or self.frame_delay)

    @property
    def active(self) -> bool:
        return self.per_byte or self.per_frame or bool(self.reset_after)

    def __str__(self) -> str:
        default = FaultSpec()
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v != getattr(default, k)) or "none"


class FaultInjector:
    """Applies a :class:`FaultSpec` to byte streams (seeded numpy RNG). ``counts`` tallies what was injected."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.counts = {"byte_flip": 0, "byte_drop": 0, "byte_dup": 0, "frame_flip": 0, "frame_drop": 0, "frame_dup": 0, "frame_delay": 0}
        self._rx_pending = bytearray()

    def _on(self, direction: str) -> bool:
        return self.spec.dir in ("both", direction)

    def _frame(self, data: bytes) -> bytes:
        s, r = self.spec, self.rng
        b = bytearray(data)
        if s.frame_flip and r.random() < s.frame_flip and b:
            i = int(r.integers(len(b)))
            b[i] ^= 1 << int(r.integers(8))
            self.counts["frame_flip"] += 1
        if s.frame_drop and r.random() < s.frame_drop and b:
            del b[int(r.integers(len(b)))]
            self.counts["frame_drop"] += 1
        if s.frame_dup and r.random() < s.frame_dup and b:
            i = int(r.integers(len(b)))
            b.insert(i, b[i])
            self.counts["frame_dup"] += 1
        if s.frame_delay and r.random() < s.frame_delay:
            self.counts["frame_delay"] += 1
            time.sleep(s.delay_ms / 1000)
        return bytes(b)

    def _bytes(self, data: bytes) -> bytes:
        s, r = self.spec, self.rng
        n = len(data)
        if not n:
            return data
        a = np.frombuffer(data, np.uint8).copy()
        if s.byte_flip:
            m = r.random(n) < s.byte_flip
            k = int(m.sum())
            if k:
                a[m] ^= r.integers(1, 256, k).astype(np.uint8)
                self.counts["byte_flip"] += k
        if not (s.byte_drop or s.byte_dup):
            return a.tobytes()
        rep = np.ones(n, np.int64)
        if s.byte_drop:
            m = r.random(n) < s.byte_drop
            rep[m] = 0
            self.counts["byte_drop"] += int(m.sum())
        if s.byte_dup:
            m = (r.random(n) < s.byte_dup) & (rep > 0)
            rep[m] = 2
            self.counts["byte_dup"] += int(m.sum())
        return np.repeat(a, rep).tobytes()

    def tx(self, frame: bytes) -> bytes:
        """Faults on one outgoing frame (per-frame faults first, then per-byte)."""
        if not self._on("tx"):
            return frame
        if self.spec.per_frame:
            frame = self._frame(frame)
        return self._bytes(frame) if self.spec.per_byte else frame

    def tx_many(self, frames: list[bytes]) -> bytes:
        """Faults on several outgoing frames sent back to back: per frame when per-frame faults are set, else
        per-byte faults on the concatenation (the same independent per-byte draws, one pass)."""
        if not self._on("tx"):
            return b"".join(frames)
        if self.spec.per_frame:
            return b"".join(self.tx(f) for f in frames)
        return self._bytes(b"".join(frames)) if self.spec.per_byte else b"".join(frames)

    def rx(self, chunk: bytes) -> bytes:
        """Faults on received bytes. Per-frame faults hold bytes back until the END closing their run."""
        if not self._on("rx") or not chunk:
            return chunk
        if self.spec.per_frame:
            chunk = self._rx_frames(chunk)
        return self._bytes(chunk) if self.spec.per_byte and chunk else chunk

    def _rx_frames(self, chunk: bytes) -> bytes:
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
