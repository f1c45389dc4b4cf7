"""ReadbackDigest (nhil.targets.readback_digest): the SYNC records are hashlib's sha256 of the readbacks' bytes between
SYNCs, inline and in the background alike, with two digests' updates interleaved on the one hasher thread."""

import hashlib

import numpy as np
import pytest

from nhil.targets.readback_digest import ReadbackDigest, SyncRecord


def _feed(d: ReadbackDigest, rng: np.random.Generator, log: list) -> None:
    """Random readbacks (single fp32 / uint16 ones, and runs of several end to end) and SYNCs; ``log`` gets the
    expected (index, bytes, count) of each SYNC."""
    buf, n = b"", 0
    for i in range(60):
        kind = rng.integers(0, 4)
        if kind == 0:
            a = rng.standard_normal(int(rng.integers(1, 40))).astype(np.float32)
            d.add(a)
            buf, n = buf + a.tobytes(), n + 1
        elif kind == 1:
            a = rng.integers(0, 1 << 16, int(rng.integers(1, 3000)), dtype=np.uint16)
            d.add(a)
            buf, n = buf + a.tobytes(), n + 1
        elif kind == 2:
            a = rng.standard_normal(int(rng.integers(1, 200_000))).astype(np.float32)  # > 2 KiB: hashlib drops the GIL
            k = int(rng.integers(1, 5))
            d.add_many(a, k)
            buf, n = buf + a.tobytes(), n + k
        else:
            d.sync(i)
            log.append((i, buf, n))
            buf, n = b"", 0
    d.sync(99)
    log.append((99, buf, n))


@pytest.mark.parametrize("background,batch", [(False, None), (True, None), (True, 1), (True, 300_000)])
def test_records_are_the_sha256_of_the_readback_bytes_between_syncs(background, batch):
    """Batches of 1 byte (every update its own job), ~300 KB and the default 64 KiB (some updates batched, some
    SYNCs hashed inline after the thread went idle)."""
    rng = np.random.default_rng(7)
    kw = {} if batch is None else {"batch_bytes": batch}
    a, b = ReadbackDigest(background=background, **kw), ReadbackDigest(background=background, **kw)
    la, lb = [], []
    for _ in range(3):  # two digests fed in turn: their updates interleave on the shared hasher thread
        _feed(a, rng, la)
        _feed(b, rng, lb)
    for d, log in ((a, la), (b, lb)):
        want = [SyncRecord(i, hashlib.sha256(buf).hexdigest(), n) for i, buf, n in log]
        assert len(want) > 10 and d.records == want


class _NotABuffer:
    """Passes the digest's byte count, fails sha256's update (on the hasher thread)."""

    def __len__(self) -> int:
        return 8


def test_a_failed_background_update_is_raised_by_records():
    d = ReadbackDigest(background=True, batch_bytes=1)
    d.add(np.zeros(4, np.float32))
    d._update(_NotABuffer())  # handed to the thread at once (batch of 1 byte), where it fails
    d.sync(0)
    with pytest.raises(TypeError):
        d.records


def test_small_readbacks_are_hashed_at_their_sync_without_waking_the_thread():
    """A decode step's readbacks (here 181 of 2.3 KB, with a SYNC after every 4th) stay under one batch: nothing is
    queued on the hasher thread, and the records are still hashlib's."""
    d = ReadbackDigest(background=True)
    rng = np.random.default_rng(3)
    want, buf, n = [], b"", 0
    for i in range(181):
        a = rng.standard_normal(576).astype(np.float32)
        d.add_many(a, 1)
        buf, n = buf + a.tobytes(), n + 1
        if i % 4 == 3:
            d.sync(i)
            want.append(SyncRecord(i, hashlib.sha256(buf).hexdigest(), n))
            buf, n = b"", 0
    assert d._queued == 0 and d.records == want


def test_the_simulators_gemv_readbacks_are_read_only():
    """The background digest hashes a GEMV run's readback array after the call returns: a write to it must fail."""
    from nhil.compiler import pipeline
    from nhil.models import get_model
    from nhil.runtime import Runner
    from nhil.targets.base import ReadbackRun
    from nhil.targets.sim import SimTarget

    prog = pipeline.compile(get_model("llama-tiny"), "aim-like", max_cache_len=16, model_name="llama-tiny").program
    t = SimTarget()
    flats = []
    run = t.execute

    def spy(block):
        out = run(block)
        if isinstance(out, ReadbackRun):
            flats.append(out.flat)
        return out

    t.execute = spy
    r = Runner(prog, t)
    r.reset()
    r.step(1, 0)
    assert flats
    for f in flats:
        with pytest.raises(ValueError, match="read-only"):
            f[0] = 1.0
