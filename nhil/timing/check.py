"""Legality checker: does a timed command stream obey the timing table?

Independent of the engine (it re-derives bank state from the commands alone), so it can
judge streams from the engine, from hand-made tests, and later from RTL monitors or FPGA
trace buffers. Rules, per channel (all times in command-clock cycles):

* command bus: at most one command per cycle;
* bank state: ``ACT`` needs the bank precharged (else *missing precharge*); a column
  command needs its row open; ``REF`` needs every bank precharged;
* ``ACT``->column >= nRCDRDMAC (MAC), nRCDRD (RD), nRCDWR (WR), nRCDRDCP, nRCDWRCP;
  ``ACT``->``PRE`` >= nRAS; ``PRE``->``ACT`` >= nRP; ``ACT``->``ACT`` same bank >= nRC;
  ``ACT``->``ACT`` >= nRRD; at most 4 ``ACT`` in any nFAW window;
* bank-side column commands (MAC, RD, WR, RDCP, WRCP) >= nCCD apart; external-bus
  bursts (WRGB, WRACC, RDACC, RD, WR) >= nBL apart;
* read-type column -> ``PRE`` >= nRTP; write-type -> ``PRE`` >= nCWL + nBL + nWR;
* ``PRE``->``REF`` >= nRP; ``REF``->``ACT`` >= nRFC; ``REF``->``REF`` >= nRFC;
  refreshes owed (``floor(t / nREFI)`` minus issued) never exceed ``max_ref_slack``;
* pipeline: ``WRGB``(col c)->``MAC``(col c) >= nCWLGB; ``MAC``(acc k)->``RDACC``(k) >= nMACLAT.
"""

from __future__ import annotations

from collections import defaultdict

from nhil.errors import NhilError
from nhil.isa.device import DeviceConfig
from nhil.timing.commands import ACT, ALL, BANK_COLUMN, EW, EXT_BUS, KINDS, MAC, PRE, RD, RDACC, RDCP, READS, REF, WR, WRCP, WRGB, WRITES, Cmd
from nhil.timing.table import TimingTable

NEG = -(1 << 40)


class TimingViolation(NhilError):
    """A command stream breaks the timing table (message names the rule, command and cycles)."""


def _fmt(c: Cmd) -> str:
    b = "all" if c.bank == ALL else c.bank
    return f"{c.kind}(ch{c.ch} bank {b} row {c.row} col {c.col}) at cycle {c.t} [instr {c.instr}]"


def check_stream(cmds: list[Cmd], d: DeviceConfig, T: TimingTable, raise_first: bool = True) -> list[str]:
    """Check ``cmds`` (any order; sorted per channel by time here) against ``T``.

    Returns:
        The list of violations (empty if legal).
    Raises:
        TimingViolation: on the first violation when ``raise_first``.
    """
    errs: list[str] = []

    def bad(c: Cmd, msg: str) -> None:
        e = f"{_fmt(c)}: {msg}"
        if raise_first:
            raise TimingViolation(e)
        errs.append(e)

    per_ch: dict[int, list[Cmd]] = defaultdict(list)
    for c in cmds:
        if c.kind not in KINDS:
            raise TimingViolation(f"unknown command kind {c.kind!r}")
        per_ch[c.ch].append(c)
    rcd = {MAC: ("nRCDRDMAC", T.nRCDRDMAC), RD: ("nRCDRD", T.nRCDRD), WR: ("nRCDWR", T.nRCDWR), RDCP: ("nRCDRDCP", T.nRCDRDCP), WRCP: ("nRCDWRCP", T.nRCDWRCP)}
    for ch, lst in per_ch.items():
        if not 0 <= ch < d.channels:
            raise TimingViolation(f"command on channel {ch}, device has {d.channels}")
        lst.sort(key=lambda c: c.t)
        nb = d.banks
        open_row = [-1] * nb
        act_t = [NEG] * nb
        pre_t = [NEG] * nb
        rd_t = [NEG] * nb
        wr_t = [NEG] * nb
        acts: list[int] = []
        last_t = None
        col_t = NEG
        ext_t = NEG
        ref_t = NEG
        refs = 0
        gb_w: dict[int, int] = {}
        acc_mac: dict[int, int] = {}
        for c in lst:
            t = c.t
            if last_t == t:
                bad(c, "two commands in one cycle on the command bus")
            last_t = t
            owed = t // T.nREFI - refs
            if owed > T.max_ref_slack:
                bad(c, f"{owed} refreshes owed (> {T.max_ref_slack} may be postponed; nREFI={T.nREFI})")
            banks = range(nb) if c.bank == ALL else (c.bank,)
            if c.bank != ALL and not 0 <= c.bank < nb:
                bad(c, f"bank {c.bank} outside the {nb} banks")
                continue
            k = c.kind
            if k == ACT:
                for b in banks:
                    if open_row[b] != -1:
                        bad(c, f"missing precharge: bank {b} still has row {open_row[b]} open")
                    if t - pre_t[b] < T.nRP:
                        bad(c, f"nRP: PRE at {pre_t[b]} is {t - pre_t[b]} < {T.nRP} cycles before")
                    if t - act_t[b] < T.nRC:
                        bad(c, f"nRC: previous ACT of bank {b} at {act_t[b]} is {t - act_t[b]} < {T.nRC} cycles before")
                if t - ref_t < T.nRFC:
                    bad(c, f"nRFC: REF at {ref_t} is {t - ref_t} < {T.nRFC} cycles before")
                if acts and t - acts[-1] < T.nRRD:
                    bad(c, f"nRRD: previous ACT at {acts[-1]} is {t - acts[-1]} < {T.nRRD} cycles before")
                if len(acts) >= 4 and t - acts[-4] < T.nFAW:
                    bad(c, f"nFAW: a fifth ACT within {t - acts[-4]} < {T.nFAW} cycles (window from {acts[-4]})")
                acts.append(t)
                for b in banks:
                    open_row[b] = c.row
                    act_t[b] = t
            elif k == PRE:
                for b in banks:
                    if open_row[b] == -1:
                        continue  # precharging a closed bank is a no-op
                    if t - act_t[b] < T.nRAS:
                        bad(c, f"nRAS: bank {b} activated at {act_t[b]}, only {t - act_t[b]} < {T.nRAS} cycles before")
                    if t - rd_t[b] < T.nRTP:
                        bad(c, f"nRTP: read/MAC on bank {b} at {rd_t[b]} is {t - rd_t[b]} < {T.nRTP} cycles before")
                    wrl = T.nCWL + T.nBL + T.nWR
                    if t - wr_t[b] < wrl:
                        bad(c, f"write recovery: write on bank {b} at {wr_t[b]} is {t - wr_t[b]} < {wrl} cycles before")
                for b in banks:
                    open_row[b] = -1
                    pre_t[b] = t
            elif k == REF:
                for b in range(nb):
                    if open_row[b] != -1:
                        bad(c, f"REF with bank {b} open (row {open_row[b]}): missing precharge")
                    if t - pre_t[b] < T.nRP:
                        bad(c, f"nRP before REF: PRE at {pre_t[b]}")
                if t - ref_t < T.nRFC:
                    bad(c, f"nRFC: previous REF at {ref_t}")
                ref_t = t
                refs += 1
            else:
                if k in BANK_COLUMN:
                    name, need = rcd[k]
                    for b in banks:
                        if open_row[b] != c.row:
                            what = "closed" if open_row[b] == -1 else f"open on row {open_row[b]}"
                            bad(c, f"column command to bank {b} whose row {c.row} is not open ({what})")
                        elif t - act_t[b] < need:
                            bad(c, f"too-early column command: {name}: ACT at {act_t[b]} is {t - act_t[b]} < {need} cycles before")
                    if t - col_t < T.nCCD:
                        bad(c, f"nCCD: previous column command at {col_t} is {t - col_t} < {T.nCCD} cycles before")
                    col_t = t
                    for b in banks:
                        if k in READS:
                            rd_t[b] = t
                        if k in WRITES:
                            wr_t[b] = t
                if k in EXT_BUS:
                    if t - ext_t < T.nBL:
                        bad(c, f"nBL: external bus busy until {ext_t + T.nBL}")
                    ext_t = t
                if k == WRGB:
                    gb_w[c.col] = t
                if k == MAC:
                    w = gb_w.get(c.col)
                    if w is not None and t - w < T.nCWLGB:
                        bad(c, f"nCWLGB: GB burst {c.col} written at {w}")
                    acc_mac[c.k] = t
                if k == EW:  # elementwise op on accumulators c.k and c.col: after their MACs, result nEW later
                    for a in {c.k, c.col}:
                        m = acc_mac.get(a)
                        if m is not None and t - m < T.nMACLAT:
                            bad(c, f"nMACLAT: last MAC / EW on accumulator {a} at {m} is {t - m} < {T.nMACLAT} cycles before")
                    acc_mac[c.k] = t + T.nEW - T.nMACLAT
                if k == RDACC:
                    m = acc_mac.get(c.k)
                    if m is not None and t - m < T.nMACLAT:
                        bad(c, f"nMACLAT: last MAC on accumulator {c.k} at {m} is {t - m} < {T.nMACLAT} cycles before")
        if lst:
            t_end = lst[-1].t
            owed = t_end // T.nREFI - refs
            if owed > T.max_ref_slack:
                bad(lst[-1], f"{owed} refreshes owed at the end of the stream")
    return errs
