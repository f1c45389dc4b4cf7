"""Target registry: built-in names plus the ``nhil.targets`` entry-point group."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from nhil.errors import SetupError

_FACTORIES: dict[str, Callable] = {}


def register_target(name: str, factory: Callable) -> None:
    """Register ``factory(**options) -> Target`` under ``name``."""
    _FACTORIES[name] = factory


def _builtin() -> None:
    if "sim" not in _FACTORIES:
        from nhil.targets.sim import SimTarget

        register_target("sim", SimTarget)
    for ep in entry_points(group="nhil.targets"):
        if ep.name not in _FACTORIES:
            _FACTORIES[ep.name] = ep.load()


BUILTIN_TARGETS = ("sim", "rtl", "fpga")


def target_names() -> list[str]:
    """Names a target may be built under (built-ins, registered, entry points), without importing any
    target module: ``nhil.args`` checks a name with it before any work starts."""
    return sorted(set(BUILTIN_TARGETS) | set(_FACTORIES) | {ep.name for ep in entry_points(group="nhil.targets")})


def available_targets() -> list[str]:
    """Names of registered targets."""
    _builtin()
    _optional()
    return sorted(_FACTORIES)


def _optional() -> None:
    """Register rtl/fpga targets if their modules are present (they import their tools lazily)."""
    for name, mod, cls in (("rtl", "nhil.targets.rtl", "RtlTarget"), ("fpga", "nhil.targets.fpga", "FpgaTarget")):
        if name in _FACTORIES:
            continue
        try:
            m = __import__(mod, fromlist=[cls])
            _FACTORIES[name] = getattr(m, cls)
        except (ImportError, AttributeError):
            pass


def get_target(name: str, **options):
    """Build the target registered as ``name``.

    Raises:
        SetupError: unknown target name (lists the registered ones).
    """
    _builtin()
    _optional()
    if name not in _FACTORIES:
        raise SetupError(f"unknown target {name!r}; available: {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name](**options)
