"""Where a measurement comes from, recorded in every result file a benchmark writes: the command,
the commit it measured (with "+changes" when the work tree differed from it), the date, the host
and the versions of Python and torch."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def provenance(command: str | None = None) -> dict:
    """{"command", "commit", "date", "host", "python", "torch"} of this process's measurement;
    `command` defaults to how this process was started."""
    import torch

    return {"command": command or " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "torch": torch.__version__}


def _commit() -> str:
    """The checkout's commit, "+changes" when its tracked files other than the results differ (a
    benchmark writing its own result file is no change to what it measured); "unknown" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
        return (head + ("+changes" if changed else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
