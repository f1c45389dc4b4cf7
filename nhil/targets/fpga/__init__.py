"""``fpga`` target: the FPGA prototype over a serial link, plus a board emulator (``docs/link-protocol.md``).

* ``frame``: SLIP-style framing + CRC-32 codec; ``protocol``: message types and payloads;
* ``fragment``: message reassembly and the buffered reply (device side) for noisy lines;
* ``stream``: short frames (headerless bulk data, bitmap queries, streamed reply cells, pings);
* host side, in layers: ``transport`` (the only code that touches a port: pyserial URL or an
  in-memory pair), ``session`` + ``bulk`` (HELLO, ARQ, timeouts, counters, replay guard; bursts of
  short frames), ``target``: :class:`FpgaTarget` (load / reload / execute / rows); ``errors``: the
  link errors (all ``LinkError``); ``launch``: starts the emulator when no port is given;
  ``progress``: the load progress bar; ``probe``: HELLO + INFO with a lab board;
* ``emulator``: the device side (``Board``) executing with the functional simulator (or RTL);
* ``faults``: fault injection; ``cli``: ``nhil fpga-emu``; ``bench``: :func:`link_benchmark`.
"""

from nhil.targets.fpga.target import FpgaTarget


def link_benchmark(nbytes: int = 64 << 20, **kw) -> dict:
    """See :func:`nhil.targets.fpga.bench.link_benchmark`."""
    from nhil.targets.fpga.bench import link_benchmark as _lb

    return _lb(nbytes, **kw)


__all__ = ["FpgaTarget", "link_benchmark"]
