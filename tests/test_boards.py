"""Boards file (nhil/boards.py): validation errors, the HELLO/INFO probe, --board on the fpga target."""

import subprocess
import sys
from pathlib import Path

import pytest

from nhil.boards import check_url, get_board, load_boards
from nhil.targets.fpga.probe import probe
from nhil.errors import SetupError


def _write(tmp_path, body: str) -> Path:
    p = tmp_path / "boards.yaml"
    p.write_text("schema: 1\nboards:\n" + body)
    return p


def test_a_valid_boards_file_loads_every_field(tmp_path):
    p = _write(tmp_path, "  - {name: vcu118-a, url: 'rfc2217://lab-host:4001', baud: 921600, device: fpga-small, node: lab-host}\n"
                         "  - {name: bench.b, url: /dev/ttyUSB0}\n")
    b = load_boards(p)
    assert list(b) == ["vcu118-a", "bench.b"]
    assert (b["vcu118-a"].url, b["vcu118-a"].baud, b["vcu118-a"].device, b["vcu118-a"].node) == ("rfc2217://lab-host:4001", 921600, "fpga-small", "lab-host")
    assert (b["bench.b"].baud, b["bench.b"].device, b["bench.b"].node) == (3_000_000, "fpga-small", None)
    assert load_boards(tmp_path / "absent.yaml") == {}


@pytest.mark.parametrize("url,msg", [
    ("rfc2217://lab-host", "needs host:port"),
    ("socket://lab-host:99999", "needs host:port with a port in 1..65535"),
    ("telnet://lab-host:23", "pyserial has no telnet:// handler"),
    ("ttyUSB0", "neither a device path"),
])
def test_bad_url_is_a_clear_error_naming_the_board(tmp_path, url, msg):
    p = _write(tmp_path, f"  - {{name: b1, url: '{url}'}}\n")
    with pytest.raises(SetupError, match=msg) as e:
        load_boards(p)
    assert f"{p}: board 0 (b1): url:" in str(e.value)


def test_unknown_preset_lists_the_presets(tmp_path):
    p = _write(tmp_path, "  - {name: b1, url: 'socket://127.0.0.1:4000', device: fpga-huge}\n")
    with pytest.raises(SetupError, match=r"board 0 \(b1\): device: unknown device preset 'fpga-huge'; presets: .*fpga-small"):
        load_boards(p)


def test_duplicate_names_are_refused(tmp_path):
    p = _write(tmp_path, "  - {name: b1, url: 'socket://127.0.0.1:4000'}\n  - {name: b2, url: 'loop://'}\n  - {name: b1, url: '/dev/ttyUSB1'}\n")
    with pytest.raises(SetupError, match=r"board name 'b1' appears twice \(boards 0 and 2\)"):
        load_boards(p)


def test_unknown_field_and_bad_name_and_missing_board(tmp_path):
    with pytest.raises(SetupError, match="colour: unknown field"):
        load_boards(_write(tmp_path, "  - {name: b1, url: 'loop://', colour: red}\n"))
    with pytest.raises(SetupError, match="may only hold letters"):
        load_boards(_write(tmp_path, "  - {name: 'b 1', url: 'loop://'}\n"))
    p = _write(tmp_path, "  - {name: b1, url: 'loop://'}\n")
    with pytest.raises(SetupError, match="no board named 'zz'.*boards: b1"):
        get_board("zz", p)
    assert check_url("COM3") == "COM3"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.fpga
def test_probe_reports_capabilities_of_a_live_board_and_link_fail_for_a_silent_one(tmp_path, monkeypatch):
    """An emulated board on TCP answers HELLO/INFO with its device; a port nobody listens
    on is LINK_FAIL for that board only; ``nhil boards`` shows both and exits 1."""
    port, dead = _free_port(), _free_port()
    emu = subprocess.Popen([sys.executable, "-m", "nhil.targets.fpga.cli", "--device", "fpga-small", "--tcp", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert emu.stdout.readline().strip() == f"socket://127.0.0.1:{port}"
        p = _write(tmp_path, f"  - {{name: live, url: 'socket://127.0.0.1:{port}', device: fpga-small}}\n  - {{name: silent, url: 'socket://127.0.0.1:{dead}'}}\n")
        boards = load_boards(p)
        live = probe(boards["live"])
        assert live["ok"] and live["outcome"] == "PASS"
        from nhil.isa.device import DEVICE_PRESETS

        assert live["capabilities"]["device"]["channels"] == DEVICE_PRESETS["fpga-small"].channels
        assert "MAC_AB" in live["capabilities"]["ops"] and "bf16" in live["capabilities"]["formats"]
        silent = probe(boards["silent"], open_timeout=1.0)
        assert not silent["ok"] and silent["outcome"] == "LINK_FAIL" and f"127.0.0.1:{dead}" in silent["error"]
        # the fpga target resolves --board / FPGA_BOARD through the same file
        from nhil.targets.fpga.target import FpgaTarget

        monkeypatch.setenv("NHIL_BOARDS", str(p))
        t = FpgaTarget(board="live")
        assert (t.port, t.device_name, t.baud) == (f"socket://127.0.0.1:{port}", "fpga-small", 3_000_000)
        cli = subprocess.run([sys.executable, "-m", "nhil.cli", "boards", "--file", str(p), "--timeout", "1"], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1
        lines = cli.stdout.splitlines()
        assert lines[0].startswith("live") and "OK (" in lines[0] and "ISA v" in lines[0]
        assert lines[1].startswith("silent") and "LINK_FAIL" in lines[1]
    finally:
        emu.terminate()
        emu.wait(10)


@pytest.mark.slow
@pytest.mark.fpga
def test_a_board_that_does_not_answer_is_link_fail_for_its_row(tmp_path, monkeypatch):
    """A manifest row on a silent board ends LINK_FAIL naming the board's URL, with a
    reproducer that names the board; nothing else is involved."""
    from nhil.sweep import run_one

    dead = _free_port()
    p = _write(tmp_path, f"  - {{name: silent, url: 'socket://127.0.0.1:{dead}', device: fpga-small}}\n")
    monkeypatch.setenv("NHIL_BOARDS", str(p))
    r = run_one({"model": "llama-tiny", "target": "fpga", "quant": "bf16", "tokens": 2, "board": "silent"}, 0, tmp_path / "out", timeout_s=600)
    assert r["outcome"] == "LINK_FAIL" and f"127.0.0.1:{dead}" in r["error"], (r["outcome"], r.get("error"))
    assert r["reproducer"].endswith("FPGA_BOARD=silent") and r["variant"] == "board=silent"
