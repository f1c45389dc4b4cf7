"""ProgramBuilder: the emitter the lowering passes write PIM programs with.

It owns the program's tables (instructions, operands, host ops, buffers, images), the
row allocator of the banks, and the GEMV placement and instruction sequence
(``place_matrix`` / ``gemv``), which are the heart of the PIM mapping:

* **Placement** (AiM/CENT style): output row ``o`` of a weight matrix ``W[N, K]`` goes to
  device slot ``o % slots`` (slot = channel * banks + bank) of row-group ``o // slots``;
  the input dimension is cut into chunks of ``min(cols, gb_elems)`` elements, one DRAM
  row per (row-group, chunk). Weights are stored as bf16 (RNE from fp32).
* **GEMV**: for each batch of up to ``accumulators`` row-groups: zero the accumulators
  (WR_ACC), then for each chunk write the activation chunk to every channel's global
  buffer (WR_GB, skipped when it already holds it) and issue one all-bank MAC_AB per
  row-group; finally read each accumulator back (RD_ACC). So every output is the sum of
  its K products in burst order, exactly the contract of ``nhil.numerics.mac``.

The GEMV emission honours the lower-stage scheduling passes in effect
(the ``passes`` it is built with, every pass by default; ``nhil.compiler.pipeline`` passes its list): without ``bank-spread``
a bf16 matrix fills channel 0's banks only (``banks`` outputs per row-group, single-channel
MAC_AB/WR_ACC/RD_ACC); without ``row-locality`` each chunk's MACs are cut into column pieces interleaved across
accumulators, without ``vector-reuse`` the chunk is re-broadcast before every MAC, without
``handoff-batch`` every GEMV ends with a SYNC (the naive baseline of
``docs/timing-model.md``). None of this changes a computed value.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from nhil.errors import CompileError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, CFR_W_FMT, NO_OPERAND, OPINFO, Instr, Op
from nhil.isa.program import BankImage, HostOp, Operand, Program
from nhil.numerics.bf16 import f32_to_bf16_bits

ZEROS = "zeros"


def to_f32(t) -> np.ndarray:
    """A contiguous float32 numpy copy of a torch tensor (detached) or array."""
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.ascontiguousarray(t, dtype=np.float32)


@dataclasses.dataclass
class MatrixPlacement:
    """Where a weight matrix ``[n_out, n_in]`` lives: ``rows[g][j]`` = DRAM row of row-group g, input chunk j."""

    name: str
    n_out: int
    n_in: int
    chunk: int
    rows: list[list[int]]
    fmt: str = "bf16"
    fmt_code: int = 0
    nbytes: int = 0  # stored weight bytes (format headers/scales included)
    width: int = 0  # outputs per row-group: 0 = every slot of the device; ``banks`` = channel 0 only (no ``bank-spread``)
    act: str | None = None  # W8A8 activation mode (nhil.numerics.act_quant: int8 | fp8), None = bf16 activations

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(start, length) of each input chunk, elements."""
        return [(s, min(self.chunk, self.n_in - s)) for s in range(0, self.n_in, self.chunk)]


class ProgramBuilder:
    """Accumulates a :class:`~nhil.isa.program.Program` for ``device``."""

    def __init__(self, device: DeviceConfig, passes=None) -> None:
        self.d = device
        self.instrs: list[Instr] = []
        self.operands: list[Operand] = []
        self._operand_ix: dict[Operand, int] = {}
        self.host_ops: list[HostOp] = []
        self.buffers: dict[str, int] = {ZEROS: device.slots}
        self.bank_images: list[BankImage] = []
        self.host_images: dict[str, np.ndarray] = {}
        self.next_row = 0
        self._gb: tuple | None = None  # (buffer, offset, count) currently in every channel's GB at col 0
        self.placements: dict[str, MatrixPlacement] = {}
        self._pending_reads: set[str] = set()  # buffers read back since the last SYNC
        self.kv_formats: set[str] = set()  # formats of KV-cache rows (fp8 KV cache), for info["weight_formats"]
        self.raw_buffers: set[str] = set()  # buffers sent as raw 16-bit words (fp8 KV rows), info["raw_buffers"]
        self._wfmt = 0  # CFR W_FMT value in effect (0 = bf16, the reset value)
        self._want_wfmt = 0  # W_FMT the next MAC needs (gemv of a quantized matrix sets it)
        from nhil.compiler.schedule import PIPELINE

        self.passes = frozenset(PIPELINE if passes is None else passes)  # lower-stage scheduling passes in effect (nhil.compiler.schedule)

    # ------------------------------------------------------------ tables
    def buffer(self, name: str, size: int) -> str:
        """Declare (or re-check) an fp32 host buffer of ``size`` elements."""
        if self.buffers.get(name, size) != size:
            raise CompileError(f"buffer {name!r} declared with sizes {self.buffers[name]} and {size}")
        self.buffers[name] = int(size)
        return name

    def operand(self, buffer: str, offset: int, count: int) -> int:
        """Index of the operand ``buffer[offset:offset+count]`` (deduplicated)."""
        o = Operand(buffer, int(offset), int(count))
        if o not in self._operand_ix:
            self._operand_ix[o] = len(self.operands)
            self.operands.append(o)
        return self._operand_ix[o]

    def emit(self, op: Op, *, all_ch: bool = True, flags: int = 0, ch=0, bank=0, row=0, col=0, n=0, k=0, imm=0, operand: int = NO_OPERAND) -> None:
        """Append one device instruction (``all_ch`` sets the ALL_CH flag)."""
        info = OPINFO[op]
        if info.data_in and self.operands[operand].buffer in self._pending_reads:
            self.sync()  # read-after-readback: the host must hold the data before it sends it back
        if info.data_out:
            self._pending_reads.add(self.operands[operand].buffer)
        if op is Op.WR_GB:
            self._gb = None
        if (op is Op.MAC_AB or op is Op.MAC_SB) and self._want_wfmt != self._wfmt:
            self.set_wfmt(self._want_wfmt)
        self.instrs.append(Instr(op, flags | (ALL_CH if all_ch else 0), ch, bank, row, col, n, operand, k, imm))

    def want_wfmt(self, code: int, name: str | None = None) -> None:
        """The format the next MACs read rows in (0 = bf16), for rows this builder did not place (fp8 KV cache);
        ``name`` is recorded in ``kv_formats`` so the program's ``info["weight_formats"]`` lists it."""
        self._want_wfmt = int(code)
        if name:
            self.kv_formats.add(name)

    def set_wfmt(self, code: int) -> None:
        """SET_CFR W_FMT (all channels): the format MACs read weight rows in. bf16-only programs never emit it."""
        self.instrs.append(Instr(Op.SET_CFR, ALL_CH, k=CFR_W_FMT, imm=int(code)))
        self._wfmt = int(code)

    def sync(self) -> None:
        """Append a SYNC: readbacks before it reach the host before anything after it is issued."""
        self.instrs.append(Instr(Op.SYNC))
        self._pending_reads.clear()

    def host(self, kernel: str, inputs: list[str], outputs: list[str], **attrs) -> None:
        """Append a HOST call (preceded by a SYNC so earlier readbacks are complete)."""
        if self.instrs and self.instrs[-1].op not in (Op.SYNC, Op.HOST):
            self.sync()
        self.host_ops.append(HostOp(kernel, tuple(inputs), tuple(outputs), attrs))
        self.instrs.append(Instr(Op.HOST, imm=len(self.host_ops) - 1))

    def host_image(self, name: str, arr) -> str:
        """Register an fp32 host constant (norm weight, embedding table, inv_freq).

        A meta tensor (shape-only compilation, ``nhil.compiler.shape_only``) registers an
        empty stub: the image is named in the program but holds no values.
        """
        if name in self.host_images:
            return name
        self.host_images[name] = np.zeros(0, np.float32) if getattr(arr, "is_meta", False) else to_f32(arr)
        return name

    def alloc_rows(self, n: int, zero: bool = True) -> int:
        """Reserve ``n`` consecutive rows (zero-filled images when ``zero``); returns the first.

        Raises:
            CompileError: the device has no rows left (names how many were needed).
        """
        start = self.next_row
        if start + n > self.d.rows:
            raise CompileError(f"the model does not fit device {self.d.name}: needs more than {self.d.rows} rows per bank (asked for {n} more at row {start}); use a larger DEVICE preset")
        self.next_row += n
        if zero:
            self.bank_images.extend(BankImage(r, None) for r in range(start, start + n))
        return start

    # ------------------------------------------------------------ GEMV
    def place_matrix(self, name: str, w, qt=None) -> MatrixPlacement:
        """Store ``w`` (fp32 [n_out, n_in], torch or numpy) in banks; idempotent per ``name``.

        Without ``qt`` the rows hold bf16 (RNE from fp32), as in ISA v0. With ``qt`` (a
        :class:`nhil.numerics.formats.QTensor` of the same shape) each (row-group, chunk)
        row holds, for its output row, the format's packed bytes of the chunk
        (``QTensor.pack``: header, then block records), from byte 0 of the row; the MACs
        of :meth:`gemv` then run with CFR ``W_FMT`` = the format's code.
        """
        if name in self.placements:
            return self.placements[name]
        if qt is not None:
            return self._place_quantized(name, qt)
        if getattr(w, "is_meta", False):  # shape-only compilation (nhil.compiler.shape_only)
            return self._place_shape_only(name, *w.shape)
        w = to_f32(w)
        n_out, n_in = w.shape
        d = self.d
        chunk = min(d.cols, d.gb_elems)
        bits = f32_to_bf16_bits(w)
        width = self._width()
        groups = math.ceil(n_out / width)
        nch = math.ceil(n_in / chunk)
        rows: list[list[int]] = []
        for g in range(groups):
            rg = []
            o0, o1 = g * width, min(n_out, (g + 1) * width)
            for j in range(nch):
                r = self.alloc_rows(1, zero=False)
                i0, i1 = j * chunk, min(n_in, (j + 1) * chunk)
                img = np.zeros((d.slots, d.cols), np.uint16)
                img[: o1 - o0, : i1 - i0] = bits[o0:o1, i0:i1]
                self.bank_images.append(BankImage(r, img.reshape(d.channels, d.banks, d.cols)))
                rg.append(r)
            rows.append(rg)
        p = MatrixPlacement(name, n_out, n_in, chunk, rows, nbytes=2 * n_out * n_in, width=0 if width == d.slots else width)
        self.placements[name] = p
        return p

    def _width(self) -> int:
        """Outputs per row-group of a bf16 matrix: every slot (``bank-spread``) or channel 0's banks (naive baseline)."""
        return self.d.slots if "bank-spread" in self.passes else self.d.banks

    def _place_shape_only(self, name: str, n_out: int, n_in: int) -> MatrixPlacement:
        """Hook for shape-only compilation: :meth:`place_matrix`'s bf16 placement without bank images.

        Rows are allocated exactly as for real weights; ``row_use[row]`` records the used
        (slots, elements) rectangle of each row, for the timing model's useful-byte counts.
        """
        d = self.d
        chunk = min(d.cols, d.gb_elems)
        row_use = self.__dict__.setdefault("row_use", {})
        rows = []
        width = self._width()
        for g in range(math.ceil(n_out / width)):
            rg = []
            for j in range(math.ceil(n_in / chunk)):
                r = self.alloc_rows(1, zero=False)
                row_use[r] = (min(width, n_out - g * width), min(chunk, n_in - j * chunk))
                rg.append(r)
            rows.append(rg)
        p = MatrixPlacement(name, n_out, n_in, chunk, rows, nbytes=2 * n_out * n_in, width=0 if width == d.slots else width)
        self.placements[name] = p
        return p

    def _place_quantized(self, name: str, qt) -> MatrixPlacement:
        fmt = qt.fmt
        n_out, n_in = qt.shape
        d = self.d
        chunk = min(d.cols, d.gb_elems)
        blk = fmt.block or n_in
        if n_in > chunk and chunk % blk:
            raise CompileError(f"{name}: {fmt.name} blocks of {blk} do not divide the device chunk of {chunk} elements (device {d.name})")
        groups = math.ceil(n_out / d.slots)
        nch = math.ceil(n_in / chunk)
        rows: list[list[int]] = []
        for j in range(nch):
            i0, i1 = j * chunk, min(n_in, (j + 1) * chunk)
            packed = qt.pack(i0, i1)  # uint8 [n_out, nbytes]
            if packed.shape[1] > d.row_bytes:
                raise CompileError(f"{name}: {packed.shape[1]} bytes of {fmt.name} per chunk exceed a {d.row_bytes}-byte row")
            for g in range(groups):
                o0, o1 = g * d.slots, min(n_out, (g + 1) * d.slots)
                if j == 0:
                    rows.append([])
                r = self.alloc_rows(1, zero=False)
                img = np.zeros((d.slots, d.row_bytes), np.uint8)
                img[: o1 - o0, : packed.shape[1]] = packed[o0:o1]
                self.bank_images.append(BankImage(r, img.view("<u2").astype(np.uint16).reshape(d.channels, d.banks, d.cols)))
                rows[g].append(r)
        p = MatrixPlacement(name, n_out, n_in, chunk, rows, fmt=fmt.name, fmt_code=fmt.code, nbytes=qt.nbytes, act=qt.meta.get("act"))
        self.placements[name] = p
        return p

    def write_gb(self, buffer: str, offset: int, count: int, col: int = 0) -> None:
        """WR_GB of ``buffer[offset:offset+count]`` at burst ``col`` of every channel (skipped if already there)."""
        key = (buffer, offset, count, col)
        if self._gb == key:
            return
        n = math.ceil(count / self.d.lanes)
        self.emit(Op.WR_GB, col=col, n=n, operand=self.operand(buffer, offset, count))
        self._gb = key

    def invalidate_gb(self) -> None:
        """Forget what the GB holds (call when a host op rewrites a buffer that may be in the GB)."""
        self._gb = None

    def gemv(self, p: MatrixPlacement, x: str, y: str, x_off: int = 0, y_off: int = 0) -> None:
        """Emit ``y[y_off:y_off+n_out] = W @ x[x_off:x_off+n_in]`` (see the module docstring); with ``p.act``
        (W8A8, ``nhil.numerics.act_quant``) the host quantizes ``x`` per token first and rescales the result."""
        if p.act:
            xq, xs, yq = self.buffer(f"{p.name}.act_q", p.n_in), self.buffer(f"{p.name}.act_s", 1), self.buffer(f"{p.name}.acc", p.n_out)
            self.host("act_quant", [x], [xq, xs], mode=p.act, offset=int(x_off), count=p.n_in)
            self.invalidate_gb()
            self._gemv(p, xq, yq, 0, 0)
            self.host("act_rescale", [yq, xs], [y], offset=int(y_off), count=p.n_out)
            self.invalidate_gb()
            return
        self._gemv(p, x, y, x_off, y_off)

    def _gemv(self, p: MatrixPlacement, x: str, y: str, x_off: int, y_off: int) -> None:
        d = self.d
        chunks = p.chunks
        groups = list(range(len(p.rows)))
        self._want_wfmt = p.fmt_code
        from nhil.compiler.schedule import NAIVE_PIECES

        locality = "row-locality" in self.passes or p.fmt_code != 0  # quantized rows are decoded whole
        reuse = "vector-reuse" in self.passes
        width = p.width or d.slots
        one = width != d.slots  # naive placement: channel 0 only
        for b0 in range(0, len(groups), d.accumulators):
            batch = groups[b0 : b0 + d.accumulators]
            for k, g in enumerate(batch):
                self.emit(Op.WR_ACC, all_ch=not one, k=k, col=0, n=width, operand=self.operand(ZEROS, 0, width))
            for j, (s, ln) in enumerate(chunks):
                nb = math.ceil(ln / d.lanes)
                step = nb if locality else max(1, math.ceil(nb / NAIVE_PIECES))
                for c0 in range(0, nb, step):
                    for k, g in enumerate(batch):
                        if not reuse:
                            self.invalidate_gb()
                        self.write_gb(x, x_off + s, ln)
                        self.emit(Op.MAC_AB, all_ch=not one, row=p.rows[g][j], col=c0, n=min(step, nb - c0), k=k)
            for k, g in enumerate(batch):
                cnt = min(width, p.n_out - g * width)
                self.emit(Op.RD_ACC, all_ch=not one, k=k, col=0, n=cnt, operand=self.operand(y, y_off + g * width, cnt))
        self._want_wfmt = 0
        if "handoff-batch" not in self.passes:
            self.sync()  # naive baseline: one host/PIM hand-off per GEMV

    # ------------------------------------------------------------ finish
    def finish(self, io: dict, info: dict) -> Program:
        """Close the stream with SYNC + EOC and return the validated Program."""
        if self._wfmt != 0:
            self.set_wfmt(0)  # every step starts with W_FMT = bf16, as after load
        if not self.instrs or self.instrs[-1].op is not Op.SYNC:
            self.sync()
        self.instrs.append(Instr(Op.EOC))
        prog = Program(self.d, self.instrs, self.operands, self.host_ops, self.buffers, sorted(self.bank_images, key=lambda b: b.row), self.host_images, io, info)
        prog.validate()
        return prog
