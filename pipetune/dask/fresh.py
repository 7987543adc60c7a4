"""Whether a long-lived worker (the warm service's, :mod:`pipetune.service`) still runs
the code a new study expects, and a fresh worker where it does not.

Each study ends by noting, on every worker, the files of the modules it has loaded that
are not part of an installation, with their modification times
(:func:`note_loaded_code`). Before the next study, a worker that loaded such a module
since (a study stopped before its note), one whose file changed since (the user edited
their model), or one from outside the new job's folders (another job's ``model.py``,
imported under the same name) is restarted: its nanny forks a fresh process, which
imports the job's code anew. pipetune's own source is not checked here: an edited
pipetune replaces the whole service (:func:`pipetune.service.code_fingerprint`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

#: This worker's note: file -> modification time (ns) when the last study ended.
_noted: dict[str, int] | None = None
_PIPETUNE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def _own_code() -> dict[str, int]:
    """Files of loaded modules that are the user's own (not installed, not pipetune's)."""
    from pipetune.modules import install_dirs

    skip = tuple(d.rstrip(os.sep) + os.sep for d in install_dirs()) + (_PIPETUNE,)
    files: dict[str, int] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or path.startswith(skip):
            continue
        real = os.path.realpath(path)
        if real.startswith(skip):
            continue
        with contextlib.suppress(OSError):
            files[real] = os.stat(real).st_mtime_ns
    return files


def note_loaded_code() -> int:
    """Run on a worker when a study ends: remember its own code's files as they are."""
    global _noted
    _noted = _own_code()
    return len(_noted)


def stale_code(folders: list[str]) -> str | None:
    """Run on a worker before a study: why it must start again, or None."""
    now = _own_code()
    if not now:
        return None
    roots = [os.path.realpath(f).rstrip(os.sep) + os.sep for f in folders]
    for path, mtime in sorted(now.items()):
        if _noted is None or path not in _noted:
            return f"{path} was loaded by a study that did not end here"
        if _noted[path] != mtime:
            return f"{path} changed"
        if not any(path.startswith(root) for root in roots):
            return f"{path} is not from this job's folders"
    return None


def freshen_workers(client: Any, folders: list[str]) -> dict[str, str]:
    """Restart the workers whose loaded code is not the job's as it is now; returns
    address -> why, for those restarted."""
    answers = client.run(stale_code, list(folders), on_error="return")
    stale = {addr: why for addr, why in answers.items() if isinstance(why, str)}
    if stale:
        client.restart_workers(list(stale), timeout=120, raise_for_error=False)
    return stale


def note_workers_code(client: Any) -> None:
    """At a study's end, :func:`note_loaded_code` on every worker (best effort)."""
    with contextlib.suppress(Exception):
        client.run(note_loaded_code, on_error="return")
