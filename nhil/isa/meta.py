"""Typed records of a program's metadata JSON (``docs/program-format.md``), parsed with pydantic.

``parse_meta(obj, source)`` checks every field's type and range before any of it is used, so a
``.pimb`` with a valid CRC (or a hand-edited ``.pims``) whose metadata has a wrong type or size
is a ``ProgramFormatError`` naming the field path (``bank_images.3.row: ...``), never an
AttributeError / TypeError / MemoryError traceback. Sizes are capped (:data:`MAX_ELEMS`) so a
lying size cannot make the loader or the runtime allocate gigabytes.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, model_validator

from nhil.errors import ProgramFormatError

MAX_ELEMS = 1 << 28  # largest host buffer / image (elements; 1 GiB of fp32)
MAX_DIM = 1 << 16  # largest device dimension (channels, banks, lanes, accumulators) a config may name
MAX_ROW_SET_BYTES = 16 << 20  # channels x banks x row_bytes: 16x the aim-like device (1 MiB)

Count = Annotated[StrictInt, Field(ge=0, le=MAX_ELEMS)]
Size = Annotated[StrictInt, Field(gt=0, le=MAX_ELEMS)]
Offset = Annotated[StrictInt, Field(ge=0, le=1 << 40)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceMeta(_Strict):
    """``nhil.isa.device.DeviceConfig`` fields."""

    name: StrictStr
    channels: Annotated[StrictInt, Field(gt=0, le=256)]
    banks: Annotated[StrictInt, Field(gt=0, le=256)]
    rows: Annotated[StrictInt, Field(gt=0, le=65536)]
    row_bytes: Annotated[StrictInt, Field(gt=0, le=1 << 20)]
    lanes: Annotated[StrictInt, Field(gt=0, le=MAX_DIM)]
    accumulators: Annotated[StrictInt, Field(gt=0, le=256)]
    gb_bytes: Annotated[StrictInt, Field(gt=0, le=1 << 20)]
    clock_hz: StrictFloat | StrictInt
    vectors: Annotated[StrictInt, Field(gt=0, le=255)] = 1  # prefill extension (absent = 1)

    @model_validator(mode="after")
    def _fits(self):
        cols = self.row_bytes // 2
        if self.row_bytes % 2 or cols % self.lanes or (self.gb_bytes // 2) % self.lanes or self.gb_bytes % 2:
            raise ValueError(f"row_bytes {self.row_bytes} and gb_bytes {self.gb_bytes} must hold whole bursts of {self.lanes} bf16 lanes")
        if self.channels * self.banks * self.row_bytes > MAX_ROW_SET_BYTES:
            raise ValueError(f"one row across {self.channels} channels x {self.banks} banks is {self.channels * self.banks * self.row_bytes} bytes, "
                             f"over the {MAX_ROW_SET_BYTES >> 20} MiB any nhil target models")
        if not (0 < float(self.clock_hz) < 1e12):
            raise ValueError(f"clock_hz {self.clock_hz} is not a clock rate in Hz")
        return self


class HostOpMeta(_Strict):
    kernel: StrictStr
    inputs: list[StrictStr]
    outputs: list[StrictStr]
    attrs: dict[StrictStr, Any]


class BankImageMeta(_Strict):
    row: Annotated[StrictInt, Field(ge=0, le=65535)]
    zero: StrictBool = False
    offset: Offset | None = None
    nbytes: Count | None = None
    slots: Count | None = None
    cols: Count | None = None


class HostImageMeta(_Strict):
    name: StrictStr
    shape: list[Count]
    offset: Offset
    nbytes: Count


class ProgramMeta(_Strict):
    """The whole metadata object."""

    device: DeviceMeta
    buffers: dict[StrictStr, Size]
    operands: list[tuple[StrictStr, Count, Size]]
    host_ops: list[HostOpMeta]
    bank_images: list[BankImageMeta]
    host_images: list[HostImageMeta]
    io: dict[StrictStr, dict[StrictStr, StrictStr]]
    info: dict[StrictStr, Any]


def parse_meta(obj: Any, source: str) -> dict:
    """Validate metadata ``obj`` (parsed JSON) and return it as plain dicts/lists (None fields dropped).

    Raises:
        ProgramFormatError: naming ``source``, the first bad field's path, what it holds and what it must be.
    """
    try:
        m = ProgramMeta.model_validate(obj)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        path = ".".join(str(p) for p in first["loc"]) or "<top level>"
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise ProgramFormatError(f"{source}: malformed metadata: {path}: {first['msg']} (got {first.get('input')!r:.60}){more}") from None
    for b in m.bank_images:
        if not b.zero and None in (b.offset, b.nbytes, b.slots, b.cols):
            raise ProgramFormatError(f"{source}: malformed metadata: bank image row {b.row} is not zero and lacks offset/nbytes/slots/cols")
    if sum(m.buffers.values()) > MAX_ELEMS:
        raise ProgramFormatError(f"{source}: malformed metadata: host buffers total {sum(m.buffers.values())} elements, over {MAX_ELEMS}")
    for h in m.host_images:
        n = 1
        for s in h.shape:
            n *= s
        if n > MAX_ELEMS:
            raise ProgramFormatError(f"{source}: malformed metadata: host image {h.name!r} of shape {h.shape} exceeds {MAX_ELEMS} elements")
    out = m.model_dump(exclude_none=True)
    out["operands"] = [list(o) for o in out["operands"]]
    return out
