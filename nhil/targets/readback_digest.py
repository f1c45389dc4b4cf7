"""The SYNC trace every target keeps (``Target.trace()``): a running sha256 over the bytes of every readback, cut at each
SYNC into a :class:`SyncRecord`. Two targets that ran a program alike give equal traces (``tests/test_rtl.py``,
``tests/test_fpga.py``); a target vs the simulator's reference path likewise (``tests/test_gemv_runs.py``).

A digest may hash in the background (``ReadbackDigest(background=True)``, the simulator's fast path): the updates
then run in the order they were made, in batches of :data:`BATCH_BYTES`, on one daemon thread (:class:`_Hasher`;
``hashlib`` releases the GIL on buffers over 2 KiB), so the sha256 of a 64-token SmolLM2 prefill's 62 MB of
readbacks (~45 ms on one core here) runs while the host works instead of in the step, and a decode step's few
small readbacks are hashed at their SYNC on the caller's thread, with no thread wake. The records are the same bytes' sha256 either way; reading
:attr:`ReadbackDigest.records` waits for every update made before it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading

import numpy as np


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """State observed at one SYNC: instruction index and a sha256 over every readback since the previous SYNC."""

    index: int
    digest: str
    readbacks: int


class _Hasher:
    """One daemon thread that runs jobs in the order queued (every background digest shares it, so the updates of one
    digest stay in order). A job is a callable; it keeps its own exception (:meth:`ReadbackDigest._run`)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="nhil-readback-digest", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self.jobs.get()()


_HASHER: _Hasher | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> _Hasher:
    global _HASHER
    if _HASHER is None:
        with _HASHER_LOCK:
            if _HASHER is None:
                _HASHER = _Hasher()
    return _HASHER


BATCH_BYTES = 1 << 16
"""A background digest hands its pending readbacks to the hasher thread once they reach this many bytes (64 KiB,
~45 us of sha256 here), not one by one, and at a SYNC with nothing queued hashes the pending rest (under 64 KiB) on
the caller's thread. Why: a thread wake costs ~10-60 us on this 2-core VM, and a SmolLM2 decode step's 181 GEMV
runs read back a few KB each, so handing off every update made decode ~14 ms per token slower than hashing inline,
while a 64-token prefill's 62 MB is better hashed on the thread. Measured, 6 alternating triples in one process
(median ms; batched / inline / one job per update): 24-token decode 106.8 / 110.6 / 124.2 per token; 64-token
prefill 794.8 / 822.6 / 802.1. A 1 MiB batch hashed up to 1 MiB inline at each SYNC and lost ~30 ms of prefill."""


class ReadbackDigest:
    """Running sha256 over readback bytes (each array's C-order bytes, end to end), cut at each SYNC into a
    :class:`SyncRecord`.

    Args:
        background: hash on :class:`_Hasher`'s thread (see the module docstring). :meth:`add` then keeps a copy;
            :meth:`add_many` keeps the array itself, so its caller must not write to it afterwards. Pending bytes go
            to the thread in batches of ``batch_bytes``; at a SYNC with nothing queued on the thread, the pending
            rest (under ``batch_bytes``) is hashed on the caller's thread: no wake for a step whose readbacks are small.
        batch_bytes: see ``background`` (default :data:`BATCH_BYTES`).
    """

    def __init__(self, background: bool = False, batch_bytes: int = BATCH_BYTES) -> None:
        self._h = hashlib.sha256()
        self._n = 0
        self._records: list[SyncRecord] = []
        self._errors: list[BaseException] = []
        self._jobs = _hasher().jobs if background else None
        self._batch = batch_bytes
        self._pending: list = []  # background: buffers not yet handed to the thread, in order
        self._pending_bytes = 0
        self._queued = 0  # jobs handed to the thread (written by the caller's thread only)
        self._finished = 0  # jobs the thread has run (written by the hasher thread only)

    def _update(self, buf) -> None:
        if self._jobs is None:
            self._h.update(buf)
            return
        self._pending.append(buf)
        self._pending_bytes += len(buf)
        if self._pending_bytes >= self._batch:
            self._hand_off(None)

    def _hand_off(self, record) -> None:
        """Queue the pending buffers (hashed into the current sha256) and then, if given, ``record()``'s result."""
        h, bufs = self._h, self._pending
        self._pending, self._pending_bytes = [], 0
        self._queued += 1

        def job() -> None:
            try:
                for b in bufs:
                    h.update(b)
                if record is not None:
                    self._records.append(record(h))
            except BaseException as e:  # noqa: BLE001 - raised by the digest's records
                self._errors.append(e)
            finally:
                self._finished += 1

        self._jobs.put(job)

    def add(self, arr: np.ndarray) -> None:
        """One readback (any shape and dtype; its bytes are copied)."""
        self._update(np.ascontiguousarray(arr).tobytes())
        self._n += 1

    def add_many(self, arr: np.ndarray, count: int) -> None:
        """``count`` readbacks laid end to end in ``arr`` (the same sha256 as adding each in turn). With
        ``background``, ``arr`` may be hashed later: it must not be written to afterwards (the simulator hands out a
        read-only array)."""
        self._update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        self._n += count

    def sync(self, index: int) -> None:
        """Close the records' current span at the SYNC of instruction ``index``."""
        n = self._n

        def record(h) -> SyncRecord:
            return SyncRecord(index, h.hexdigest(), n)

        if self._jobs is None or self._queued == self._finished:  # nothing on the thread: hash the rest here
            for b in self._pending:
                self._h.update(b)
            self._pending, self._pending_bytes = [], 0
            self._records.append(record(self._h))
        else:
            self._hand_off(record)
        self._h = hashlib.sha256()
        self._n = 0

    @property
    def records(self) -> list[SyncRecord]:
        """One :class:`SyncRecord` per :meth:`sync` so far (the list itself: callers copy it).

        Raises:
            the exception of a failed background update (e.g. MemoryError), once every earlier update has run.
        """
        if self._jobs is not None and self._queued != self._finished:
            done = threading.Event()
            self._queued += 1

            def mark() -> None:
                self._finished += 1
                done.set()

            self._jobs.put(mark)
            done.wait()
        if self._errors:
            raise self._errors[0]
        return self._records
