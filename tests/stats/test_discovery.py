"""Discovery files (``kvrouter/stats/discovery.py``): live services listed, dead and bad files skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvrouter.stats.discovery import entries, pid_alive, publish, runtime_dir, withdraw


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_runtime_dir_prefers_xdg_runtime_dir(tmp_path: Path):
    assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "kvrouter"
    assert runtime_dir({}) == Path(f"/tmp/kvrouter-{os.getuid()}")
    assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == Path(f"/tmp/kvrouter-{os.getuid()}")


def test_live_services_are_listed_and_dead_or_bad_files_skipped(tmp_path: Path):
    directory = tmp_path / "kvrouter"
    directory.mkdir()
    dead = dead_pid()
    assert not pid_alive(dead)
    stale = {"pid": dead, "url": "http://x", "control": "kvrouter-1-ctl", "stats": "kvrouter-1-stats"}
    (directory / f"{dead}.json").write_text(json.dumps(stale))
    (directory / "garbage.json").write_text("{not json")
    (directory / "list.json").write_text("[1, 2]")
    (directory / "types.json").write_text(json.dumps({**stale, "pid": "1"}))
    (directory / "missing.json").write_text(json.dumps({"pid": os.getpid()}))
    assert entries(directory) == []  # nothing live, nothing raised

    path = publish(
        url="http://127.0.0.1:1",
        control="kvrouter-2-ctl",
        stats="kvrouter-2-stats",
        started_at=12.5,
        model_name="m",
        directory=directory,
    )
    assert path == directory / f"{os.getpid()}.json"
    (found,) = entries(directory)
    assert (found.pid, found.url, found.control, found.stats, found.started_at, found.model_name) == (
        os.getpid(),
        "http://127.0.0.1:1",
        "kvrouter-2-ctl",
        "kvrouter-2-stats",
        12.5,
        "m",
    )
    assert not (directory / f"{dead}.json").exists()  # a dead service's file goes when a live one publishes
    assert directory.stat().st_mode & 0o777 == 0o700  # others cannot read where our segments are
    withdraw(path)
    withdraw(path)  # twice is fine
    assert entries(directory) == []
    assert entries(tmp_path / "nowhere") == []
