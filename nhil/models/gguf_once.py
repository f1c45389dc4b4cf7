"""Load a GGUF through transformers with the file parsed once.

``AutoModelForCausalLM.from_pretrained(..., gguf_file=)`` and ``AutoTokenizer.from_pretrained`` each
build a fresh ``gguf.GGUFReader`` of the file (config, weights, tokenizer: three parses of every
metadata field, ~7 s each for SmolLM2's 49k-token vocabulary on a 2-core machine), and the weight
mapping rebuilds ``gguf.get_tensor_name_map(arch, n_blocks)`` once per tensor (397 times). Inside
:func:`parsed_once` both are shared: one reader per (path, mode), one name map per (arch, blocks).
The readers are read-only memory maps and the name maps are only looked up, so the loaded model,
config and tokenizer are the same as without it (``tests/test_gguf_once.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

_LOCK = threading.Lock()  # the patch is process-wide: one GGUF load at a time


@contextlib.contextmanager
def parsed_once():
    """Within the block, ``gguf.GGUFReader(path, mode)`` and ``gguf.get_tensor_name_map`` are memoised (restored after).

    Raises:
        whatever the load inside raises (the originals are restored first).
    """
    import gguf

    with _LOCK:
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}

        def reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
