from __future__ import annotations

from pathlib import Path

from tools.sim.imex.daemon_log import DaemonLog


def test_log_rotates_into_numbered_files_and_keeps_the_newest_lines(tmp_path: Path):
    path = tmp_path / "nvidia-imex.log"
    log = DaemonLog(str(path), level=4, append=True, max_bytes=400, rotate_count=2)
    for i in range(40):
        log.write("INFO", f"line {i:02d}")
    log.write("ERROR", "last words")
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "nvidia-imex.log",
        "nvidia-imex.log.1",
        "nvidia-imex.log.2",
    ]
    assert "[ERROR]" in path.read_text() and path.read_text().rstrip().endswith("last words")
    assert "line 00" not in (path.read_text() + (tmp_path / "nvidia-imex.log.1").read_text())


def test_log_level_filters_and_no_rotation_stops_logging(tmp_path: Path):
    path = tmp_path / "imex.log"
    log = DaemonLog(str(path), level=2, append=False, max_bytes=200, rotate_count=0)
    log.write("INFO", "not shown")
    for _ in range(10):
        log.write("ERROR", "shown until the size limit")
    log.close()
    text = path.read_text()
    assert "not shown" not in text
    assert 0 < text.count("shown until the size limit") < 10
    assert [p.name for p in tmp_path.iterdir()] == ["imex.log"]


def test_unwritable_log_file_falls_back_to_stderr(tmp_path: Path, capsys):
    log = DaemonLog(
        str(tmp_path / "missing-dir" / "imex.log"), level=4, append=True, max_bytes=1 << 20, rotate_count=1
    )
    assert "cannot open log file" in log.open_error
    log.write("INFO", "to stderr")
    assert "to stderr" in capsys.readouterr().err
