"""Pluggable execution targets behind one interface (``nhil.targets.base.Target``).

Targets register by name (``sim``, ``rtl``, ``fpga``); third-party targets register via
the ``nhil.targets`` entry-point group. ``get_target(name, **options)`` builds one.
"""

from nhil.targets.base import Capabilities, ResolvedInstr, SyncRecord, Target
from nhil.targets.registry import available_targets, get_target, register_target

__all__ = ["Capabilities", "ResolvedInstr", "SyncRecord", "Target", "available_targets", "get_target", "register_target"]
