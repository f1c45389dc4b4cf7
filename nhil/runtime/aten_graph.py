"""Host ATen regions: an exported ATen subgraph carried in a program and executed exactly.

What nhil does not raise into a primitive and is not PIM-bound (a new norm, activation,
logit scale, RoPE variant, head re-layout) runs on the host as the exported ATen ops
themselves, in the exported dtype (the ExecuTorch partition idea: the device gets what it
claims, the rest stays portable). The compiler (``nhil.compiler.host_aten``) groups the
ops of one region into a *spec*; the host kernel ``aten_graph``
(``nhil.runtime.host_kernels``) runs it with :func:`run`.

Spec (JSON-able; ``docs/program-format.md`` section "Host ATen regions"):

* ``ops``: list of ``[op, args, kwargs]``; ``op`` is ``"aten.<name>.<overload>"`` or
  ``"getitem"``; values are referenced as ``{"$v": k}`` (inputs first: ``0..n_in-1``,
  then op ``i`` is ``n_in + i``); dtypes ``{"$dtype": "float32"}``, devices
  ``{"$device": "cpu"}``, layouts ``{"$layout": "strided"}``, memory formats
  ``{"$memory_format": "contiguous_format"}``, non-finite floats ``{"$f": "inf"}``.
* ``in_specs``: per input ``[shape, dtype]``: the host buffer (fp32, flat) is reshaped
  and cast to the exported dtype (exact: only dtypes that fp32 holds exactly are
  allowed, integer values are checked at run time).
* ``out_specs``: per output ``[ref, shape, dtype]``: the value is checked against the
  recorded shape and dtype and stored flat as fp32 (exactly, or a RunError).

Only non-mutating, deterministic ``aten`` ops are accepted (:func:`check_spec`, run when a
program is loaded), so a hand-edited program cannot run arbitrary code.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np
import torch

# dtypes a host buffer (fp32) holds exactly; integers are range-checked when stored
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# every other torch dtype an op argument may name (never a buffer's dtype)
_ARG_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.complex64, torch.complex128)} | DTYPES
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}
# ops with hidden state or uninitialised memory: never a faithful host region
_REFUSED_PREFIXES = ("rand", "bernoulli", "normal", "uniform", "multinomial", "empty", "new_empty", "native_dropout", "exponential", "poisson")
_INT_EXACT = 2**24  # integers an fp32 buffer holds exactly


def op_name(target) -> str:
    """``"aten.<name>.<overload>"`` of an ATen OpOverload, ``"getitem"`` for ``operator.getitem``."""
    if target is operator.getitem:
        return "getitem"
    return f"aten.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"


def resolve(name: str):
    """The callable of a spec op name.

    Raises:
        ValueError: not ``getitem`` or an existing, non-mutating, deterministic ``aten`` op.
    """
    if name == "getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise ValueError(f"host ATen op {name!r} is not 'aten.<name>.<overload>'")
    packet = getattr(torch.ops.aten, parts[1], None)
    op = getattr(packet, parts[2], None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload):
        raise ValueError(f"host ATen op {name!r} does not exist in this torch")
    in_place = parts[1].endswith("_") and not parts[1].startswith("__")
    if op._schema.is_mutable or in_place or parts[1].startswith(_REFUSED_PREFIXES):
        raise ValueError(f"host ATen op {name!r} mutates its inputs or is nondeterministic; it cannot run as a host region")
    return op


def encode(a: Any, ref) -> Any:
    """JSON-able form of an op argument; ``ref(node) -> int`` numbers fx nodes.

    Raises:
        ValueError: an argument kind the spec cannot carry (names its type).
    """
    import torch.fx as fx

    if isinstance(a, fx.Node):
        return {"$v": ref(a)}
    if isinstance(a, (list, tuple)):
        return [encode(x, ref) for x in a]
    if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"$f": repr(a)}
    if isinstance(a, torch.dtype):
        if a not in _ARG_DTYPES.values():
            raise ValueError(f"dtype {a} cannot be carried by a host ATen region")
        return {"$dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        if a.type != "cpu":
            raise ValueError(f"device {a} in a host ATen region (the host is the CPU)")
        return {"$device": "cpu"}
    if isinstance(a, torch.layout):
        return {"$layout": "strided"}
    if isinstance(a, torch.memory_format):
        name = str(a).removeprefix("torch.")
        if name not in _MEMORY_FORMATS:
            raise ValueError(f"memory format {a} in a host ATen region")
        return {"$memory_format": name}
    raise ValueError(f"argument {a!r} of type {type(a).__name__} cannot be carried by a host ATen region")


def decode(a: Any, vals: list) -> Any:
    """Inverse of :func:`encode` (``vals``: the values computed so far)."""
    if isinstance(a, list):
        return [decode(x, vals) for x in a]
    if isinstance(a, dict):
        (k, v), = a.items()
        if k == "$v":
            return vals[v]
        if k == "$f":
            return float(v)
        if k == "$dtype":
            return _ARG_DTYPES[v]
        if k == "$device":
            return torch.device("cpu")
        if k == "$layout":
            return _LAYOUTS[v]
        if k == "$memory_format":
            return _MEMORY_FORMATS[v]
    return a


def dtype_name(dt: torch.dtype) -> str:
    """Spec name of a buffer dtype.

    Raises:
        ValueError: an fp32 host buffer cannot hold the dtype exactly (float64, complex).
    """
    if dt not in _DTYPE_NAMES:
        raise ValueError(f"a host ATen region value of dtype {dt} cannot live in an fp32 host buffer")
    return _DTYPE_NAMES[dt]


def check_spec(ops, in_specs, out_specs) -> str | None:
    """Why a host ATen spec cannot run (malformed entry, unknown or refused op, bad reference), or None."""
    try:
        if not all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], list) and s[1] in DTYPES for s in in_specs):
            return "aten_graph in_specs must be [shape, dtype] pairs with dtypes among " + ", ".join(DTYPES)
        n = len(in_specs)
        for i, entry in enumerate(ops):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], list) and isinstance(entry[2], dict)):
                return f"aten_graph op {i} must be [op, args, kwargs]"
            resolve(entry[0])
            if entry[0] == "aten.dropout.default" and (len(entry[1]) != 3 or entry[1][2] is not False):
                return f"aten_graph op {i}: dropout must have train=False (an identity); a training dropout is random"
            bad = _bad_ref(entry[1:], n + i)
            if bad is not None:
                return f"aten_graph op {i} ({entry[0]}) references value {bad}, only 0..{n + i - 1} exist before it"
        for s in out_specs:
            if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], int) and 0 <= s[0] < n + len(ops) and isinstance(s[1], list) and s[2] in DTYPES):
                return f"aten_graph out_specs entry {s!r:.60} must be [value, shape, dtype] naming one of the {n + len(ops)} values"
    except ValueError as e:
        return str(e)
    return None


def _bad_ref(a, limit: int):
    if isinstance(a, list):
        for x in a:
            r = _bad_ref(x, limit)
            if r is not None:
                return r
    elif isinstance(a, dict):
        if "$v" in a and not (isinstance(a["$v"], int) and 0 <= a["$v"] < limit):
            return a["$v"]
        for v in a.values():
            r = _bad_ref(v, limit)
            if r is not None:
                return r
    return None


def to_input(x, shape: list, dtype: str) -> torch.Tensor:
    """A host buffer / image (fp32 numpy) or a step input (``$pos``/``$token``: int) as the exported tensor."""
    dt = DTYPES[dtype]
    if isinstance(x, (int, np.integer)):
        return torch.full(shape, int(x), dtype=dt)
    t = torch.from_numpy(np.asarray(x, dtype=np.float32)).reshape(shape)
    return t if dt == torch.float32 else t.to(dt)


def run(ops: list, in_specs: list, out_specs: list, inputs: list, outputs: list) -> None:
    """Execute a host ATen spec: ``inputs`` (buffers or ints) -> ``outputs`` (fp32 buffers, written flat).

    Raises:
        RuntimeError: a value differs from its recorded shape/dtype, or an integer output
            does not fit an fp32 buffer exactly.
    """
    vals = [to_input(x, s, d) for x, (s, d) in zip(inputs, in_specs)]
    with torch.no_grad():
        for name, args, kwargs in ops:
            vals.append(resolve(name)(*decode(args, vals), **{k: decode(v, vals) for k, v in kwargs.items()}))
    for out, (ref, shape, dtype) in zip(outputs, out_specs):
        t = vals[ref]
        if not isinstance(t, torch.Tensor) or list(t.shape) != list(shape) or t.dtype != DTYPES[dtype]:
            got = (list(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(f"host ATen value {ref} is {got}, the program recorded {shape} {dtype}")
        f = t.reshape(-1).to(torch.float32)
        if not t.dtype.is_floating_point and t.dtype != torch.bool and t.numel() and int(t.abs().max()) >= _INT_EXACT:
            raise RuntimeError(f"host ATen value {ref} holds integers beyond 2^24, which an fp32 host buffer cannot keep exactly")
        out[:] = f.numpy()
