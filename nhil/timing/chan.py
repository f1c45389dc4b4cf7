"""Controller state of a channel for the timing engine (``nhil.timing.engine``), and the device work between two barriers.

A :class:`Chan` holds the times the table's constraints refer to (per bank: last ACT/PRE/column
access; per channel: the activate window, the command bus, the global-buffer bursts and
accumulators last written/read). Channels that received the same commands share one object
(copy on write, ``nhil.timing.controller``); :meth:`Chan.key` folds times that can no longer
constrain anything so identical states merge again after a barrier.
"""

from __future__ import annotations

import dataclasses

from nhil.isa.device import DeviceConfig

NEG = -(1 << 40)


class Chan:
    """Controller state of one channel (or of several identical channels)."""

    __slots__ = ("nb", "bus", "open", "act_t", "pre_t", "rd_t", "wr_t", "rd_all", "acts", "col_t", "ext_t", "gb_w", "gb_r", "acc_w", "acc_mac", "acc_r", "floor", "done", "refs", "ref_t", "idle_from", "cmds", "busy", "last")

    def __init__(self, d: DeviceConfig, row_buffers: int = 1) -> None:
        self.nb = d.banks
        self.bus: set[int] = set()
        nv = d.banks * row_buffers  # one entry per (row buffer, bank): index buffer * banks + bank
        self.open = [-1] * nv
        self.act_t = [NEG] * nv
        self.pre_t = [NEG] * nv
        self.rd_t = [NEG] * nv
        self.wr_t = [NEG] * nv
        self.rd_all = NEG
        self.acts: list[int] = []
        self.col_t = NEG
        self.ext_t = NEG
        g = max(1, d.gb_elems // d.lanes) * d.vectors  # every burst of every global buffer (commands.Plan.g)
        self.gb_w = [NEG] * g
        self.gb_r = [NEG] * g
        na = d.accumulators * d.vectors  # every accumulator of every set (commands.acc_key)
        self.acc_w = [NEG] * na
        self.acc_mac = [NEG] * na
        self.acc_r = [NEG] * na
        self.floor = 0
        self.done = 0
        self.refs = 0
        self.ref_t = NEG
        self.idle_from: int | None = 0
        self.cmds: list | None = None
        self.busy = 0
        self.last = NEG  # issue cycle of the latest command (in-order controllers issue after it)

    def clone(self) -> "Chan":
        c = Chan.__new__(Chan)
        for s in Chan.__slots__:
            v = getattr(self, s)
            setattr(c, s, v.copy() if isinstance(v, (list, set)) else v)
        return c

    def key(self, horizon: int) -> tuple:
        """State after a barrier, with times that can no longer constrain anything (older than ``floor - horizon``) folded to NEG."""
        lim = self.floor - horizon

        def n(t):
            return t if t > lim else NEG

        return (
            tuple(self.open), tuple(map(n, self.act_t)), tuple(map(n, self.pre_t)), tuple(map(n, self.rd_t)), tuple(map(n, self.wr_t)), n(self.rd_all),
            tuple(map(n, self.acts[-4:])), n(self.col_t), n(self.ext_t), tuple(map(n, self.gb_w)), tuple(map(n, self.gb_r)),
            tuple(map(n, self.acc_w)), tuple(map(n, self.acc_mac)), tuple(map(n, self.acc_r)), self.floor, self.done, self.refs, n(self.ref_t), self.idle_from,
        )


@dataclasses.dataclass
class Segment:
    """Device work between two barriers (SYNC/HOST): a GEMV group, an attention phase, ..."""

    kind: str = "idle"  # gemv (weight MACs only), attn (KV-row MACs), other (no MAC), idle
    cycles: int = 0
    useful_bytes: int = 0  # bytes of real weight elements streamed by the MACs (padding excluded)
    bank_bursts: int = 0  # bank bursts of all MACs in the segment
    instrs: int = 0
