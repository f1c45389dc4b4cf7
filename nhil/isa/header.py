"""The fixed 24-byte ``.pimb`` header and the section layout, checked before a file is read whole.

Layout in ``docs/program-format.md`` and ``nhil/isa/program.py``: magic ``NHILPIMB``, container
version (u16), ISA version (u16), reserved (u32, must be 0), metadata length (u64), then the
metadata, the instruction count and words, the blob length and bytes, and a CRC-32.
"""

from __future__ import annotations

import struct

from nhil.errors import ProgramFormatError
from nhil.isa.instr import WORD_BYTES

MAGIC = b"NHILPIMB"
CONTAINER_VERSION = 1
ISA_VERSION = 0
_HEAD = struct.Struct("<8sHHIQ")
_U64 = struct.Struct("<Q")
MAX_META_BYTES = 64 << 20
MAX_PROGRAM_BYTES = 64 << 30  # larger files are refused before their body is read


def check_head(head: bytes, size: int, source: str) -> None:
    """Refuse a file from its 24-byte header and its size alone (magic, versions, reserved
    field, metadata length within the file), so a huge or foreign file is never read whole.

    Raises:
        ProgramFormatError: naming ``source`` and the field.
    """
    if len(head) < _HEAD.size or size < _HEAD.size + 12:
        raise ProgramFormatError(f"{source}: {size} bytes is too short to be a .pimb program (truncated?)")
    magic, cver, isa, rsv, mlen = _HEAD.unpack(head)
    if magic != MAGIC:
        raise ProgramFormatError(f"{source}: not a .pimb program (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if cver != CONTAINER_VERSION:
        raise ProgramFormatError(f"{source}: container version {cver}, this nhil reads version {CONTAINER_VERSION}; recompile with `nhil compile`")
    if isa != ISA_VERSION:
        raise ProgramFormatError(f"{source}: program is for ISA v{isa}, this nhil implements ISA v{ISA_VERSION}")
    if rsv != 0:
        raise ProgramFormatError(f"{source}: reserved header field is 0x{rsv:08x}, must be 0 (docs/program-format.md)")
    if mlen > MAX_META_BYTES or _HEAD.size + mlen + 8 + 8 + 4 > size:
        raise ProgramFormatError(f"{source}: metadata length {mlen} does not fit the {size}-byte file (truncated or corrupt)")
    if size > MAX_PROGRAM_BYTES:
        raise ProgramFormatError(f"{source}: {size} bytes exceeds the {MAX_PROGRAM_BYTES >> 30} GiB program limit")


def check_layout(f, mlen: int, size: int, source: str) -> None:
    """Seek past the metadata and the instructions, reading only the two counts, and check the
    section lengths add up to the file size (a file that cannot be a program is never read whole).

    Raises:
        ProgramFormatError: the counts run past the end of the file or leave bytes over.
    """
    pos = _HEAD.size + mlen
    f.seek(pos)
    (n,) = _U64.unpack(f.read(8))
    if pos + 8 + n * WORD_BYTES + 8 + 4 > size:
        raise ProgramFormatError(f"{source}: {n} instructions run past the end of the {size}-byte file (truncated?)")
    f.seek(pos + 8 + n * WORD_BYTES)
    (blob_len,) = _U64.unpack(f.read(8))
    if pos + 8 + n * WORD_BYTES + 8 + blob_len + 4 != size:
        raise ProgramFormatError(f"{source}: blob length {blob_len} does not match the {size}-byte file (truncated or corrupt)")
