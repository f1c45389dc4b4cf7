"""ISA v0 of the PIM channel, the program container (``.pimb``) and its text form (``.pims``).

Semantics of every instruction: ``docs/isa.md``. Container layout: ``docs/program-format.md``.
"""

from nhil.isa.device import DEVICE_PRESETS, DeviceConfig
from nhil.isa.instr import ALL_CH, FLAG_POS_COL, FLAG_POS_SLOT, Instr, Op, OPINFO
from nhil.isa.program import BankImage, HostOp, Operand, Program

__all__ = [
    "DEVICE_PRESETS",
    "DeviceConfig",
    "Instr",
    "Op",
    "OPINFO",
    "ALL_CH",
    "FLAG_POS_COL",
    "FLAG_POS_SLOT",
    "Program",
    "Operand",
    "HostOp",
    "BankImage",
]
