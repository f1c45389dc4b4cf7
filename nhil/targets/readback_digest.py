"""The SYNC trace every target keeps (``Target.trace()``): a running sha256 over the bytes of every readback, cut at each
SYNC into a :class:`SyncRecord`. Two targets that ran a program alike give equal traces (``tests/test_rtl.py``,
``tests/test_fpga.py``); a target vs the simulator's reference path likewise (``tests/test_gemv_runs.py``).

A digest may hash in the background (``ReadbackDigest(background=True)``, the simulator's fast path): the updates
then run in the order they were made on one daemon thread (:class:`_Hasher`; ``hashlib`` releases the GIL on
buffers over 2 KiB), so the sha256 of a 64-token SmolLM2 prefill's 62 MB of readbacks (~45 ms on one core here)
runs while the host works instead of in the step. The records are the same bytes' sha256 either way; reading
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
    """One daemon thread that runs ``fn(arg)`` jobs in the order queued (every background digest shares it, so the
    updates of one digest stay in order). A job's exception is kept by the job's digest (``errors``), not raised here."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="nhil-readback-digest", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, arg, errors = self.jobs.get()
            try:
                fn(arg)
            except BaseException as e:  # noqa: BLE001 - raised by the digest's records
                errors.append(e)


_HASHER: _Hasher | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> _Hasher:
    global _HASHER
    if _HASHER is None:
        with _HASHER_LOCK:
            if _HASHER is None:
                _HASHER = _Hasher()
    return _HASHER


class ReadbackDigest:
    """Running sha256 over readback bytes (each array's C-order bytes, end to end), cut at each SYNC into a
    :class:`SyncRecord`.

    Args:
        background: hash on :class:`_Hasher`'s thread (see the module docstring). :meth:`add` then hashes a copy;
            :meth:`add_many` hashes the array itself later, so its caller must not write to it afterwards.
    """

    def __init__(self, background: bool = False) -> None:
        self._h = hashlib.sha256()
        self._n = 0
        self._records: list[SyncRecord] = []
        self._errors: list[BaseException] = []
        self._jobs = _hasher().jobs if background else None

    def _update(self, buf) -> None:
        if self._jobs is None:
            self._h.update(buf)
        else:
            self._jobs.put((self._h.update, buf, self._errors))

    def add(self, arr: np.ndarray) -> None:
        """One readback (any shape and dtype; its bytes are copied)."""
        self._update(np.ascontiguousarray(arr).tobytes())
        self._n += 1

    def add_many(self, arr: np.ndarray, count: int) -> None:
        """``count`` readbacks laid end to end in ``arr`` (the same sha256 as adding each in turn). With
        ``background``, ``arr`` is hashed later: it must not be written to afterwards (the simulator hands out a
        read-only array)."""
        self._update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        self._n += count

    def sync(self, index: int) -> None:
        """Close the records' current span at the SYNC of instruction ``index``."""
        h, n = self._h, self._n
        if self._jobs is None:
            self._records.append(SyncRecord(index, h.hexdigest(), n))
        else:
            self._jobs.put((lambda _: self._records.append(SyncRecord(index, h.hexdigest(), n)), None, self._errors))
        self._h = hashlib.sha256()
        self._n = 0

    @property
    def records(self) -> list[SyncRecord]:
        """One :class:`SyncRecord` per :meth:`sync` so far (the list itself: callers copy it).

        Raises:
            the exception of a failed background update (e.g. MemoryError), once every earlier update has run.
        """
        if self._jobs is not None:
            done = threading.Event()
            self._jobs.put((lambda _: done.set(), None, self._errors))
            done.wait()
            if self._errors:
                raise self._errors[0]
        return self._records
