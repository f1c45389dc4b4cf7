"""``sim`` target: the functional simulator behind the Target interface."""

from __future__ import annotations

import numpy as np

from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import EW_OPS, EXTENSION_OPS, OPINFO, Op
from nhil.isa.program import Program
from nhil.numerics.formats import DEVICE_FORMATS
from nhil.targets.base import DEVICE_OPS, Capabilities, ResolvedInstr, Target, check_program_fits
from nhil.targets.readback_digest import ReadbackDigest, SyncRecord
from nhil.targets.sim.device import PimState
from nhil.targets.sim.fast import FastPimState

SIM_OPS = DEVICE_OPS | EXTENSION_OPS | EW_OPS  # ISA v0, the prefill extension (MAC_ABV, accumulator sets) and the elementwise ops (docs/isa.md)


class SimTarget(Target):
    """Functional simulator of one PIM device.

    Args:
        device: a DeviceConfig or preset name; ``None`` adopts the device of the loaded
            program (the simulator can model any size).
        reference: execute every instruction with ``PimState.step`` (the per-instruction
            reference semantics) instead of the fast path (``nhil.targets.sim.fast``:
            compiled bf16 MACs, batched KV appends), which must give the same bits.
    """

    name = "sim"

    def __init__(self, device: DeviceConfig | str | None = None, reference: bool = False, **_ignored) -> None:
        self._fixed = DEVICE_PRESETS[device] if isinstance(device, str) else device
        self.reference = bool(reference)
        self.state: PimState | None = None
        self._digest = ReadbackDigest(background=True)
        self._images: list | None = None  # _image_ids of the loaded program

    @property
    def takes_runs(self) -> bool:
        """The fast path takes KV-append runs as arrays (``nhil.targets.base.ResolvedRun``); the reference path does not."""
        return not self.reference

    def capabilities(self) -> Capabilities:
        return Capabilities(0, SIM_OPS, DEVICE_FORMATS, self._fixed or (self.state.d if self.state else DEVICE_PRESETS["aim-like"]))

    def load(self, program: Program) -> None:
        dev = self._fixed or program.device
        check_program_fits(program, Capabilities(0, SIM_OPS, DEVICE_FORMATS, dev), self.name)
        self.state = (PimState if self.reference else FastPimState)(dev, reserve_rows=len(program.bank_images) + 8)
        self.state.load_images(program.bank_images)
        self._digest = ReadbackDigest(background=True)
        self._images = self._image_ids(program)
        self._started(program)

    def _started(self, program: Program) -> None:
        """Called once ``program`` is loaded or reloaded (a subclass restarts what it keeps per run)."""

    @staticmethod
    def _image_ids(program: Program) -> list:
        return [(id(img), img.row, id(img.data)) for img in program.bank_images]  # an image replaced or edited by assignment differs

    def reload(self, program: Program) -> None:
        """``Target.reload``: the same state as ``load(program)``, restoring only the rows the last run wrote
        (``PimState.reload_images``) when ``program``'s bank images are the ones loaded (the same objects, rows and
        data arrays); else ``load``.

        Raises:
            LoadError: as ``load``.
        """
        st = self.state
        if st is None or self._images != self._image_ids(program) or st.d != (self._fixed or program.device):
            self.load(program)
            return
        st.reload_images(program.bank_images)
        self._digest = ReadbackDigest(background=True)
        self._started(program)

    def execute(self, block: list[ResolvedInstr]) -> list[np.ndarray]:
        st = self.state
        assert st is not None, "load() a program first"
        if not self.reference:
            return st.run_block(block, self._digest)
        out = []
        for idx, ins, payload in block:
            r = st.step(idx, ins, payload)
            if r is not None:
                out.append(r)
                self._digest.add(r)
            elif ins.op is Op.SYNC:
                self._digest.sync(idx)
        return out

    def read_row(self, ch: int, bank: int, row: int) -> np.ndarray:
        s = self.state.slot(row, allocate=False)
        return np.zeros(self.state.d.cols, np.uint16) if s < 0 else self.state.mem[ch, bank, s].copy()

    def write_row(self, ch: int, bank: int, row: int, data: np.ndarray) -> None:
        s = self.state.slot(row, allocate=True)
        self.state.drop_decoded(s)
        self.state.mem[ch, bank, s] = data

    def trace(self) -> list[SyncRecord]:
        return list(self._digest.records)

    def stats(self) -> dict:
        st = self.state
        if st is None:
            return {}
        return {"instructions": dict(st.counts), "macs": st.macs, "rows_allocated": st.rows_allocated(), "bytes_allocated": int(st.mem[:, :, : st.n_slots].nbytes)}


assert all(OPINFO[o].device for o in SIM_OPS)
