"""The FPGA link's errors: one hierarchy under :class:`nhil.errors.LinkError` (run outcome ``LINK_FAIL``).

Every layer of the host side raises one of these for a link problem, so a caller catches
``LinkError`` and ``verify`` reports ``LINK_FAIL`` whichever layer gave up
(``docs/outcomes.md``); the subclass says which kind of failure it was:

====================  =============================================================================
class                 raised when
====================  =============================================================================
TransportError        the port cannot be opened, read or written (``transport.py``), the emulator
                      process does not start (``launch.py``), the session is not open
LinkTimeout           no valid answer in time: no HELLO reply within ``open_timeout``, or every
                      attempt of a request ended in a timeout (``session.py``)
RetriesExhausted      the board answered, but every attempt came back NAKed or damaged, bursts of
                      short frames made no progress, or a message / reply failed its CRC 3 times
ProtocolViolation     a reply that does not parse or is not the one the request calls for
VersionMismatch       the board speaks another link protocol or ISA version (a ProtocolViolation)
BoardError            the board refused a request with ``ERROR`` (``code``: the ``E_*`` number), or
                      lost a message / reply mid-transfer
ReplayRefused         the board refused a request as a replay (``E_REPLAY``, a BoardError)
BoardReset            the board's session nonce changed or it answered ``E_SESSION``: the device
                      state is gone and the session stays dead (never retried)
====================  =============================================================================

A refusal that is the program's fault (``E_RUN``, ``E_ADDRESS``, ``E_BAD_INSTR``) is a
:class:`nhil.errors.RunError` (``RUN_FAIL``), not a link error.
"""

from __future__ import annotations

from nhil.errors import LinkError


class TransportError(LinkError):
    """The port (serial device, pty, socket, in-memory pair) cannot be opened, read or written."""


class LinkTimeout(LinkError):
    """The board gave no valid answer in time (HELLO, or every attempt of one request)."""


class RetriesExhausted(LinkError):
    """The board answered, but no attempt got through: NAKs, damaged replies, stalled bursts, CRC mismatches."""


class ProtocolViolation(LinkError):
    """A reply that does not parse, or of another type or size than its request calls for."""


class VersionMismatch(ProtocolViolation):
    """The board speaks another link protocol or ISA version than this nhil."""


class BoardError(LinkError):
    """The board refused a request with ``ERROR code message`` (``code``: ``protocol.E_*``), or dropped what a
    transfer needed (a short-frame status GONE, which carries no code: ``code`` is ``None``)."""

    def __init__(self, msg: str, code: int | None = None) -> None:
        super().__init__(msg)
        self.code = code


class ReplayRefused(BoardError):
    """The board refused a request as a replay of one it executed before (``E_REPLAY``, section 3)."""


class BoardReset(LinkError):
    """The board was reset mid-session (new session nonce, or ``E_SESSION``): its state is lost."""


__all__ = ["LinkError", "TransportError", "LinkTimeout", "RetriesExhausted", "ProtocolViolation", "VersionMismatch", "BoardError", "ReplayRefused",
           "BoardReset"]
