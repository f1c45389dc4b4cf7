"""Device configuration of the PIM device (an AiM-like DRAM channel array).

Anchors (``../shared/research/pim_anchors.md`` sections 1 and 7): SK hynix GDDR6-AiM has
16 banks per channel, 2 KB rows (1024 bf16 elements), 16 MAC lanes per bank (a 32-byte
burst), a 2 KB global buffer per channel, and MAC registers per bank; the open AiM
simulator and CENT (ASPLOS'25) use 32 channels and 16384 rows per bank.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """Sizes of one PIM device.

    Attributes:
        name: preset name.
        channels: number of channels (each with its own global buffer).
        banks: banks per channel.
        rows: rows per bank.
        row_bytes: bytes per row (``cols = row_bytes // 2`` bf16 elements).
        lanes: MAC lanes per bank = bf16 elements per burst (burst = ``2*lanes`` bytes).
        accumulators: fp32 accumulators per bank (``k`` operand of MAC/RD_ACC/WR_ACC).
        gb_bytes: global buffer bytes per channel.
        clock_hz: processing-unit clock in Hz (for the timing model).
        vectors: global buffers per channel and accumulator sets per bank of the prefill extension
            (``MAC_ABV``, ``docs/isa.md`` "Prefill extension"): how many token vectors one row
            activation serves; 1 = no extension (only GB and accumulator set 0).
    """

    name: str = "aim-like"
    channels: int = 32
    banks: int = 16
    rows: int = 16384
    row_bytes: int = 2048
    lanes: int = 16
    accumulators: int = 4
    gb_bytes: int = 2048
    clock_hz: float = 1e9
    vectors: int = 1

    @property
    def cols(self) -> int:
        """bf16 elements per row."""
        return self.row_bytes // 2

    @property
    def bursts_per_row(self) -> int:
        """Bursts (of ``lanes`` elements) per row."""
        return self.cols // self.lanes

    @property
    def gb_elems(self) -> int:
        """bf16 elements in one channel's global buffer."""
        return self.gb_bytes // 2

    @property
    def slots(self) -> int:
        """Banks in the whole device (``channels * banks``): outputs of one all-channel MAC_AB."""
        return self.channels * self.banks

    def as_dict(self) -> dict:
        """The fields as a dict, for program headers; ``vectors`` is left out when it is 1 (a device without the
        prefill extension), so such devices encode as they did before the extension existed."""
        d = dataclasses.asdict(self)
        if d["vectors"] == 1:
            del d["vectors"]
        return d

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) of :meth:`as_dict`, used in hashes."""
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceConfig":
        """Inverse of ``dataclasses.asdict``; unknown keys raise ``TypeError``."""
        return cls(**d)


DEVICE_PRESETS: dict[str, DeviceConfig] = {
    # prefill extension: 16 global buffers per channel (32 KB of SRAM) and 16 accumulator sets per bank
    # (16 x 4 fp32 = 256 B): one row activation serves up to 16 prompt tokens (MAC_ABV, docs/isa.md "Prefill extension")
    "aim-like": DeviceConfig(vectors=16),
    "fpga-small": DeviceConfig(name="fpga-small", channels=2, banks=16, rows=1024),
    "rtl-tiny": DeviceConfig(name="rtl-tiny", channels=1, banks=16, rows=256, row_bytes=256, gb_bytes=256),
    # one AiM channel (16 banks x 16384 rows x 2 KB rows, 2 KB global buffer): the largest
    # single-channel RTL build; SmolLM2-135M fits it (nhil.targets.rtl, docs/rtl-interface.md)
    "rtl-aim1": DeviceConfig(name="rtl-aim1", channels=1, banks=16, rows=16384, row_bytes=2048, gb_bytes=2048),
    # multi-channel RTL (pim_device: CHANNELS pim_channel instances on one command bus): rtl-tiny's
    # channel twice / four times (CI), and AiM channels with the same 512 MB as rtl-aim1 split over
    # 2 / 4 channels, so SmolLM2 sits in half / a quarter of the rows per channel
    "rtl-tiny2": DeviceConfig(name="rtl-tiny2", channels=2, banks=16, rows=256, row_bytes=256, gb_bytes=256),
    "rtl-tiny4": DeviceConfig(name="rtl-tiny4", channels=4, banks=16, rows=256, row_bytes=256, gb_bytes=256),
    "rtl-aim2": DeviceConfig(name="rtl-aim2", channels=2, banks=16, rows=8192, row_bytes=2048, gb_bytes=2048),
    "rtl-aim4": DeviceConfig(name="rtl-aim4", channels=4, banks=16, rows=4096, row_bytes=2048, gb_bytes=2048),
}
