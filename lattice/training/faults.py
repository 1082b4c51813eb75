"""Training that survives faults: the out-dir lock and checks, stop requests by signal, workers
that die with their launcher, per-rank heartbeats that name a stalled rank, stack dumps before a
collective times out.

    lattice train --out-dir runs/a --dist-timeout 120 --on-nan stop --checkpoint-interval 50

Every piece here is used by `lattice.cli.main` and `lattice.training.trainer`; none of it communicates.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from lattice.checkpoint.run_dir import HEARTBEAT_DIR
from lattice.parallel.context import LatticeConfigError

LOCK_FILE = ".lattice.lock"
SCHEDULE_FIELDS = ("steps", "lr", "warmup", "batch_size", "seed")


# ----------------------------------------------------------------------------- the out-dir


def remove_stale_temps(out: Path, checkpoint_name: str) -> list[Path]:
    """Temporary checkpoint files a killed save left behind (never a complete checkpoint)."""
    stale = sorted(out.glob(f".{checkpoint_name}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class RunLock:
    """An exclusive lock on the out-dir for the life of a run (fcntl, released by the kernel when
    the holder dies, so a crashed run never leaves it taken)."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, mode: int = fcntl.LOCK_EX) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LatticeConfigError(f"another lattice run (pid {holder}) is using --out-dir {self.path.parent}; "
                                     f"wait for it to finish or choose another --out-dir") from None
        if mode == fcntl.LOCK_EX:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def probe(self) -> None:
        """Refuse now if another run holds the lock, without keeping it. A shared lock: the ranks
        of one starting run probe at the same moment and must not see each other as a run."""
        self.acquire(fcntl.LOCK_SH).release()

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def check_schedule(saved: dict, now: dict, allow_change: bool, where) -> list[str]:
    """Refuse a resume that changes the training schedule, naming every differing field; with
    `allow_change`, return those differences ("steps 20 -> 40", ...). A checkpoint with no
    recorded schedule (weights imported with `lattice convert --from hf`) starts the schedule
    given now."""
    if not saved:
        return []
    diff = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in SCHEDULE_FIELDS if saved.get(k) != now.get(k)]
    if diff and not allow_change:
        raise LatticeConfigError(f"resuming {where} would change the training schedule ({'; '.join(diff)}); "
                                 f"pass the saved values, or --allow-config-change to change it on purpose")
    return diff


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric rows after `step` (written by a run that crashed after its last checkpoint)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:1] + [line for line in lines[1:] if line.split(",", 1)[0].isdigit()
                        and int(line.split(",", 1)[0]) <= step]
    path.write_text("".join(kept))


# ----------------------------------------------------------------------------- signals and parents


class StopRequest:
    """SIGTERM / SIGINT set a flag instead of raising; the trainer saves at the next step
    boundary and exits cleanly (how clusters pre-empt jobs). One Ctrl-C reaches a worker twice,
    from the terminal and again from torchrun's agent passing it on: the same signal within
    DUPLICATE_S of its first arrival is that one request. A later one of the same kind has the
    signal's default effect, so a second Ctrl-C still interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    DUPLICATE_S = 2.0

    def __init__(self):
        self.signal: int | None = None  # the first signal that asked to stop
        self._first_at: dict[int, float] = {}  # each kind's first arrival
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum not in self._first_at:
            self._first_at[signum] = time.monotonic()
            self.signal = self.signal or signum
            return
        if time.monotonic() - self._first_at[signum] < self.DUPLICATE_S:
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent (the launcher) dies, so that
    killing the launcher never leaves orphaned workers training (Linux prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


# ----------------------------------------------------------------------------- progress


class Heartbeat:
    """Each rank records, about once a second from a background thread, the step it is in, its pid,
    host and the time, in the out-dir; a rank that stops (SIGSTOP, a hung kernel, a dead node)
    stops beating while ranks merely waiting in a collective keep beating. Every step also re-arms
    a faulthandler stack dump for the case that the step outlasts the collective timeout. A rank
    whose collective times out reads the beats, names the stalled ranks and, on this host, kills
    them so that the launcher ends the job at once."""

    INTERVAL = 1.0

    def __init__(self, out: Path | None, rank: int, world: int, timeout_s: float):
        self.dir = (out / HEARTBEAT_DIR) if out is not None else None
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.step = 0
        self._stop = threading.Event()
        self._thread = None
        if self.dir is not None and world > 1:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="lattice-heartbeat", daemon=True)
            self._thread.start()

    def _run(self):
        host = socket.gethostname()
        while not self._stop.is_set():
            try:
                (self.dir / f"rank{self.rank}").write_text(f"{self.step} {os.getpid()} {time.time():.3f} {host}\n")
            except OSError:
                pass  # a full or vanished disk must not kill training; the dump below still works
            self._stop.wait(self.INTERVAL)

    def beat(self, step: int) -> None:
        self.step = step
        if self.world > 1 and sys.__stderr__ is not None:  # re-armed every step; only collectives can stall
            faulthandler.dump_traceback_later(self.timeout_s * 0.9, exit=False, file=sys.__stderr__)

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._stop.set()


def last_heartbeat(out: Path) -> float | None:
    """When the rank that stopped first last beat (the earliest of the ranks' last beats: the
    others beat on until the launcher stops them), or None without beats."""
    times = []
    for f in (out / HEARTBEAT_DIR).glob("rank*") if (out / HEARTBEAT_DIR).is_dir() else ():
        try:
            times.append(float(f.read_text().split()[2]))
        except (OSError, ValueError, IndexError):
            continue
    return min(times, default=None)


def process_start_time() -> float:
    """When this process started (seconds since the epoch, to 10 ms), from the kernel's record of
    it; the time of the call where /proc has none."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def stalled_ranks(out: Path | None, world: int) -> str:
    """The ranks whose heartbeats went stale ("rank 1 (pid 42 on host) stopped 9 s ago in step
    779"); those on this host are killed, so that the launcher ends the job now."""
    if out is None:
        return "run with --out-dir to have the stalled rank named"
    beats = out / HEARTBEAT_DIR
    now, host, stale = time.time(), socket.gethostname(), []
    for r in range(world):
        try:
            step, pid, when, where = (beats / f"rank{r}").read_text().split()
        except (OSError, ValueError):
            stale.append(f"rank {r} (never beat)")
            continue
        if now - float(when) > 3 * Heartbeat.INTERVAL + 1:
            stale.append(f"rank {r} (pid {pid} on {where}) stopped {now - float(when):.0f} s ago in step {int(step) + 1}")
            if where == host:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass  # it ended meanwhile
    return ("stalled: " + "; ".join(stale)) if stale else "every rank is still beating (a slow collective?)"
