"""Progress of a long load onto the board: a rich bar on a terminal, else a line every 30 s."""

from __future__ import annotations

import sys
import time

NOTE_EVERY_S = 30.0  # seconds between progress lines when there is no bar
NOTE_ABOVE = 64 << 20  # images of more bytes get progress lines


class LoadProgress:
    """Show how much of a ``total``-byte image went to the board (a context manager).

    Args:
        total: image bytes of the load.
        show: a rich progress bar on stderr (``None``: when ``total`` exceeds 8 MiB and stderr is a tty).
            Without a bar, an image over ``NOTE_ABOVE`` bytes gets a line on stderr every ``NOTE_EVERY_S``.
        link: the session's counters (``Session.link``), whose retries and CRC errors the lines name.
    """

    def __init__(self, total: int, show: bool | None, link: dict) -> None:
        self.total = total
        self.show = show if show is not None else (total > (8 << 20) and sys.stderr.isatty())
        self.link = link
        self.done = 0
        self.t0 = time.monotonic()
        self._next_note = self.t0 + NOTE_EVERY_S
        self._bar = self._task = None

    def __enter__(self) -> "LoadProgress":
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

            self._bar = Progress(TextColumn("load → fpga"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("load", total=self.total)
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the image are on the board."""
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, advance=nbytes)
        elif self.total > NOTE_ABOVE and time.monotonic() > self._next_note:
            el = time.monotonic() - self.t0
            print(f"[nhil] load -> fpga: {self.done / 1e6:.0f} of {self.total / 1e6:.0f} MB in {el:.0f} s ({self.done / el / 1e3:.0f} kB/s of image; "
                  f"{self.link['retries']} retries, {self.link['crc_errors']} CRC errors)", file=sys.stderr, flush=True)
            self._next_note = time.monotonic() + NOTE_EVERY_S
