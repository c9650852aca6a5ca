"""Discovery files: how ``kvrouter top`` with no argument finds the ``kvrouter up`` running on this host.

Each running service writes one JSON file, ``<runtime dir>/<pid>.json``, once it serves, and removes it
on shutdown::

    {"pid": 4242, "url": "http://127.0.0.1:8490", "control": "kvrouter-4242-ctl",
     "stats": "kvrouter-4242-stats", "started_at": 1767000000.0, "model_name": "default"}

The runtime dir is ``$XDG_RUNTIME_DIR/kvrouter/`` (per user, tmpfs, cleared at logout) or, without
it, ``/tmp/kvrouter-<uid>/``, created mode 0700. A file whose pid is dead (a service killed with
SIGKILL removes nothing) is skipped by :func:`entries` and removed by the next service's
:func:`publish`; a file that does not parse is skipped too. The file is written to a temporary name and
renamed, so a reader never sees half of one.

Rejected: scanning ``/dev/shm`` for ``kvrouter-*-stats`` (finds segments, not URLs, and cannot tell a
service from a leftover without the owner lock dance of ``index/sweep.py``); a fixed well-known port
(two services on one host collide, and HTTP is what ``top`` avoids locally).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["DIR_NAME", "Discovered", "entries", "pid_alive", "publish", "runtime_dir", "withdraw"]

log = logging.getLogger(__name__)

DIR_NAME: Final = "kvrouter"


@dataclass(frozen=True, slots=True)
class Discovered:
    """One running ``kvrouter up`` as its discovery file names it."""

    pid: int
    url: str
    control: str
    """Its engine's control segment in ``/dev/shm``."""
    stats: str
    """Its front's stats segment in ``/dev/shm`` (``stats.py``)."""
    started_at: float
    model_name: str
    path: Path
    """The discovery file itself."""


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/kvrouter`` when the variable names a directory, else ``/tmp/kvrouter-<uid>``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / DIR_NAME
    return Path("/tmp") / f"{DIR_NAME}-{os.getuid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts: it is there)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse(path: Path) -> Discovered | None:
    try:
        raw: Any = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        pid, url, control, stats = raw["pid"], raw["url"], raw["control"], raw["stats"]
        if type(pid) is not int or not all(isinstance(v, str) for v in (url, control, stats)):
            raise ValueError("pid, url, control, stats of the wrong types")
        started = raw.get("started_at", 0.0)
        return Discovered(
            pid,
            url,
            control,
            stats,
            float(started) if isinstance(started, int | float) else 0.0,
            str(raw.get("model_name", "")),
            path,
        )
    except FileNotFoundError:  # withdrawn meanwhile
        return None
    except (OSError, ValueError, KeyError) as exc:
        log.debug("discovery file skipped path=%s error=%s", path, exc)
        return None


def entries(directory: Path | None = None) -> list[Discovered]:
    """The live services' discovery files, oldest service first; dead pids and bad files are skipped."""
    directory = runtime_dir() if directory is None else directory
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        entry = _parse(directory / name)
        if entry is not None and pid_alive(entry.pid):
            found.append(entry)
    found.sort(key=lambda e: (e.started_at, e.pid))
    return found


def publish(
    *, url: str, control: str, stats: str, started_at: float, model_name: str, directory: Path | None = None
) -> Path:
    """Write this process's discovery file (removing dead services' files first); returns its path.

    Raises:
        OSError: the runtime dir cannot be created or written, or belongs to another user.
    """
    directory = runtime_dir() if directory is None else directory
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid != os.getuid():  # /tmp is shared: never write into another user's dir
        raise PermissionError(f"discovery dir {directory} is not owned by uid {os.getuid()}")
    directory.chmod(0o700)
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            stem = name.removesuffix(".json")
            if name.endswith(".json") and stem.isdigit() and not pid_alive(int(stem)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)
                    log.info("discovery file of a dead service removed path=%s", directory / name)
    pid = os.getpid()
    path = directory / f"{pid}.json"
    body = {
        "pid": pid,
        "url": url,
        "control": control,
        "stats": stats,
        "started_at": started_at,
        "model_name": model_name,
    }
    temporary = directory / f".{pid}.json.tmp"
    try:
        temporary.write_text(json.dumps(body))
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return path


def withdraw(path: Path) -> None:
    """Remove a discovery file; one already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
