"""Channel-controller mechanics of the timing engine (``nhil.timing.engine``): shared channel
states, the command bus, refresh, and the row commands (ACT / PRE, row-buffer choice).

:class:`ChannelController` is the engine's base class; it expects the engine's attributes
``d`` (device), ``t`` (timing table), ``st`` (channel -> :class:`~nhil.timing.chan.Chan`),
``_refcount``, ``_groups``, ``inorder``, ``nbuf``, ``record``, ``horizon`` and ``stats``.
"""

from __future__ import annotations

from nhil.isa.instr import Instr, Op
from nhil.timing.chan import Chan
from nhil.timing.commands import ACT, ALL, PRE, REF, Cmd


class ChannelController:
    """Channel groups (copy on write), command-bus slots, refresh and row commands of :class:`~nhil.timing.engine.TimingEngine`."""

    # ------------------------------------------------------------------ helpers
    def _all_groups(self) -> list[tuple[Chan, list[int]]]:
        if self._groups is None:
            self._groups = self._unique(range(self.d.channels))
        return self._groups

    def _unique(self, chans) -> list[tuple[Chan, list[int]]]:
        seen: dict[int, tuple[Chan, list[int]]] = {}
        for c in chans:
            s = self.st[c]
            e = seen.get(id(s))
            if e is None:
                seen[id(s)] = (s, [c])
            else:
                e[1].append(c)
        return list(seen.values())

    def _own(self, ch: int) -> Chan:
        s = self.st[ch]
        if self._refcount.get(id(s), 1) > 1:
            self._groups = None
            self._refcount[id(s)] -= 1
            s = s.clone()
            self.st[ch] = s
            self._refcount[id(s)] = 1
        return s

    def _split_by(self, f) -> None:
        """Split channel groups whose members would get different commands (``f(channel)`` differs)."""
        for s, chans in list(self._all_groups()):
            parts: dict = {}
            for c in chans:
                parts.setdefault(f(c), []).append(c)
            if len(parts) == 1:
                continue
            self._groups = None
            for i, part in enumerate(parts.values()):
                if i == 0:
                    self._refcount[id(s)] = len(part)
                    continue
                n = s.clone()
                self._refcount[id(n)] = len(part)
                for c in part:
                    self.st[c] = n

    def _slot(self, s: Chan, t: int) -> int:
        if self.inorder and t <= s.last:
            t = s.last + 1
        bus = s.bus
        while t in bus:
            t += 1
        bus.add(t)
        if t > s.last:
            s.last = t
        return t

    def _emit(self, s: Chan, t: int, kind: str, bank=ALL, row=-1, col=-1, k=-1, idx=-1, chans=None) -> None:
        if s.cmds is not None:
            s.cmds.append(Cmd(t, chans[0] if chans else -1, kind, bank, row, col, k, idx))

    # ------------------------------------------------------------------ refresh
    def _ref_owed(self, s: Chan, t: int) -> int:
        return t // self.t.nREFI - s.refs

    def _issue_ref(self, s: Chan, t: int, idx: int, chans) -> int:
        T = self.t
        for u in range(self.nbuf):
            if any(o != -1 for o in s.open[u * s.nb : (u + 1) * s.nb]):
                t = self._pre(s, ALL, t, idx, chans, u * s.nb)
        t = max(t, max(s.pre_t) + T.nRP, max(s.act_t) + T.nRC, s.ref_t + T.nRFC, s.floor)
        t = self._slot(s, t)
        s.ref_t = t
        s.refs += 1
        self.stats.refs += len(chans) if chans else 1
        self._emit(s, t, REF, idx=-1, chans=chans)
        s.done = max(s.done, t + T.nRFC)
        return t

    def _idle_refresh(self, s: Chan, chans) -> None:
        """Fill the idle gap before a barrier with refreshes (pull-in up to the slack)."""
        T = self.t
        if s.idle_from is None:
            return
        t0, end = s.idle_from, s.floor
        s.idle_from = None
        while True:
            owed = self._ref_owed(s, end)
            if owed <= -T.max_ref_slack:
                return
            need_pre = any(o != -1 for o in s.open)
            start = max(t0, s.ref_t + T.nRFC, max(s.act_t) + (T.nRAS if need_pre else T.nRC))
            if start + (T.nRP + 1 if need_pre else 0) + T.nRFC > end:
                return
            saved_floor = s.floor
            s.floor = start
            self._issue_ref(s, start, -1, chans)
            s.floor = saved_floor
            t0 = s.ref_t + 1

    # ------------------------------------------------------------------ row commands
    def _pre(self, s: Chan, bank: int, t0: int, idx: int, chans, base: int = 0) -> int:
        T = self.t
        banks = range(base, base + s.nb) if bank == ALL else (base + bank,)
        t = t0
        for b in banks:
            if s.open[b] != -1:
                t = max(t, s.act_t[b] + T.nRAS, max(s.rd_t[b], s.rd_all) + T.nRTP, s.wr_t[b] + T.nCWL + T.nBL + T.nWR)
        t = self._slot(s, max(t, s.floor))
        for b in banks:
            s.pre_t[b] = t
            s.open[b] = -1
        self._emit(s, t, PRE, bank, idx=idx, chans=chans)
        return t

    def _act(self, s: Chan, bank: int, row: int, t0: int, idx: int, chans, base: int = 0) -> int:
        T = self.t
        banks = range(base, base + s.nb) if bank == ALL else (base + bank,)
        while True:  # refresh first while max_ref_slack are owed at the ACT's cycle
            t = max(t0, s.floor, s.ref_t + T.nRFC)
            for b in banks:
                t = max(t, s.pre_t[b] + T.nRP, s.act_t[b] + T.nRC)
            if s.acts:
                t = max(t, s.acts[-1] + T.nRRD)
                if len(s.acts) >= 4:
                    t = max(t, s.acts[-4] + T.nFAW)
            if self._ref_owed(s, t) < T.max_ref_slack:
                break
            self._issue_ref(s, max(t0, s.floor), idx, chans)
        t = self._slot(s, t)
        for b in banks:
            s.act_t[b] = t
            s.open[b] = row
        s.acts.append(t)
        if len(s.acts) > 8:
            del s.acts[:4]
        self.stats.acts += len(chans)
        self._emit(s, t, ACT, bank, row, idx=idx, chans=chans)
        return t

    def _buffer(self, s: Chan, ins: Instr) -> int:
        """Row buffer an instruction's row uses (``row_buffers`` > 1): the one holding the row open, else the least recently activated."""
        nb = s.nb
        if ins.op is Op.MAC_AB or ins.op is Op.WR_ABK:
            sel = range(nb)
        elif ins.op in (Op.MAC_SB, Op.WR_SBK, Op.RD_SBK, Op.COPY_BK_GB, Op.COPY_GB_BK):
            sel = (ins.bank,)
        else:
            return 0
        for u in range(self.nbuf):
            if all(s.open[u * nb + b] == ins.row for b in sel):
                return u
        return min(range(self.nbuf), key=lambda u: (max(s.act_t[u * nb + b] for b in sel), u))

    def _merge(self) -> None:
        if self.record:
            return
        uniq = self._all_groups()
        if len(uniq) == 1:
            return
        self._groups = None
        by_key: dict[tuple, Chan] = {}
        for s, chans in uniq:
            kk = s.key(self.horizon)
            keep = by_key.setdefault(kk, s)
            if keep is not s:
                for c in chans:
                    self.st[c] = keep
                self._refcount[id(keep)] = self._refcount.get(id(keep), 0) + len(chans)
                self._refcount.pop(id(s), None)
