"""The lowering table: one function per ``nhil::*`` primitive, registered by its name.

``lower_decode_graph`` (``nhil.compiler.lower``) walks the raised graph and, for every
``call_function`` node of a primitive ``nhil::<op>``, calls ``LOWERINGS["nhil::<op>"]``
with a :class:`LowerCtx` and the node. Adding a primitive to the device path is adding
one decorated function::

    @lowering("nhil::softcap")
    def _softcap(cx: LowerCtx, node) -> None:
        x, cap = node.args
        cx.b.host("softcap", [cx.arg(x)], [cx.out(node)], cap=float(cap))

The dense primitives (linear and the host kernels) register in ``nhil.compiler.lower_ops``; attention, MoE and MLA in
``lower_attention``, ``lower_moe`` and ``lower_mla``. The shape-only compile
(``nhil.compiler.shape_only``) drives the same table over meta tensors, so there is one
lowering of each primitive (the ExecuTorch operator-visitor pattern, ``STYLE.md`` section 2).

A lowering function reads the node's arguments through the context (``cx.arg`` for the
host buffer of a value, ``cx.const`` / ``cx.const_name`` for a graph constant), emits
with ``cx.b`` (the :class:`~nhil.compiler.builder.ProgramBuilder`) and returns the name
of the node's buffer (``None``: the node's own name, declared with ``cx.out``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from nhil.compiler.builder import ProgramBuilder
from nhil.errors import CompileError

LoweringFn = Callable[["LowerCtx", torch.fx.Node], "str | None"]
LOWERINGS: dict[str, LoweringFn] = {}


def lowering(name: str) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` as the lowering of primitive ``name`` (``"nhil::<op>"``).

    Raises:
        ValueError: ``name`` is not ``nhil::<op>`` or already has a lowering (a second
            registration would silently replace the first).
    """
    if not name.startswith("nhil::"):
        raise ValueError(f"lowering names a primitive as 'nhil::<op>', got {name!r}")

    def deco(fn: LoweringFn) -> LoweringFn:
        if name in LOWERINGS:
            raise ValueError(f"{name} already has a lowering ({LOWERINGS[name].__module__}.{LOWERINGS[name].__name__})")
        LOWERINGS[name] = fn
        return fn

    return deco


def where(node: torch.fx.Node) -> str:
    """``<module path> (<file>:<line>)`` of a node, for error messages."""
    path = node.meta.get("nn_module_stack_path", "?")
    trace = node.meta.get("stack_trace") or ""
    m = re.findall(r'File "([^"]+)", line (\d+)', trace)
    src = f"{m[-1][0]}:{m[-1][1]}" if m else "unknown source line"
    return f"{path} ({src})"


def numel(node: torch.fx.Node) -> int:
    """Element count of a node's value (``meta['val']``).

    Raises:
        CompileError: the node has no shape metadata.
    """
    val = node.meta.get("val")
    if val is None:
        raise CompileError(f"node {node.name} has no shape metadata (meta['val']); run FakeTensorProp after raising")
    return int(val.numel())


@dataclasses.dataclass
class LowerCtx:
    """State shared by the lowering functions of one program.

    Attributes:
        b: the program builder.
        quant: the :class:`~nhil.compiler.quantize.QuantPlan` or ``None`` (bf16).
        buf: node name -> host buffer (or image name, ``$token`` / ``$pos``).
        consts: node name -> graph constant (torch tensor; meta tensors in shape-only compiles).
        kv_layouts: attention-layer ordinal -> KV layout (``info["kv_layout"]``).
        outputs: program outputs (``logits``, ``act.<module>``).
        layer_out: decoder layer -> buffer of its output (the residual add).
    """

    b: ProgramBuilder
    quant: object | None = None
    buf: dict[str, str] = dataclasses.field(default_factory=dict)
    consts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    kv_layouts: dict[int, object] = dataclasses.field(default_factory=dict)
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    layer_out: dict[int, str] = dataclasses.field(default_factory=dict)
    moe_info: list[dict] = dataclasses.field(default_factory=list)
    linear_count: int = 0
    attn_count: int = 0

    def arg(self, a: torch.fx.Node) -> str:
        """Host buffer holding value ``a``.

        Raises:
            CompileError: ``a`` is used before it is lowered.
        """
        if a.name not in self.buf:
            raise CompileError(f"value {a.name} is used before it is lowered")
        return self.buf[a.name]

    @staticmethod
    def const_name(a: torch.fx.Node) -> str:
        """State-dict name of a graph constant (the name its image / placement gets)."""
        return a.target if a.op == "get_attr" else a.name

    def const(self, a: torch.fx.Node) -> torch.Tensor:
        """The tensor of graph constant ``a``."""
        return self.consts[a.name]

    def image(self, a: torch.fx.Node) -> str:
        """Register graph constant ``a`` as an fp32 host image; returns its name."""
        return self.b.host_image(self.const_name(a), self.consts[a.name])

    def out(self, node: torch.fx.Node, size: int | None = None) -> str:
        """Declare the node's own output buffer (``size`` defaults to its element count)."""
        return self.b.buffer(node.name, numel(node) if size is None else size)

    def next_attention_layer(self) -> int:
        """Ordinal of the next attention layer (names its KV rows and scratch buffers)."""
        self.attn_count += 1
        return self.attn_count - 1
