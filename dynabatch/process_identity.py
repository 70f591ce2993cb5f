"""Whether a process is still the one that was running: its pid and its start time.

A pid alone can name another process once the first ended (pids are recycled); with the start time
(`process_start`) it names one process's life. The loader's children watch their parent with it
(`dynabatch.loader.processes`), a launch's ranks their launcher (`dynabatch.pipeline.runtime.orphans`),
and files named for the process that made them (`process_tag`) are reclaimed once it is gone
(`ended_owners`: the token cache's, `dynabatch.index.token_file`; the launch folders). Standard
library only: any layer may import it.
"""

from __future__ import annotations

import os
import re


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the name (state first); None where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the name, in parentheses, may hold spaces


def process_start(pid: int) -> str | None:
    """An id of the process ``pid``'s life (Linux: its start time in clock ticks since boot, from
    ``/proc``), so that a recycled pid reads as another process; None where unknown."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]  # field 22 (starttime)


def process_alive(pid: int, start: str | None) -> bool:
    """Process ``pid`` runs and is the one whose `process_start` was ``start`` (None: any process of
    that pid). A zombie (exited, not yet reaped) has ended; a pid of another user's process is taken
    for a recycled one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else: a recycled pid
        return False
    fields = _stat_fields(pid)
    if fields is None:  # no /proc (not Linux): the pid is all there is to go by
        return start is None
    return fields[0] != "Z" and (start is None or fields[19] == start)


def process_tag(pid: int | None = None) -> str:
    """``PID-START`` of process ``pid`` (default: this one; START empty where unknown): what the names
    of the files and folders it owns carry, so that `ended_owners` can tell when it is gone."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{process_start(pid) or ''}"


def ended_owners(folder: str, patterns: tuple[re.Pattern, ...]) -> list[str]:
    """The entries of ``folder`` of this user whose name matches one of ``patterns`` (group 1: the
    owner's pid, group 2: its start time, empty or absent where unknown) and whose owner has ended."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in names:
        m = next((m for m in (p.match(name) for p in patterns) if m is not None), None)
        if m is None or process_alive(int(m.group(1)), m.group(2) or None):
            continue
        path = os.path.join(folder, name)
        try:
            mine = os.lstat(path).st_uid == os.getuid()
        except OSError:  # removed meanwhile (by another process's start)
            continue
        except AttributeError:  # no uids (not POSIX): the pid is all there is
            mine = True
        if mine:  # another user's (a shared folder): theirs to judge
            out.append(path)
    return out
