"""Finding and removing what dead engines left behind, and the owner lock that tells the dead from the live.

Every name an engine makes carries its owner's pid: ``/dev/shm/kvrouter-<pid>-ctl`` (and its service's
``kvrouter-<pid>-stats`` and ``kvrouter-<pid>-fronts``), the shard segments ``kvrouter-<pid>-s<k>-e<epoch>``, the fences
``kvrouter-<pid>-s<k>.lock``, and the temporary directory ``kvrouter-<pid>-XXXXXXXX`` of its ``ipc://``
sockets. An engine killed with its whole process group (the OOM killer) removes none of them, and a
restart that gets the same pid used to find its own control segment taken. So an engine sweeps before it
starts, and to know whose files are whose it holds an *owner lock*, ``flock`` on
``/dev/shm/kvrouter-<pid>-owner.lock``, for as long as it runs: the kernel drops it when the process dies,
however it dies.

A group of files named with pid P is a leftover when nobody holds P's owner lock and either P is dead or
P is this very process (a restart that got the dead owner's pid: a name with our pid that no engine of
ours owns is not ours). A live process other than ours is never touched, lock or no lock: it may be an
engine of an older kvrouter, or a pid reused by an unrelated process, whose files then wait for its end.
A fence lock file that some process still holds is kept (an orphaned applier may still be writing; the
new applier waits for it, which is the fence's whole point). Names not in kvrouter's patterns (tests'
own segments, owners above ``pid_max`` that tests use as synthetic owners) are never considered.

``flock`` rather than a pid file: a pid file cannot tell a live owner from a reused pid; a lock cannot
outlive its holder. Two descriptors of one file conflict even within one process, so a second engine
in the same process finds the first one's lock held and refuses to start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from typing import Final

from ..errors import EngineError
from .layout import PREFIX, SHM_DIR

__all__ = ["owner_lock_path", "sweep_leftovers", "take_owner_lock"]

log = logging.getLogger(__name__)

_SHM_NAME: Final = re.compile(rf"^{PREFIX}(\d+)-(?:ctl|stats|fronts|s\d+-e\d+|s\d+\.lock|owner\.lock)$")
"""Control segment, the service's stats segment and its fronts' words (``--fronts N``), shard segments, fences,
owner lock (``layout.control_name`` and friends)."""
_SOCKET_DIR: Final = re.compile(rf"^{PREFIX}(\d+)-[a-z0-9_]{{8}}$")
"""``tempfile.mkdtemp(prefix="kvrouter-<pid>-")``: eight characters of ``[a-z0-9_]`` follow the prefix."""
DEFAULT_PID_MAX: Final = 1 << 22
"""Linux's largest ``pid_max``, used when ``/proc/sys/kernel/pid_max`` cannot be read."""


def owner_lock_path(owner_pid: int) -> str:
    return f"{SHM_DIR}/{PREFIX}{owner_pid}-owner.lock"


def take_owner_lock(owner_pid: int) -> int:
    """Create and hold the owner lock of ``owner_pid``'s names; returns its descriptor (close it last).

    Raises:
        EngineError: another engine (of this process or of another holding the same pid's names) holds it.
    """
    path = owner_lock_path(owner_pid)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise EngineError(
            f"another engine runs in process {owner_pid}: it holds {path} (one engine per process)"
        ) from None
    return fd


def sweep_leftovers(shm_dir: str = SHM_DIR, socket_dir: str | None = None) -> list[str]:
    """Remove every group of kvrouter files whose owner is gone (see the module docstring).

    Returns:
        The paths removed.
    """
    socket_dir = tempfile.gettempdir() if socket_dir is None else socket_dir
    groups: defaultdict[int, list[str]] = defaultdict(list)
    for directory, pattern in ((shm_dir, _SHM_NAME), (socket_dir, _SOCKET_DIR)):
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(directory):
                if match := pattern.match(name):
                    groups[int(match.group(1))].append(os.path.join(directory, name))
    removed: list[str] = []
    pid_max = _pid_max()
    for pid, paths in groups.items():
        if 0 < pid <= pid_max and _abandoned(pid, shm_dir):
            gone = [path for path in sorted(paths) if _remove(path)]
            if gone:
                log.warning("leftovers swept owner=%d files=%d", pid, len(gone))
                removed += gone
    return removed


def _abandoned(pid: int, shm_dir: str) -> bool:
    if _held(f"{shm_dir}/{PREFIX}{pid}-owner.lock"):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _held(path: str) -> bool:
    """Whether some process holds ``flock`` on ``path`` (a missing file is held by nobody)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it
    return False


def _remove(path: str) -> bool:
    if path.endswith(".lock") and _held(path):
        return False  # a fence an orphaned applier still holds: its replacement waits for it
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("leftover not removed path=%s error=%s", path, exc)
        return False
    return True


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return DEFAULT_PID_MAX
