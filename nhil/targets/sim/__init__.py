"""Functional simulator target: executes ISA v0 over numpy state (``docs/isa.md``)."""

from nhil.targets.sim.device import PimState
from nhil.targets.sim.target import SimTarget

__all__ = ["PimState", "SimTarget"]
