"""What both checkpoint forms share: writing a file so that a crash never leaves half of it under
its real name, flushing directories, CRC-32s of files, refusing a record of another format
version, and the space a save needs and the reason a write failed."""

from __future__ import annotations

import base64
import errno
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from lattice.parallel.context import LatticeConfigError, TrainingStopped

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


def check_out_dir(path: str | os.PathLike, checkpoint_name: str | None = None, *, flag: str = "--out-dir") -> Path:
    """Refuse, in one line, an output directory (given as `flag`) that cannot hold what is
    written: a file, a place that cannot be created or written, or one whose checkpoint name is
    taken by a directory. Creates it when missing."""
    out = Path(path)
    fix = f"choose another {flag}"
    if out.exists() and not out.is_dir():
        raise LatticeConfigError(f"{flag} {out} is a file, not a directory; {fix}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LatticeConfigError(f"{flag} {out} cannot be created ({e.strerror or type(e).__name__}); {fix}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise LatticeConfigError(f"{flag} {out} is not writable; {fix} or fix its permissions")
    if checkpoint_name and (out / checkpoint_name).is_dir():
        raise LatticeConfigError(f"{out / checkpoint_name} is a directory where the checkpoint file goes; "
                                 f"remove or rename it, or {fix}")
    return out


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


def crc_range(f, offset: int, length: int) -> int:
    """CRC-32 of `length` bytes of an open file from `offset`, read 1 MiB at a time."""
    crc = 0
    f.seek(offset)
    while length > 0 and (block := f.read(min(length, 1 << 20))):
        crc, length = zlib.crc32(block, crc), length - len(block)
    return crc


def crc_file(path: Path) -> int:
    """CRC-32 of a whole file."""
    with open(path, "rb") as f:
        return crc_range(f, 0, path.stat().st_size)


class WriteFailed(TrainingStopped):
    """A checkpoint could not be written (too little space, or the write failed); raised on
    every rank alike, with nothing of it left behind."""


# a checkpoint's files beyond its tensors' bytes: DCP's index, the marker, the zip headers per tensor
FIXED_OVERHEAD, OVERHEAD_PER_TENSOR = 64 * 1024, 2 * 1024


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def free_bytes(path: Path) -> int:
    """Free space of the file system `path` is (or will be) on."""
    while not path.exists():  # checkpoints/ of a run's first save
        path = path.parent
    return shutil.disk_usage(path).free


def write_failure_reason(error: BaseException, base: Path) -> str:
    """One line for why a write failed: the OS's words, or DCP's first failure, and the free space
    when little is left (torch.save's zip writer reports a full disk as 'unexpected pos')."""
    from torch.distributed.checkpoint.api import CheckpointException  # (DCP is a second of start-up)

    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]  # (the exception, its stack summary) of the lowest rank
    words = error.strerror if isinstance(error, OSError) and error.strerror else (str(error).splitlines() or [""])[0]
    free = free_bytes(base)
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC or free < FIXED_OVERHEAD
    return f"no space left on the device; {megabytes(free)} free now" if full else words[:160]


def space_shortfall(base: Path, need: dict[str, int], *, size: int, group) -> tuple[int, int, int] | None:
    """Whether a checkpoint fits, decided alike on every rank of `group` (a collective when
    size > 1): the ranks exchange `need` (bytes per tensor key) and their free space in `base`;
    the checkpoint is every distinct tensor once plus headers, and each rank needs room for the
    whole of it (on a file system the ranks share, they fill it together). Returns (bytes
    needed, the first rank short of them, its free bytes), or None when every rank has room."""
    views = [(need, free_bytes(base))]
    if size > 1:
        views = [None] * size
        dist.all_gather_object(views, (need, free_bytes(base)), group=group)
    tensors = {k: v for part, _ in views for k, v in part.items()}
    total = sum(tensors.values()) + FIXED_OVERHEAD + OVERHEAD_PER_TENSOR * len(tensors)
    return next(((total, r, free) for r, (_, free) in enumerate(views) if free < total), None)


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state as text for a checkpoint's JSON marker."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
