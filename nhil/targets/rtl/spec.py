"""What the RTL device implements and how one is built: the opcodes and weight formats it decodes, the
bugs a build can inject, the ``BuildSpec`` of the simulation top for a device, and the devices it can build.

Sources: ``rtl_stubs/pim_wdec.sv`` / ``pim_fp_pkg::wfmt_fetch`` (formats), ``rtl_stubs/pim_sim_top.sv``
(parameters), ``docs/rtl-interface.md``.
"""

from __future__ import annotations

from nhil.errors import SetupError
from nhil.isa.device import DeviceConfig
from nhil.numerics.formats import FORMATS
from nhil.numerics.mac import LANES
from nhil.targets.base import DEVICE_OPS
from nhil.targets.rtl.build import RTL_DIR, SIM_SOURCES, SIM_TOP, BuildSpec

RTL_OPS = DEVICE_OPS  # every non-reserved ISA v0 device opcode
# Weight formats the RTL's MAC lanes decode (rtl_stubs/pim_wdec.sv, pim_fp_pkg::wfmt_fetch): every
# device format of nhil.numerics.formats.FORMATS, on devices with 16 MAC lanes (the formats' burst); bf16 on others.
# The pre-quantized checkpoint formats (formats.PREQUANT: int4 fp32-scale groups, FP8 block, nvfp4-gs) are not decoded.
RTL_FORMATS = frozenset({"bf16", *FORMATS})
INJECTED_BUGS = {"rne": "INJECT_RNE_BUG", "decode": "INJECT_DECODE_BUG", "channel1": "INJECT_CHANNEL_BUG"}


MAX_CHANNELS = 8  # pim_device: every channel's banks are one Verilator model; more is a slow, large build


def rtl_formats(d: DeviceConfig) -> frozenset[str]:
    """Weight formats the RTL implements for device ``d`` (quantized formats need ``lanes == 16``)."""
    return RTL_FORMATS if d.lanes == LANES else frozenset({"bf16"})


def bug_name(v) -> str | None:
    """Normalise an ``inject_bug`` option: None (no bug), ``"rne"`` (True, "1", "rne"), ``"decode"`` or ``"channel1"``.

    Raises:
        SetupError: an unknown bug name.
    """
    if isinstance(v, str):
        key = v.strip().lower()
        if key in INJECTED_BUGS:
            return key
        if not _flag(key):
            return None
        if key in ("1", "true", "yes", "on"):
            return "rne"
        raise SetupError(f"rtl: unknown inject_bug {v!r}; use one of {', '.join(INJECTED_BUGS)} (or 1 = rne)")
    return "rne" if v else None


def channel_spec(d: DeviceConfig, simulator: str = "verilator", waves: bool = False, inject_bug: bool | str | None = None) -> BuildSpec:
    """BuildSpec of the simulation top (``pim_sim_top``: ``pim_device`` of ``d.channels`` ``pim_channel``
    instances + datapath probe) for device ``d`` (``inject_bug``: see :func:`bug_name`)."""
    params = (("CHANNELS", d.channels), ("BANKS", d.banks), ("ROWS", d.rows), ("COLS", d.cols), ("LANES", d.lanes), ("ACCS", d.accumulators), ("GB_ELEMS", d.gb_elems))
    bug = bug_name(inject_bug)
    defines = ((INJECTED_BUGS[bug], "1"),) if bug else ()
    # Verilator: trace support is always compiled in (FST, or VCD without lz4 headers) and
    # switched on per run, so WAVES=1 never needs another build. Icarus: waves are a build option.
    build_waves = True if simulator == "verilator" else waves
    return BuildSpec(SIM_TOP, tuple(str(RTL_DIR / s) for s in SIM_SOURCES), params, defines, simulator, build_waves)


def _flag(v) -> bool:
    """Boolean option; strings from ``-O key=value`` ("0", "false", "no", "off", "") are false."""
    if isinstance(v, str):
        return v.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(v)


def _check_device(d: DeviceConfig) -> None:
    problems = []
    if not 1 <= d.channels <= MAX_CHANNELS:
        problems.append(f"channels={d.channels} (pim_device builds 1 to {MAX_CHANNELS} channels)")
    if d.lanes & (d.lanes - 1) or d.lanes < 8:
        problems.append(f"lanes={d.lanes} (a power of two >= 8)")
    if d.cols % d.lanes or d.gb_elems % d.lanes:
        problems.append("cols and gb_elems must be multiples of lanes")
    if d.banks < 2 or d.accumulators < 2:
        problems.append("banks and accumulators must be >= 2")
    if problems:
        raise SetupError(f"device {d.name} cannot be built as RTL: {'; '.join(problems)}")
