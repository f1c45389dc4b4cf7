"""Timing tables of the PIM device presets (command-clock cycles, ``tCK``).

The ``aim-like`` table is the open AiM simulator's ``GDDR6_AiM_timing`` preset
(``arkhadem/aim_simulator`` ``src/dram/impl/GDDR6.cpp``; ``../shared/research/pim_anchors.md``
section 1.4), tCK = 0.5 ns, so ``nCCD = 2`` gives one 32-byte MAC burst per bank per ns
(the 1 GHz processing unit) and 16 banks x 32 B / ns = 512 GB/s per channel.

Parameters the AiM preset does not list are taken from the GDDR6 presets of the same
file (``nRTP`` 4, ``nWR`` 30, ``nCWL`` 6) or are our assumptions, marked ``[assumed]``
in :class:`TimingTable` and in ``docs/timing-model.md``.
"""

from __future__ import annotations

import dataclasses
import math

from nhil.isa.device import DeviceConfig


@dataclasses.dataclass(frozen=True)
class TimingTable:
    """Command-level timing parameters, in command-clock cycles (``tck_ns`` each).

    Attributes (AiM name in parentheses where it differs):
        tck_ns: command clock period in ns.
        nBL: external data-bus occupancy of one 32-byte burst (WRGB, WRACC, RDACC, RD, WR).
        nCL: read latency of a bank read (RD) to data on the bus.
        nCWL: write latency (WR command to data).
        nRCDRD / nRCDWR: ACT to RD / WR of the same bank.
        nRCDRDMAC: ACT to the first MAC of the same bank.
        nRCDRDCP / nRCDWRCP: ACT to a bank<->GB copy.
        nRP: PRE to ACT of the same bank (and PRE to REF).
        nRAS: ACT to PRE of the same bank.
        nRC: ACT to ACT of the same bank.
        nCCD: column-to-column spacing on the bank side (MAC, RD, WR, RDCP, WRCP) of a channel.
        nRRD: ACT to ACT of any bank in a channel.
        nFAW: four-activate window: at most 4 ACT commands (an all-bank ACT counts as one
            command, as AiM's ACT16) in any nFAW window of a channel.
        nRTP: last read-type column command (RD, MAC, RDCP) to PRE of that bank.
        nWR: write recovery; last WR/WRCP to PRE is ``nCWL + nBL + nWR``.
        nRFC: all-bank refresh duration (REF to next ACT).
        nREFI: average refresh interval; a channel may postpone or pull in up to
            ``max_ref_slack`` refreshes (JEDEC rule), never more.
        nMACLAT: [assumed] MAC pipeline depth: last MAC on an accumulator to RDACC of it.
        nCWLGB: WRGB to a MAC reading that GB column (AiM nCWLGB).
        nCWLREG: WRACC to a MAC on that accumulator (AiM nCWLREG).
        nCLREG: RDACC command to data (AiM nCLREG).
        nEW: [assumed] an elementwise op on the accumulators (EWMUL / EWADD / AF, one per bank in
            parallel): command to result, as deep as the MAC pipeline (``nhil.timing.ew``).
        host_latency_ns: [assumed] one device->host->device hand-off (SYNC): readback
            reaches the host, host decides, next command leaves; CENT adds a CXL latency
            of this order per block.
        host_gbs: [assumed] host kernel throughput (bytes in + out per ns, GB/s).
        host_op_ns: [assumed] fixed cost per host kernel call.
        ext_channel_gbs: external (host) bandwidth per channel in GB/s (16 Gb/s x 16 DQ).
        row_buffers: row buffers per bank (1 = DRAM as built). With 2 (a device-parameter
            study, not a preset), a row opens in the buffer that holds it or else the least
            recently activated one (the controller's choice), and each buffer keeps
            its own ACT/PRE timing (nRCD*, nRAS, nRP, nRC), so the next row activates while
            the current one streams; the channel's ACT spacing (nRRD, nFAW) and column
            spacing (nCCD) are shared. The legality checker knows one buffer only.
        forward_latency_ns: [what-if, not a preset; ``None`` = off] a device-parameter study of a controller-side
            forward path, which no AiM-class device has: a readback buffer that no host kernel reads (the pure
            gather of a GEMV's output that the next GEMV's WR_GB broadcasts) reaches that WR_GB this long after
            its SYNC instead of ``host_latency_ns``. Only :class:`nhil.timing.overlap.HostOverlapEngine`
            models it; :class:`nhil.timing.engine.TimingEngine` refuses a table that sets it.
    """

    name: str = "aim-like"
    tck_ns: float = 0.5
    nBL: int = 2
    nCL: int = 50
    nCWL: int = 6
    nRCDRD: int = 36
    nRCDWR: int = 28
    nRCDRDMAC: int = 56
    nRCDRDCP: int = 66
    nRCDWRCP: int = 48
    nRP: int = 32
    nRAS: int = 54
    nRC: int = 89
    nCCD: int = 2
    nRRD: int = 11
    nFAW: int = 42
    nRTP: int = 4
    nWR: int = 30
    nRFC: int = 210
    nREFI: int = 3333
    max_ref_slack: int = 8
    nMACLAT: int = 8
    nCWLGB: int = 1
    nCWLREG: int = 1
    nCLREG: int = 0
    nEW: int = 8
    host_latency_ns: float = 500.0
    host_gbs: float = 100.0
    host_op_ns: float = 100.0
    ext_channel_gbs: float = 32.0
    row_buffers: int = 1
    forward_latency_ns: float | None = None

    def replace(self, **kw) -> "TimingTable":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ formulas
    def mac_row_cycles(self, bursts: int) -> int:
        """Cycles one all-bank row occupies in a row-by-row GEMV: ACT, ``bursts`` MACs, PRE, until the next ACT.

        ``nRCDRDMAC + nCCD*(bursts-1) + nRTP + nRP``, but at least ``nRC`` (ACT to ACT)
        and with ACT->PRE at least ``nRAS``. With ``row_buffers`` > 1 the buffers take
        turns: ``max(nCCD*bursts, ceil(that / row_buffers), nRRD)``.
        """
        act_to_pre = max(self.nRAS, self.nRCDRDMAC + self.nCCD * (bursts - 1) + self.nRTP)
        one = max(self.nRC, act_to_pre + self.nRP)
        if self.row_buffers > 1:  # buffers take turns: a row costs its stream, or its buffer's ACT-to-ACT shared by the others
            return max(self.nCCD * bursts, -(-one // self.row_buffers), self.nRRD)
        return one

    def mac_latency_cycles(self, bursts: int) -> int:
        """Unloaded latency of one MAC_AB on a closed bank: ACT to the accumulator update of its last burst."""
        return self.nRCDRDMAC + self.nCCD * (bursts - 1) + self.nMACLAT

    def wr_gb_cycles(self, bursts: int) -> int:
        """Unloaded WR_GB of ``bursts`` bursts: first WRGB to the last burst written."""
        return self.nBL * (bursts - 1) + self.nCWLGB

    def rd_acc_cycles(self, bursts: int) -> int:
        """Unloaded RD_ACC of ``bursts`` 32-byte bursts per channel: first RDACC to the last data."""
        return self.nBL * (bursts - 1) + self.nCLREG + self.nBL

    def row_bound_fraction(self, bursts_per_row: int) -> float:
        """Fraction of the peak column rate an all-bank row-by-row stream can reach (ACT/PRE-limited)."""
        return self.nCCD * bursts_per_row / self.mac_row_cycles(bursts_per_row)

    def refresh_fraction(self) -> float:
        """Fraction of time a channel is refreshing when refresh cannot hide in idle gaps."""
        return self.nRFC / self.nREFI


def peak_internal_gbs(d: DeviceConfig, t: TimingTable) -> float:
    """All-bank MAC column rate of the whole device in GB/s: channels x banks x burst / (nCCD x tCK)."""
    return d.channels * d.banks * (2 * d.lanes) / (t.nCCD * t.tck_ns)


def peak_external_gbs(d: DeviceConfig, t: TimingTable) -> float:
    """External bandwidth of the device (all channels) in GB/s."""
    return d.channels * t.ext_channel_gbs


TIMING_PRESETS: dict[str, TimingTable] = {
    "aim-like": TimingTable(),
    # the FPGA prototype and the RTL model run the same command timing in model time
    "fpga-small": TimingTable(name="fpga-small"),
    "rtl-tiny": TimingTable(name="rtl-tiny"),
}


def timing_for(device: DeviceConfig) -> TimingTable:
    """The timing table of a device preset (by name prefix; ``aim-like`` for unknown or derived devices)."""
    for name, t in TIMING_PRESETS.items():
        if device.name == name or device.name.startswith(name + " "):
            return t
    return TIMING_PRESETS["aim-like"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["TimingTable", "TIMING_PRESETS", "timing_for", "peak_internal_gbs", "peak_external_gbs", "ceil_div", "math"]
