"""Small shared helpers: atomic file and folder writes, hashing, the ``[nhil]`` log line."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, ``os.replace``.

    A crash leaves either the old file or the new one, never half of one. The file gets
    mode ``0o666 & ~umask`` like ``open(path, "w")`` (``mkstemp`` alone would make it 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    """The process umask (read by setting and restoring it; there is no getter before Python 3.13's os.umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (~0.1 s for 100 MB, ~0.55 s for 540 MB on the 2-core dev box).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def replace_dir(tmp, final) -> None:
    """Put the finished folder ``tmp`` at ``final`` by renames, so ``final`` is never half written.

    An existing ``final`` (an entry being rebuilt) is first removed by :func:`remove_dir`; a crash in between
    leaves ``final`` missing (a cache miss) or complete. ``tmp`` and ``final`` must be in one folder.

    Raises:
        OSError: a rename fails (``tmp`` is left where it was).
    """
    remove_dir(final)
    os.replace(tmp, final)


def remove_dir(path) -> None:
    """Delete a folder as a whole: one rename to a ``.<name>.<pid>.<random>.trash`` sibling, then the delete, so no
    reader ever sees it half deleted (a crash may leave the ``.trash`` folder). A missing ``path`` is fine.

    Raises:
        OSError: the rename fails.
    """
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.trash")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def positive_int_env(name: str, what: str) -> int | None:
    """The environment variable ``name`` as a positive integer, or None when it is unset or empty.

    Raises:
        ValueError: it is set to anything else; the message names the variable, its value, ``what`` it sets and the fix.
    """
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{name}={v!r}: give a positive integer ({what}), or unset it")
    return int(v)


def sim_threads_setting() -> int | None:
    """``NHIL_SIM_THREADS`` as a positive integer, or None when unset (``nhil.targets.sim.kernels.threads`` then
    decides). One parser for the simulator, which reads it, and ``nhil.args.check_sim_threads``, which refuses a bad
    value before any work; it lives here so that neither imports the other's layer.

    Raises:
        ValueError: it is set to anything else (names the value and the fix).
    """
    return positive_int_env("NHIL_SIM_THREADS", "the simulator's kernel threads")


def log(msg: str) -> None:
    """One ``[nhil] msg`` line on stderr (flushed): progress and cache messages of every stage."""
    print(f"[nhil] {msg}", file=sys.stderr, flush=True)
