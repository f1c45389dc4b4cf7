"""Node-level facts the raiser reads from an exported graph: fake values, identity casts, mutations,
and where an op came from (module path and class, source line)."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

aten = torch.ops.aten

_TO_OPS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other}


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_transparent(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in (aten._assert_tensor_metadata.default, aten.alias.default, aten.contiguous.default):  # value identities
        return True
    if n.target in _TO_OPS or n.target == aten.type_as.default:
        a, v = _val(n.args[0]), _val(n)
        return isinstance(a, torch.Tensor) and isinstance(v, torch.Tensor) and a.dtype == v.dtype and a.device == v.device
    return False


def _is_mutating(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def source_of(n: fx.Node) -> str:
    """``file:line`` of the innermost frame in ``node.meta['stack_trace']`` ("unknown" if none)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else "unknown source"


def module_of(n: fx.Node) -> tuple[str, str]:
    """(module path, class name) of the innermost ``nn_module_stack`` entry; ('', '') if none."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return path, cls.rsplit(".", 1)[-1]


def op_name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_function" else f"{n.op} {n.target}"
