"""The lab's FPGA boards as configuration: ``boards.yaml`` (or ``$NHIL_BOARDS``).

Format (YAML, validated with pydantic when loaded)::

    schema: 1
    boards:
      - name: vcu118-a                  # [A-Za-z0-9_.-]+, unique
        url: rfc2217://lab-host:4001    # any pyserial URL: /dev/ttyUSB0, rfc2217://host:port, socket://host:port, loop://
        baud: 3000000                   # line rate (default 3 000 000)
        device: fpga-small              # the device preset the bitstream implements (nhil.isa.device.DEVICE_PRESETS)
        node: lab-host                  # the Ray node that owns the serial port (hostname; unset: any/local)

A manifest row with ``board: vcu118-a`` runs on that board (``FPGA_BOARD`` in its
``nhil verify``; ``nhil verify -t fpga --board vcu118-a`` by hand) and, in a Ray sweep,
only on the node offering ``fpga_board:vcu118-a`` (``ray start ... --resources
'{"fpga_board:vcu118-a": 1}'`` on that host), one row at a time. A board that does not
answer fails its own rows with LINK_FAIL and no others. ``nhil boards`` lists the boards
and probes each one (HELLO + INFO, the link protocol's session handshake,
``docs/link-protocol.md``; :func:`nhil.targets.fpga.probe.probe`) for the capabilities it claims.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from nhil.errors import SetupError

DEFAULT_PATH = Path("boards.yaml")
# pyserial's URL handlers (serial/urlhandler/protocol_*.py) plus plain device paths
URL_SCHEMES = {"rfc2217": True, "socket": True, "loop": False, "spy": False, "hwgrep": False, "alt": False, "cp2110": False}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def boards_path() -> Path:
    """``$NHIL_BOARDS`` or ``boards.yaml`` in the working directory."""
    return Path(os.environ.get("NHIL_BOARDS") or DEFAULT_PATH)


def check_url(url: str) -> str:
    """Validate a pyserial URL: a device path (``/dev/ttyUSB0``, ``COM3``) or
    ``scheme://...`` with a scheme pyserial handles; ``rfc2217://`` and ``socket://`` need
    ``host:port`` with a port in 1..65535.

    Raises:
        ValueError: the URL cannot work, saying what a valid one looks like.
    """
    url = str(url).strip()
    if not url:
        raise ValueError("empty url; give a pyserial URL such as /dev/ttyUSB0 or rfc2217://lab-host:4001")
    if "://" not in url:
        if url.startswith("/") or re.fullmatch(r"COM\d+", url):
            return url
        raise ValueError(f"{url!r} is neither a device path (/dev/ttyUSB0, COM3) nor a pyserial URL (rfc2217://host:port, socket://host:port, loop://)")
    scheme = url.split("://", 1)[0]
    if scheme not in URL_SCHEMES:
        raise ValueError(f"{url!r}: pyserial has no {scheme}:// handler; use one of {', '.join(s + '://' for s in URL_SCHEMES)} or a device path")
    if URL_SCHEMES[scheme]:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or not 1 <= port <= 65535:
            raise ValueError(f"{url!r}: {scheme}:// needs host:port with a port in 1..65535, e.g. {scheme}://lab-host:4001")
    return url


class Board(BaseModel):
    """One board of the boards file (see the module docstring for each field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    url: str
    baud: int = 3_000_000
    device: str = "fpga-small"
    node: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"board name {v!r} may only hold letters, digits, '_', '.', '-' (it becomes the Ray resource fpga_board:<name>)")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_url(v)

    @field_validator("baud")
    @classmethod
    def _baud(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"baud must be a positive line rate in bit/s, got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        from nhil.isa.device import DEVICE_PRESETS

        if v not in DEVICE_PRESETS:
            raise ValueError(f"unknown device preset {v!r}; presets: {', '.join(DEVICE_PRESETS)}")
        return v


def _explain(e: ValidationError) -> str:
    msgs = []
    for err in e.errors():
        field = ".".join(str(x) for x in err.get("loc", ())) or "entry"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field (fields: {', '.join(Board.model_fields)})"
        msgs.append(f"{field}: {msg}")
    return "; ".join(msgs)


def load_boards(path: Path | None = None) -> dict[str, Board]:
    """Boards of the boards file by name ({} if the file does not exist).

    Raises:
        SetupError: not valid YAML, not a ``boards:`` list, a board with a bad URL, an
            unknown device preset, a bad name/baud or an unknown field, or two boards with
            one name; the message names the file, the board and the fix.
    """
    import yaml

    path = Path(path) if path is not None else boards_path()
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SetupError(f"{path} is not valid YAML: {e}") from None
    entries = data.get("boards") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise SetupError(f"{path}: expected `boards:` with a list of boards (name, url, baud, device, node); see nhil/boards.py")
    out: dict[str, Board] = {}
    for i, e in enumerate(entries):
        label = f"board {i}" + (f" ({e.get('name')})" if isinstance(e, dict) and e.get("name") else "")
        if not isinstance(e, dict):
            raise SetupError(f"{path}: {label} is not a mapping of name, url, baud, device, node: {e!r}")
        try:
            b = Board(**e)
        except ValidationError as err:
            raise SetupError(f"{path}: {label}: {_explain(err)}") from None
        if b.name in out:
            raise SetupError(f"{path}: board name {b.name!r} appears twice (boards {list(out).index(b.name)} and {i}); each board needs its own name")
        out[b.name] = b
    return out


def get_board(name: str, path: Path | None = None) -> Board:
    """The board called ``name``.

    Raises:
        SetupError: no boards file, or no board of that name (lists the known ones).
    """
    boards = load_boards(path)
    if name not in boards:
        where = Path(path or boards_path())
        known = ", ".join(boards) if boards else f"none ({where} {'has no boards' if where.exists() else 'does not exist'})"
        raise SetupError(f"no board named {name!r} in {where}; boards: {known}")
    return boards[name]
