"""Threads of the simulator's GEMV-run kernel: how many (:func:`threads`) and how a call is shared among them
(:func:`spans_at_once`: contiguous spans of channels, the caller's thread runs the first).

Every channel's arithmetic is the same on any thread (``nhil.targets.sim.kernels.gemv_run`` runs each channel in
program order), so the count changes only the speed.
"""

from __future__ import annotations

import queue
import threading

def threads() -> int:
    """Threads :func:`nhil.targets.sim.kernels.gemv_run` shares the channels among: ``NHIL_SIM_THREADS`` if set, else ``OMP_NUM_THREADS``
    if set (the per-process budget a scheduler gives, e.g. Ray's workers or ``nhil landscape``'s rows), else 1 inside
    a pytest-xdist worker (its siblings hold the other cores), else one per core.

    The count changes only the speed: every channel's arithmetic is the same on any thread. (The threads are
    Python threads that block while they wait: numba's OpenMP ``prange`` threads spin instead, and on a 2-core
    machine with any other load that made a SmolLM2 decode step 1.2 s instead of 0.21 s.)

    Raises:
        SetupError: ``NHIL_SIM_THREADS`` is not a positive integer.
    """
    import os

    from nhil.errors import SetupError
    from nhil.util import positive_int_env, sim_threads_setting

    try:
        n = sim_threads_setting()
    except ValueError as e:
        raise SetupError(str(e)) from None
    if n is not None:
        return n
    try:
        n = positive_int_env("OMP_NUM_THREADS", "threads per process")
    except ValueError:
        n = None  # another program's variable: a malformed one is not nhil's to refuse
    if n is not None:
        return n
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return os.cpu_count() or 1


class KernelThreads:
    """Persistent daemon threads that each run one span of a kernel call on request (``queue.SimpleQueue`` hand-offs:
    a blocked thread sleeps, it does not spin). One call at a time: a second caller while one is running runs its
    call whole on its own thread (:func:`spans_at_once`)."""

    def __init__(self, n: int) -> None:
        self.inbox = [queue.SimpleQueue() for _ in range(n)]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = threading.Lock()
        for q in self.inbox:
            threading.Thread(target=self._serve, args=(q,), name="nhil-sim-kernel", daemon=True).start()

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            kernel, args = inbox.get()
            try:
                kernel(*args)
                self.done.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                self.done.put(e)


_THREADS: KernelThreads | None = None
_THREADS_LOCK = threading.Lock()


def spans_at_once(kernel, args: tuple, channels: int, threads: int) -> None:
    """``kernel(*args, c_lo, c_hi)`` over ``[0, channels)`` split into ``threads`` contiguous spans, run at once: the
    caller runs the first span, :class:`KernelThreads` the others (the kernel releases the GIL). Returns when all are
    done; the first exception of a span is raised after every span has finished."""
    global _THREADS
    n = max(1, min(threads, channels))
    if n > 1 and (_THREADS is None or len(_THREADS.inbox) < n - 1):
        with _THREADS_LOCK:
            if _THREADS is None or len(_THREADS.inbox) < n - 1:
                _THREADS = KernelThreads(n - 1)
    pool = _THREADS
    if n == 1 or not pool.busy.acquire(blocking=False):
        kernel(*args, 0, channels)
        return
    cut = [channels * i // n for i in range(n + 1)]
    for i in range(1, n):
        pool.inbox[i - 1].put((kernel, (*args, cut[i], cut[i + 1])))
    err = None
    try:
        kernel(*args, cut[0], cut[1])
    except BaseException as e:  # noqa: BLE001 - raised after the other spans finished
        err = e
    for _ in range(1, n):
        e = pool.done.get()  # wait for every span before anything else touches the state
        err = err or e
    # released only when every span reported: after an interrupt during the wait, a span may still be running, and
    # the threads stay taken (later calls run on the caller's thread) rather than hand a stale report to a new call
    pool.busy.release()
    if err is not None:
        raise err
