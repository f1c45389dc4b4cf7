"""The PIM program container: ``.pimb`` binary, versioned, self-contained.

A program holds everything a runtime needs to run a model step on any target: the
device config it was compiled for, the instruction stream (device instructions and
``HOST`` calls), the operand table binding data-carrying instructions to host buffers,
the host kernels with their attributes, the bank images (weights placed in rows in
their storage format, and zero-filled KV-cache rows) and host images (fp32 tensors the
host kernels read, e.g. norm weights and the embedding table), and its I/O descriptors.

Binary layout (``docs/program-format.md``), all integers little-endian::

    0    8   magic  b"NHILPIMB"
    8    2   container version (1)
    10   2   ISA major version (0)
    12   4   reserved, 0
    16   8   M = byte length of the metadata JSON
    24   M   metadata JSON (UTF-8, canonical: sorted keys, no spaces)
    ..   8   N = instruction count
    ..  16N  instruction words (``nhil.isa.instr``)
    ..   8   B = blob byte length
    ..   B   blob: bank and host image bytes at the offsets the metadata gives (a bank
             image stores only its leading ``slots x cols`` rectangle, slot = ch*banks+bank;
             the rest of the row is zero)
    ..   4   CRC-32 (zlib/IEEE 802.3 polynomial 0x04C11DB7, reflected, init/xorout 0xFFFFFFFF)
             of every preceding byte
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from typing import Any

import numpy as np

from nhil.errors import ProgramFormatError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import NO_OPERAND, OPINFO, RESERVED_OPS, WORD_BYTES, Instr, Op
from nhil.isa.semantics import check_instr

from nhil.isa.header import _HEAD, _U64, CONTAINER_VERSION, ISA_VERSION, MAGIC, MAX_META_BYTES, check_head, check_layout  # noqa: F401
STEP_INPUTS = frozenset({"$token", "$pos"})  # per-step scalar inputs host ops may read


@dataclasses.dataclass(frozen=True)
class Operand:
    """A slice of a host buffer bound to a data-carrying instruction.

    ``WR_GB``/``WR_SBK``/``WR_ABK``/``WR_ACC`` read ``count`` fp32 elements of ``buffer``
    from ``offset`` (the runtime rounds them to bf16 where the instruction stores bf16);
    ``RD_ACC``/``RD_SBK`` write ``count`` elements there.
    """

    buffer: str
    offset: int
    count: int


@dataclasses.dataclass(frozen=True)
class HostOp:
    """A host kernel call: ``outputs = kernel(*inputs, **attrs)`` over host buffers/images (names)."""

    kernel: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "inputs": list(self.inputs), "outputs": list(self.outputs), "attrs": self.attrs}


@dataclasses.dataclass
class BankImage:
    """Initial contents of one row in every bank of every channel.

    ``data`` is uint16 [channels, banks, cols] (bf16 bits), or ``None`` for a zero-filled row.
    """

    row: int
    data: np.ndarray | None


@dataclasses.dataclass
class Program:
    """An in-memory PIM program (see the module docstring for the binary form).

    Attributes:
        device: the DeviceConfig it was compiled for.
        instrs: instruction stream; ``HOST`` entries call ``host_ops[imm]``.
        operands: operand table (``Instr.operand`` indexes it).
        host_ops: host kernel calls.
        buffers: host buffer name -> element count (fp32 working buffers of one step).
        bank_images: weight/KV rows loaded before the first step.
        host_images: name -> fp32 array (host-side constants).
        io: I/O descriptors, e.g. ``{"inputs": {...}, "outputs": {...}}``.
        info: free-form provenance (model, compiler version, layout summary).
    """

    device: DeviceConfig
    instrs: list[Instr]
    operands: list[Operand]
    host_ops: list[HostOp]
    buffers: dict[str, int]
    bank_images: list[BankImage]
    host_images: dict[str, np.ndarray]
    io: dict[str, Any]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check internal consistency (bounds of every index, row and slice), every instruction
        against the device (``nhil.isa.semantics``), every host op against the host-kernel
        registry (name, arity, attributes: ``nhil.runtime.host_kernels.check_host_op``), and
        that every I/O output names a host buffer.

        Raises:
            ProgramFormatError: naming the first inconsistency found.
        """
        d = self.device
        for name, count in self.buffers.items():
            if count <= 0:
                raise ProgramFormatError(f"buffer {name!r} has non-positive size {count}")
        for i, o in enumerate(self.operands):
            if o.buffer not in self.buffers:
                raise ProgramFormatError(f"operand {i} refers to unknown buffer {o.buffer!r}")
            if o.offset < 0 or o.count <= 0 or o.offset + o.count > self.buffers[o.buffer]:
                raise ProgramFormatError(f"operand {i} slice [{o.offset}:{o.offset + o.count}] is outside buffer {o.buffer!r} of {self.buffers[o.buffer]} elements")
        known = set(self.buffers) | set(self.host_images) | STEP_INPUTS
        for i, h in enumerate(self.host_ops):
            for nm in (*h.inputs, *h.outputs):
                if nm not in known:
                    raise ProgramFormatError(f"host op {i} ({h.kernel}) refers to unknown buffer or image {nm!r}")
            for nm in h.outputs:
                if nm not in self.buffers:
                    raise ProgramFormatError(f"host op {i} ({h.kernel}) writes {nm!r}, which is not a host buffer (images and step inputs are read-only)")
        rows_seen = set()
        for img in self.bank_images:
            if not 0 <= img.row < d.rows:
                raise ProgramFormatError(f"bank image row {img.row} is outside the device's {d.rows} rows")
            if img.row in rows_seen:
                raise ProgramFormatError(f"bank image row {img.row} appears twice")
            rows_seen.add(img.row)
            if img.data is not None and img.data.shape != (d.channels, d.banks, d.cols):
                raise ProgramFormatError(f"bank image row {img.row} has shape {img.data.shape}, expected {(d.channels, d.banks, d.cols)}")
        seen: set = set()  # (instruction without its operand index, operand count) already checked against the device
        for i, ins in enumerate(self.instrs):
            info = OPINFO[ins.op]
            needs = info.data_in or info.data_out
            if needs and not (0 <= ins.operand < len(self.operands)):
                raise ProgramFormatError(f"instruction {i} ({ins.op.name}) needs an operand but has index {ins.operand} (table has {len(self.operands)})")
            if not needs and ins.operand != NO_OPERAND:
                raise ProgramFormatError(f"instruction {i} ({ins.op.name}) takes no operand but has {ins.operand}")
            if ins.op is Op.HOST and not 0 <= ins.imm < len(self.host_ops):
                raise ProgramFormatError(f"instruction {i} (HOST) calls host op {ins.imm}, table has {len(self.host_ops)}")
            key = (ins._replace(operand=0, tok=0), self.operands[ins.operand].count) if needs else ins._replace(tok=0)  # tok: runtime-bound
            if key in seen:
                continue
            why = check_instr(ins, d, self.operands[ins.operand].count if needs else None)  # the device-semantics table
            if why:
                raise ProgramFormatError(f"instruction {i} ({ins.op.name}): {why}")
            seen.add(key)
        from nhil.runtime.host_kernels import check_host_op

        runnable = not (isinstance(self.info, dict) and self.info.get("shape_only"))  # shape-only programs are timed, never run
        for i, h in enumerate(self.host_ops if runnable else ()):
            why = check_host_op(h.kernel, len(h.inputs), len(h.outputs), h.attrs)
            if why:
                raise ProgramFormatError(f"host op {i}: {why}")
        outputs = self.io.get("outputs", {}) if isinstance(self.io, dict) else None
        if not isinstance(outputs, dict):
            raise ProgramFormatError("io.outputs must map output names to host buffers")
        for k, v in outputs.items():
            if v not in self.buffers:
                raise ProgramFormatError(f"io output {k!r} names {v!r}, which is not a host buffer of the program")

    def required_ops(self) -> set[Op]:
        """Device opcodes the program uses (what a target must implement)."""
        return {i.op for i in self.instrs if OPINFO[i.op].device}

    def uses_reserved(self) -> set[Op]:
        """Elementwise opcodes (EWMUL / EWADD / AF: simulator only, RTL and FPGA refuse them) the program uses."""
        return self.required_ops() & RESERVED_OPS

    # ------------------------------------------------------------------ encode
    def _meta_and_blob(self) -> tuple[dict, list[bytes]]:
        chunks: list[bytes] = []
        off = 0
        bank_idx = []
        for img in self.bank_images:
            if img.data is None:
                bank_idx.append({"row": img.row, "zero": True})
                continue
            slots, cols = _used_rect(img.data, self.device)
            flat = img.data.reshape(self.device.slots, self.device.cols)
            b = np.ascontiguousarray(flat[:slots, :cols], dtype="<u2").tobytes()
            bank_idx.append({"row": img.row, "offset": off, "nbytes": len(b), "slots": slots, "cols": cols})
            chunks.append(b)
            off += len(b)
        host_idx = []
        for name, arr in self.host_images.items():
            b = np.ascontiguousarray(arr, dtype="<f4").tobytes()
            host_idx.append({"name": name, "shape": list(arr.shape), "offset": off, "nbytes": len(b)})
            chunks.append(b)
            off += len(b)
        meta = {
            "device": self.device.as_dict(),
            "buffers": self.buffers,
            "operands": [[o.buffer, o.offset, o.count] for o in self.operands],
            "host_ops": [h.to_json() for h in self.host_ops],
            "bank_images": bank_idx,
            "host_images": host_idx,
            "io": self.io,
            "info": self.info,
        }
        return meta, chunks

    def encode(self) -> bytes:
        """Serialise to ``.pimb`` bytes (validates first)."""
        self.validate()
        meta, chunks = self._meta_and_blob()
        mj = canonical_json(meta).encode()
        parts = [_HEAD.pack(MAGIC, CONTAINER_VERSION, ISA_VERSION, 0, len(mj)), mj, _U64.pack(len(self.instrs))]
        parts.append(b"".join(i.encode() for i in self.instrs))
        blob_len = sum(len(c) for c in chunks)
        parts.append(_U64.pack(blob_len))
        parts.extend(chunks)
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        parts.append(struct.pack("<I", crc))
        return b"".join(parts)

    # ------------------------------------------------------------------ decode
    @classmethod
    def decode(cls, data: bytes, source: str = "<bytes>") -> "Program":
        """Parse ``.pimb`` bytes with bounds checks on every length and offset.

        Raises:
            ProgramFormatError: bad magic, other container/ISA version, truncation, CRC
                mismatch, unknown opcode, or an inconsistent table; the message names
                ``source`` and what is wrong.
        """
        mv = memoryview(data)
        check_head(bytes(mv[: _HEAD.size]), len(data), source)
        mlen = _HEAD.unpack_from(mv, 0)[4]
        stored_crc = struct.unpack_from("<I", mv, len(data) - 4)[0]
        if zlib.crc32(mv[:-4]) != stored_crc:
            raise ProgramFormatError(f"{source}: CRC-32 mismatch: the file is truncated or corrupt; recompile it")
        pos = _HEAD.size
        try:
            meta = json.loads(bytes(mv[pos : pos + mlen]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ProgramFormatError(f"{source}: metadata is not valid JSON: {type(e).__name__}: {e}") from None
        from nhil.isa.meta import parse_meta

        meta = parse_meta(meta, source)
        pos += mlen
        (n,) = _U64.unpack_from(mv, pos)
        pos += 8
        if pos + n * WORD_BYTES + 8 > len(data) - 4:
            raise ProgramFormatError(f"{source}: {n} instructions run past the end of the file (truncated?)")
        instrs = [Instr.decode(bytes(mv[pos + i * WORD_BYTES : pos + (i + 1) * WORD_BYTES]), i) for i in range(n)]
        pos += n * WORD_BYTES
        (blob_len,) = _U64.unpack_from(mv, pos)
        pos += 8
        if pos + blob_len != len(data) - 4:
            raise ProgramFormatError(f"{source}: blob length {blob_len} does not match the file size")
        blob = mv[pos : pos + blob_len]
        try:
            prog = cls._from_meta(meta, instrs, blob)
        except (KeyError, TypeError, ValueError) as e:
            raise ProgramFormatError(f"{source}: malformed metadata: {type(e).__name__}: {e}") from None
        prog.validate_named(source)
        return prog

    def validate_named(self, source: str) -> None:
        """:meth:`validate`, with ``source`` (the file) at the start of the message."""
        try:
            self.validate()
        except ProgramFormatError as e:
            raise ProgramFormatError(f"{source}: {e}") from None

    @classmethod
    def _from_meta(cls, meta: dict, instrs: list[Instr], blob: memoryview) -> "Program":
        device = DeviceConfig.from_dict(meta["device"])
        shape = (device.channels, device.banks, device.cols)

        def take(off: int, nbytes: int, what: str) -> memoryview:
            if off < 0 or nbytes < 0 or off + nbytes > len(blob):
                raise ValueError(f"{what} [{off}:{off + nbytes}] is outside the {len(blob)}-byte blob")
            return blob[off : off + nbytes]

        banks = []
        for e in meta["bank_images"]:
            if e.get("zero"):
                banks.append(BankImage(int(e["row"]), None))
                continue
            raw = take(int(e["offset"]), int(e["nbytes"]), f"bank image row {e['row']}")
            slots, cols = int(e["slots"]), int(e["cols"])
            if not (0 <= slots <= device.slots and 0 <= cols <= device.cols) or len(raw) != 2 * slots * cols:
                raise ValueError(f"bank image row {e['row']}: {len(raw)} bytes for {slots} slots x {cols} cols (device has {device.slots} x {device.cols})")
            full = np.zeros((device.slots, device.cols), np.uint16)
            full[:slots, :cols] = np.frombuffer(raw, dtype="<u2").reshape(slots, cols)
            banks.append(BankImage(int(e["row"]), full.reshape(shape)))
        hosts = {}
        for e in meta["host_images"]:
            shp = tuple(int(s) for s in e["shape"])
            raw = take(int(e["offset"]), int(e["nbytes"]), f"host image {e['name']}")
            if len(raw) != 4 * int(np.prod(shp)):
                raise ValueError(f"host image {e['name']} has {len(raw)} bytes for shape {shp}")
            hosts[e["name"]] = np.frombuffer(raw, dtype="<f4").reshape(shp)
        return cls(
            device=device,
            instrs=instrs,
            operands=[Operand(str(b), int(o), int(c)) for b, o, c in meta["operands"]],
            host_ops=[HostOp(h["kernel"], tuple(h["inputs"]), tuple(h["outputs"]), dict(h["attrs"])) for h in meta["host_ops"]],
            buffers={str(k): int(v) for k, v in meta["buffers"].items()},
            bank_images=banks,
            host_images=hosts,
            io=meta["io"],
            info=meta["info"],
        )

    # ------------------------------------------------------------------ files
    def save(self, path) -> int:
        """Write atomically (temp file + rename); returns bytes written."""
        from nhil.util import atomic_write_bytes

        data = self.encode()
        atomic_write_bytes(path, data)
        return len(data)

    @classmethod
    def load(cls, path) -> "Program":
        """Read and decode a ``.pimb`` file.

        Raises:
            ProgramFormatError: the file is missing or malformed.
        """
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_HEAD.size)
                check_head(head, size, str(path))  # before reading the body
                check_layout(f, _HEAD.unpack(head)[4], size, str(path))
                f.seek(0)
                data = f.read()
        except OSError as e:
            raise ProgramFormatError(f"cannot read program {path}: {e.strerror}") from None
        return cls.decode(data, source=str(path))


def _used_rect(data: np.ndarray, device: DeviceConfig) -> tuple[int, int]:
    """(slots, cols) of the smallest leading rectangle holding every nonzero element of a row image.

    Compilers place matrices from slot 0 and column 0, so the file stores only that
    rectangle (zero elsewhere); it keeps ``.pimb`` files near the size of the weights.
    """
    flat = data.reshape(device.slots, device.cols)
    nz = flat != 0
    rows = np.flatnonzero(nz.any(axis=1))
    cols = np.flatnonzero(nz.any(axis=0))
    return (int(rows[-1]) + 1 if rows.size else 0, int(cols[-1]) + 1 if cols.size else 0)


def canonical_json(obj) -> str:
    """JSON with sorted keys and no whitespace: the byte-stable form used in ``.pimb``."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
