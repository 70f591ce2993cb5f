"""`launch_local`'s ranks die with their launcher, and what a killed launch leaves is reclaimed.

A launcher that is SIGKILLed cannot stop its ranks: left alone they would train on for minutes,
write their outputs and keep their folder under the temp dir. So each rank watches the process
that launched it (``$DYNABATCH_LAUNCHER``: its pid and start time, `launcher_identity`) with the
loader's parent watch (`dynabatch.loader.processes.watch_parent`):

* **spawn**: the rank is the launcher's child. The kernel kills it when the launcher dies
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set first thing in the rank, before its imports:
  `PDEATHSIG_CODE`); a thread also polls the launcher's pid and start time.
* **forkserver**: the rank is a child of the fork server, which exits as soon as its launcher does
  (it reads EOF on a pipe only the launcher holds). The rank gets the parent-death signal from the
  server (forked from the server's main thread) and polls the launcher as well.

The signal follows the thread that forked: `launch_local` starts its ranks from the thread that then
waits for them (and kills them on the way out), so that thread outlives them.

A rank killed that way cannot remove the launch's folder (``dynabatch-launch-PID-START-*`` under the
temp dir, named for the launcher's pid and start time). The next launch removes every such folder of
this user whose launcher is no longer running (`reclaim_launch_folders`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from ...loader.processes import watch_parent
from ...process_identity import ended_owners, process_start, process_tag

LAUNCHER_ENV = "DYNABATCH_LAUNCHER"  # "PID-START" of the launch_local process, in every rank's environment
FOLDER_PREFIX = "dynabatch-launch-"
_FOLDER = re.compile(re.escape(FOLDER_PREFIX) + r"(\d+)-(\d*)-")
# run by a spawned rank before anything else: its imports (torch) take up to 30 s on a loaded machine,
# and this is what stops it during them. It cannot import dynabatch (which imports torch), hence the
# prctl here in full (PR_SET_PDEATHSIG = 1, SIGKILL = 9); `watch_launcher` sets it again after the
# imports and also catches a launcher that died before this line ran.
PDEATHSIG_CODE = ("import os, sys, ctypes\n"
                  f"if sys.platform.startswith('linux') and os.environ.get({LAUNCHER_ENV!r}):\n"
                  "    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n")


def launcher_identity() -> str:
    """``"PID-START"`` of this process (`process_tag`), as its ranks get it in ``$DYNABATCH_LAUNCHER``."""
    return process_tag()


def watch_launcher(forked: bool = False) -> None:
    """In a rank of `launch_local`: die (SIGKILL) when the launcher named by ``$DYNABATCH_LAUNCHER``
    ends (a no-op without it). ``forked``: the rank was forked by a fork server (its OS parent, which
    it watches too), not spawned by the launcher itself."""
    raw = os.environ.get(LAUNCHER_ENV)
    if not raw:
        return
    pid, _, start = raw.partition("-")
    if forked:
        # the server forks from its main thread. Already gone (this rank's parent is then init or a
        # subreaper, harmless to watch), it went with its launcher, which the poll below finds gone
        server = os.getppid()
        watch_parent(server, True, process_start(server))
    watch_parent(int(pid), not forked, start or None)


def reclaim_launch_folders(root: str | None = None) -> list[str]:
    """Remove the launch folders under ``root`` (default: the temp dir) that belong to this user and
    whose launcher (the pid and start time in the name) is no longer running; the paths removed."""
    gone = ended_owners(root or tempfile.gettempdir(), (_FOLDER,))
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def make_launch_folder() -> str:
    """A new folder for one launch's heartbeat and output files, named for this process (see the
    module doc), after reclaiming the folders of dead launchers."""
    reclaim_launch_folders()
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{process_tag()}-")
