"""Command-level timing model of the PIM device (``docs/timing-model.md``).

* ``table``: timing tables per device preset (AiM-like figures), peak bandwidths, formulas.
* ``commands``: L2 device commands and the deterministic ISA v0 -> command unroller.
* ``engine``: schedules the commands against the table; cycles per instruction kind / layer.
* ``check``: the legality checker (rejects streams that violate the table).
* ``report``: bandwidths, timing-bound best, tokens/s and rooflines of a program.
"""

from nhil.timing.check import TimingViolation, check_stream
from nhil.timing.commands import ALL, Cmd, unroll_instr
from nhil.timing.engine import TimingEngine, TimingStats
from nhil.timing.report import analyze
from nhil.timing.table import TIMING_PRESETS, TimingTable, peak_external_gbs, peak_internal_gbs, timing_for

__all__ = ["ALL", "Cmd", "TIMING_PRESETS", "TimingEngine", "TimingStats", "TimingTable", "TimingViolation", "analyze", "check_stream", "peak_external_gbs", "peak_internal_gbs", "timing_for", "unroll_instr"]
