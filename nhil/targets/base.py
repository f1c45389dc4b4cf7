"""The target interface every execution target implements (sim, rtl, fpga, plugins).

A runtime drives a target like this::

    with get_target("sim") as t:
        t.load(program)                     # checks capabilities, writes bank images
        readbacks = t.execute(block)        # a block of resolved device instructions
        t.trace()                           # one SyncRecord per SYNC executed

Instructions reach a target *resolved*: position-relative flags are already bound by
the host runtime and each data-carrying instruction comes with its payload
(``WR_GB``/``WR_SBK``/``WR_ABK``: uint16 bf16 bits; ``WR_ACC``: float32). ``execute``
returns, in order, one array per data-out instruction (``RD_ACC``: float32 [n];
``RD_SBK``: uint16 [n*lanes]).

A target whose ``takes_runs`` is True also accepts two kinds of run items in a block, each of which it
must execute exactly as the ``ResolvedInstr`` list its ``instrs()`` gives: :class:`ResolvedRun`, a run of
bound ``WR_SBK`` (KV-cache appends) as arrays, and :class:`ResolvedGemvRun`, a run of GEMV instructions
(``WR_GB``, ``WR_ACC``, ``MAC_AB``/``MAC_SB``/``MAC_ABV``, ``RD_ACC`` without position flags) as arrays, whose
readbacks it returns in order like any others.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from nhil.errors import LoadError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import EXTENSION_OPS, Instr, Op, RESERVED_OPS, OPINFO
from nhil.isa.program import Program
from nhil.targets.readback_digest import ReadbackDigest, SyncRecord  # noqa: F401 - re-exported: the targets' trace


class ResolvedInstr(NamedTuple):
    """A device instruction ready to issue: no position flags, payload attached when it carries data in."""

    index: int
    instr: Instr
    payload: np.ndarray | None = None


class ResolvedRun(NamedTuple):
    """Consecutive bound ``WR_SBK`` instructions (KV-cache appends) as arrays, for targets with ``takes_runs``.

    Attributes:
        index: int64 ``[m]`` instruction indices, in program order.
        fields: int64 ``[m, 11]`` the bound instructions' fields in ``Instr`` order (op is ``WR_SBK``, no
            position flags, ``tok`` 0).
        payload: uint16 ``[m, lanes]`` bf16 bits (or raw words) per instruction, as ``ResolvedInstr.payload``.
    """

    index: np.ndarray
    fields: np.ndarray
    payload: np.ndarray

    def instrs(self) -> list[ResolvedInstr]:
        """The same run as one :class:`ResolvedInstr` per instruction (what a target without runs receives)."""
        return [ResolvedInstr(int(i), Instr(Op(int(f[0])), *(int(x) for x in f[1:])), p.copy())
                for i, f, p in zip(self.index, self.fields, self.payload)]


class ResolvedGemvRun(NamedTuple):
    """Consecutive bound GEMV instructions (``WR_GB``, ``WR_ACC``, ``MAC_AB``, ``MAC_SB``, ``MAC_ABV``, ``RD_ACC``; no position
    flags) as arrays, for targets with ``takes_runs`` (bound by ``nhil.runtime.bind_runs.GemvRun``).

    Attributes:
        index: int64 ``[m]`` instruction indices, in program order.
        fields: int64 ``[m, 11]`` the instructions' fields in ``Instr`` order.
        offset: int64 ``[m]`` where each data-in instruction's payload starts in ``bits`` (``WR_GB``) or ``values``
            (``WR_ACC``); 0 for the others.
        bits: uint16 ``[sum of WR_GB n*lanes]`` the ``WR_GB`` payloads (bf16 bits or raw words), concatenated.
        values: float32 ``[sum of WR_ACC n]`` the ``WR_ACC`` payloads, concatenated.
        plan: the binding plan the run came from (the same object every step: a target may cache its checks on it).
        lanes: elements per burst of the device (a ``WR_GB`` payload is ``n * lanes`` elements).
    """

    index: np.ndarray
    fields: np.ndarray
    offset: np.ndarray
    bits: np.ndarray
    values: np.ndarray
    plan: object
    lanes: int

    def instrs(self) -> list[ResolvedInstr]:
        """The same run as one :class:`ResolvedInstr` per instruction (what a target without runs receives)."""
        out = []
        for i, f, o in zip(self.index.tolist(), self.fields.tolist(), self.offset.tolist()):
            ins = Instr(Op(f[0]), *f[1:])
            if ins.op is Op.WR_GB:
                p = self.bits[o : o + ins.n * self.lanes].copy()
            elif ins.op is Op.WR_ACC:
                p = self.values[o : o + ins.n].copy()
            else:
                p = None
            out.append(ResolvedInstr(i, ins, p))
        return out


class ReadbackRun(Sequence):
    """The readbacks of a block that lie end to end in one fp32 array: a :class:`Target.execute` result (a sequence,
    item ``i`` the data of the block's ``i``-th data-out instruction, as the list a target returns) that a runtime
    can also copy out in a few block copies instead of one slice per readback (``nhil.runtime.readback_scatter``).

    Attributes:
        flat: float32 ``[total]`` every readback, in order, end to end.
        spans: int64 ``[m, 2]`` readback ``i`` is ``flat[spans[i, 0]:spans[i, 1]]``; the same array object for every
            execution of the same run on the same device (a runtime may key what it derives from it on identity).
    """

    __slots__ = ("flat", "spans")

    def __init__(self, flat: np.ndarray, spans: np.ndarray) -> None:
        self.flat = flat
        self.spans = spans

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        o, e = self.spans[i]
        return self.flat[o:e]

    def __iter__(self):
        f = self.flat
        return (f[o:e] for o, e in self.spans.tolist())


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a target implements.

    Attributes:
        isa_version: ISA major version.
        ops: device opcodes implemented.
        formats: weight storage formats the MAC datapath reads (``bf16`` in v0).
        device: the DeviceConfig of the device behind the target; programs must fit it.
    """

    isa_version: int
    ops: frozenset[Op]
    formats: frozenset[str]
    device: DeviceConfig

    def to_json(self) -> dict:
        return {"isa_version": self.isa_version, "ops": sorted(o.name for o in self.ops), "formats": sorted(self.formats), "device": dataclasses.asdict(self.device)}


class Target(abc.ABC):
    """Abstract execution target. Subclasses implement the abstract methods; see the module docstring."""

    name: str = "?"
    takes_runs: bool = False  # execute() accepts ResolvedRun items (see the module docstring)

    def __enter__(self) -> "Target":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Acquire the target (start a simulator, open a link). Default: nothing."""

    def close(self) -> None:
        """Release it. Default: nothing."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this target implements (ISA version, opcodes, formats, device sizes)."""

    @abc.abstractmethod
    def load(self, program: Program) -> None:
        """Reset device state and write the program's bank images.

        Raises:
            LoadError: the program needs an opcode/format the target lacks or does not fit its device.
        """

    def reload(self, program: Program) -> None:
        """Bring the device back to the state right after ``load(program)``: the program's bank images, every
        other row zero, GB, ACC and CFRs zero (before another run of the same program, e.g. a second generation).

        Default: ``load(program)``. A target whose load is expensive (the FPGA over a serial link) may keep the
        rows it verifies to be unchanged and clear the rest; the resulting state must be the same.

        Raises:
            LoadError: as ``load``.
        """
        self.load(program)

    @abc.abstractmethod
    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        """Execute resolved instructions in order; returns one array per data-out instruction.

        Raises:
            RunError: an address or size is outside the device at run time.
        """

    @abc.abstractmethod
    def read_row(self, ch: int, bank: int, row: int) -> np.ndarray:
        """uint16 [cols] contents of one bank row (backdoor read, for debugging and tests)."""

    @abc.abstractmethod
    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        """Backdoor write of one bank row (uint16 [cols])."""

    @abc.abstractmethod
    def trace(self) -> list[SyncRecord]:
        """One record per SYNC executed since ``load``."""

    def stats(self) -> dict:
        """Target-specific counters for the report (instructions, MACs, link counters...)."""
        return {}


class DelegatingTarget(Target):
    """A target that forwards every call to ``inner``; wrappers (lockstep checks, timers,
    recorders) subclass it and override only what they add."""

    def __init__(self, inner: Target) -> None:
        self.inner = inner
        self.name = inner.name

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def load(self, program: Program) -> None:
        self.inner.load(program)

    def reload(self, program: Program) -> None:
        self.inner.reload(program)

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        return self.inner.execute(block)

    def read_row(self, ch: int, bank: int, row: int) -> np.ndarray:
        return self.inner.read_row(ch, bank, row)

    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        self.inner.write_row(ch, bank, row, data)

    def trace(self) -> list[SyncRecord]:
        return self.inner.trace()

    def stats(self) -> dict:
        return self.inner.stats()


def unclaimed(program: Program, caps: Capabilities) -> list[str]:
    """What ``program`` needs that a target's ``caps`` do not claim: opcodes and weight formats.

    Returns:
        ``["opcode RD_ACC", "weight format int8", ...]``; empty when the target claims all of it.
        (Device size mismatches are not "unclaimed": recompiling for the target's device fixes them.)
    """
    need = sorted(o.name for o in program.required_ops() - set(caps.ops))
    fmts = sorted(set(program.info.get("weight_formats", ["bf16"])) - set(caps.formats))
    return [f"opcode {n}" for n in need] + [f"weight format {f}" for f in fmts]


def check_program_fits(program: Program, caps: Capabilities, target: str) -> None:
    """Refuse a program a target cannot run, naming what is missing.

    Raises:
        LoadError: ISA version, an opcode (incl. reserved ones), a weight format, or the
            device config differs from what the target offers.
    """
    need = program.required_ops()
    missing = sorted(o.name for o in need - set(caps.ops))
    if missing:
        ew = sorted(o.name for o in (need - set(caps.ops)) & RESERVED_OPS)
        extra = (f" ({', '.join(ew)}: in-device elementwise ops, docs/isa.md \"Elementwise ops\", claimed by the simulator only; "
                 f"recompile without the passes {', '.join(EW_PASSES)} or run on TARGET=sim)") if ew else ""
        raise LoadError(f"target {target} does not implement {', '.join(missing)}{extra}; the program needs them")
    fmts = set(program.info.get("weight_formats", ["bf16"]))
    if not fmts <= set(caps.formats):
        raise LoadError(f"target {target} does not support weight format(s) {', '.join(sorted(fmts - set(caps.formats)))} (supports {', '.join(sorted(caps.formats))})")
    if program.device != caps.device:
        raise LoadError(
            f"program compiled for device {program.device.name} ({program.device.channels} ch x {program.device.banks} banks x {program.device.rows} rows x {program.device.row_bytes} B) "
            f"but target {target} has {caps.device.name} ({caps.device.channels} ch x {caps.device.banks} banks x {caps.device.rows} rows x {caps.device.row_bytes} B); recompile with DEVICE={caps.device.name}"
        )


DEVICE_OPS = frozenset(o for o, i in OPINFO.items() if i.device) - RESERVED_OPS - EXTENSION_OPS  # ISA v0's base opcodes (what RTL and FPGA implement)
EW_PASSES = ("ew-swiglu", "ew-residual")  # the opt-in passes that emit EWMUL / EWADD / AF (nhil.compiler.ew_lower)
