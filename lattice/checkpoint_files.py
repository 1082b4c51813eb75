"""What both checkpoint forms share: writing a file so that a crash never leaves half of it under
its real name, flushing directories, and refusing a record of another format version."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lattice.context import LatticeConfigError

START_FRESH = "or start without --resume"  # the other way out, at the end of every refusal


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """Call write(tmp) on a temporary file in `path`'s directory, then rename it over `path`:
    readers never see a half-written file, even when several processes write the same entry.
    The file is flushed to disk before the rename and the directory after it, so a power cut
    leaves either the old or the new file; it gets the permissions the umask gives new files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(path.parent)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_version_and_keys(record: dict, path, version: int, required) -> None:
    """Refuse a checkpoint record of another format version, or one lacking required keys."""
    if record.get("version") != version:
        raise LatticeConfigError(f"checkpoint {path} has format version {record.get('version')!r} but this lattice "
                                 f"reads version {version}; resume it with the lattice version that wrote it, "
                                 f"{START_FRESH}")
    missing = [k for k in required if k not in record]
    if missing:
        raise LatticeConfigError(f"checkpoint {path} lacks {missing}; it is damaged or not written by "
                                 f"`lattice train`, {START_FRESH}")
