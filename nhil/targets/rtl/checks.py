"""Run-time checks of the RTL target: what it refuses before an instruction reaches the command port.

The device-semantics table (``nhil.isa.semantics``) as the simulator applies it, plus what the RTL adds:
quantized weight formats on 16-lane devices only (``rtl_stubs/pim_wdec.sv``), and CFRs that every channel of
``pim_device`` reads for itself, so the addressed channels must agree where the simulator reads channel 0's.
"""

from __future__ import annotations

import numpy as np

from nhil.errors import RunError
from nhil.isa.device import DeviceConfig
from nhil.isa.instr import ALL_CH, CFR_ACC_RD_FMT, CFR_W_FMT, Instr, Op
from nhil.isa.semantics import check_instr
from nhil.numerics.mac import LANES
from nhil.targets.rtl.spec import RTL_OPS


def _err(idx: int, ins: Instr, msg: str) -> RunError:
    return RunError(f"instruction {idx} ({ins.op.name}): {msg}")


def check_rtl_instr(idx: int, ins: Instr, payload, d: DeviceConfig, cfr: np.ndarray) -> None:
    """The RTL target's run-time checks of instruction ``idx`` before it is sent: the device-semantics table
    (``nhil.isa.semantics``), the RTL's lane rule for quantized formats, the channels' CFRs (:func:`check_cfr`,
    which updates ``cfr``, int64 [channels, 2]), then the payload (its size and dtype per opcode).

    Raises:
        RunError: naming the instruction index and opcode, and the rule.
    """
    op = ins.op
    if op not in RTL_OPS:
        raise _err(idx, ins, "opcode not implemented by the RTL target (reserved in ISA v0)" if op is not Op.HOST else "HOST is not a device instruction")
    why = check_instr(ins, d)
    if why:
        raise _err(idx, ins, why)
    if op is Op.SET_CFR and ins.k == CFR_W_FMT and ins.imm != 0 and d.lanes != LANES:  # the RTL decodes quantized rows on 16-lane devices only
        raise _err(idx, ins, f"weight format code 0x{ins.imm:x}: quantized formats need {LANES} lanes on the RTL (device has {d.lanes})")
    check_cfr(idx, ins, d, cfr)
    need = {Op.WR_ACC: (ins.n, np.float32), Op.WR_GB: (ins.n * d.lanes, np.uint16), Op.WR_SBK: (d.lanes, np.uint16),
            Op.WR_ABK: (ins.n * d.lanes, np.uint16)}.get(op)
    if need is not None and (payload is None or payload.size != need[0] or payload.dtype != need[1]):
        got = "none" if payload is None else f"{payload.size} x {payload.dtype}"
        raise _err(idx, ins, f"payload must be {need[0]} x {np.dtype(need[1])}, got {got}")


def check_cfr(idx: int, ins: Instr, d: DeviceConfig, cfr: np.ndarray) -> None:
    """Track CFR per channel; refuse what the channels cannot agree on (each channel of ``pim_device``
    reads its own CFRs). MAC with W_FMT: the simulator's rule (every addressed channel the same
    format). RD_ACC of ALL_CH: the simulator rounds every slot by channel 0's ACC_RD_FMT, the
    device each channel by its own, so the addressed channels must agree."""
    op = ins.op
    chans = slice(None) if ins.flags & ALL_CH else slice(ins.ch, ins.ch + 1)
    if op is Op.SET_CFR:
        cfr[chans, ins.k] = ins.imm
    elif op in (Op.MAC_AB, Op.MAC_SB):
        wf = cfr[chans, CFR_W_FMT]
        if wf.any() and not (wf == wf[0]).all():
            raise _err(idx, ins, "the addressed channels have different CFR W_FMT values")
    elif op is Op.RD_ACC and ins.flags & ALL_CH:
        first, last = ins.col // d.banks, (ins.col + ins.n - 1) // d.banks
        fmt = cfr[[0, *range(first, last + 1)], CFR_ACC_RD_FMT]
        if not (fmt == fmt[0]).all():
            raise _err(idx, ins, f"ALL_CH RD_ACC of channels {first}..{last}: their CFR ACC_RD_FMT {fmt[1:].tolist()} differ from "
                       f"channel 0's {fmt[0]} (the simulator rounds by channel 0's, each RTL channel by its own; "
                       "set ACC_RD_FMT with ALL_CH)")
