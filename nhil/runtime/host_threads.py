"""Host kernels on one intra-op thread where that cannot change a bit.

A decode step calls ~250 host kernels on vectors of a few hundred elements. PyTorch
splits some of them across its intra-op threads anyway (``softmax`` over rows, with a
small grain), and on a loaded machine (a CI worker beside another, ``pytest -n 2``)
waking the second thread costs milliseconds: measured on 2 busy cores, SmolLM2's 30
``masked_softmax`` calls took 7.0 ms each with 2 threads and 0.24 ms with 1.

Running a call on one thread gives the same bits when the kernel is row-wise or
elementwise (no BLAS, no cross-row reduction: :data:`SERIAL_SAFE`) and every tensor
it touches is below PyTorch's parallel grain (``at::internal::GRAIN_SIZE`` = 32768
elements): below it TensorIterator never splits an elementwise loop or a reduction,
so the vectorised-loop / scalar-tail split of each element is the same at any thread
count, and ``softmax`` splits by whole rows. Host ATen regions (``aten_graph``, which
may hold MKL matmuls), MoE and recurrent kernels keep the process's thread count.
``tests/test_host_threads.py`` checks 1-thread and 2-thread results bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

GRAIN = 32768  # at::internal::GRAIN_SIZE (ATen/Parallel.h): smallest range split across threads
SERIAL_SAFE = frozenset({
    "embedding", "rms_norm", "rope_cos_sin", "rope", "silu_mul", "add", "masked_softmax", "narrow", "gelu_mul", "softcap",
    "layer_norm", "gelu", "pos_embedding", "kv_fp8_k", "kv_fp8_v", "act_quant", "act_rescale",
})


def serial_ok(kernel: str, sizes: list[int]) -> bool:
    """True when ``kernel`` over tensors of ``sizes`` elements gives the same bits on one thread as on any number."""
    return kernel in SERIAL_SAFE and all(s < GRAIN for s in sizes)


@contextmanager
def one_thread():
    """Run the block with one PyTorch intra-op thread, then restore the count."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
