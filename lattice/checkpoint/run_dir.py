"""Where a training run writes, so that two runs never share a directory.

    lattice train                         # a new runs/run-N; runs/latest links to it
    lattice train --resume runs/run-1     # continues in runs/run-1
    lattice train --out-dir runs/a        # refused if runs/a holds another run ...
    lattice train --out-dir runs/a --overwrite   # ... unless told to delete that run

Without --out-dir a run gets a fresh numbered directory (as Lightning numbers its versions), so
running `lattice train` twice loses nothing; an explicit --out-dir that holds another run is
refused unless --overwrite (as HuggingFace's Trainer refuses a used output_dir), since guessing
would either mix two runs or hide one. A resumed run continues in its own directory, and
resuming a checkpoint older than the directory's newest is refused unless --overwrite deletes
the later ones: otherwise `--keep` and "the newest checkpoint" would mix two histories.

Choosing is read-only (every rank chooses alike before any process group exists); one process
creates what was chosen (`create`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lattice.checkpoint import FILENAME as SINGLE_FILE
from lattice.checkpoint import sharded
from lattice.checkpoint.files import atomic_write
from lattice.parallel.context import LatticeConfigError

METRICS_FILE = "metrics.csv"
HEARTBEAT_DIR = ".heartbeat"  # one file per rank: its step and pid (lattice.training.faults.Heartbeat)
JOB_FILE = "job.json"  # which launcher job the run belongs to and how it ended (`read_job`)
SKIPPED_DIR = "skipped"  # checkpoints a restart could not resume, kept as evidence
RUNS = Path("runs")
LATEST = "latest"
# what a run writes into its directory (--overwrite removes these and nothing else)
RUN_FILES = ("config.toml", METRICS_FILE, "tokenizer.json", "special_tokens_map.json", "tokenizer_config.json",
             "data.json", SINGLE_FILE, "tensorboard", sharded.SUBDIR, HEARTBEAT_DIR, JOB_FILE, SKIPPED_DIR)


def next_numbered(runs: Path = RUNS) -> Path:
    """runs/run-N with N one above every run-N there."""
    taken = [int(m.group(1)) for p in (runs.iterdir() if runs.is_dir() else ())
             if (m := re.fullmatch(r"run-(\d+)", p.name))]
    return runs / f"run-{max(taken, default=0) + 1}"


def describe(out: Path) -> str | None:
    """What of a run `out` holds ("a run with checkpoints at steps 100, 200, 300"), or None."""
    steps = [_step(p) for p in sharded.complete(out)] if (out / sharded.SUBDIR).is_dir() else []
    if steps:
        return f"a run with checkpoints at step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
    if (out / SINGLE_FILE).is_file():
        return f"a run's checkpoint {SINGLE_FILE}"
    written = [name for name in ("config.toml", METRICS_FILE) if (out / name).exists()]
    return f"a run without checkpoints ({' and '.join(written)})" if written else None


@dataclass(frozen=True)
class RunDir:
    """Where a run writes: `out`; `fresh` when it is a new numbered directory (runs/latest then
    links to it); `clear`: what --overwrite deletes first ("run": the run there; a step: the
    checkpoints after it; None: nothing)."""

    out: Path
    fresh: bool = False
    clear: str | int | None = None


def choose(out_dir: str | None, resume_run: Path | None, resume_step: int | None, overwrite: bool) -> RunDir:
    """The directory a `lattice train` request writes into. `resume_run`/`resume_step`: the run
    directory and step of a sharded checkpoint being resumed. Refuses, in one line, a directory
    holding another run, or checkpoints after the resumed step, unless `overwrite`."""
    if out_dir is None and resume_run is None:
        return RunDir(next_numbered(), fresh=True)
    if resume_run is not None and resume_run.is_symlink():  # runs/latest: the run it names now, not later
        resume_run = resume_run.parent / os.readlink(resume_run)
    out = Path(out_dir) if out_dir is not None else resume_run
    found = describe(out) if out.is_dir() else None
    same = resume_run is not None and out.resolve() == resume_run.resolve()
    if found and not same:
        if overwrite:
            return RunDir(out, clear="run")
        raise LatticeConfigError(
            f"--out-dir {out} holds {found}; continue it with --resume {out}, write this run elsewhere with another "
            f"--out-dir (or none: a new runs/run-N), or pass --overwrite to delete that run first")
    later = [p.name for p in sharded.complete(out) if _step(p) > resume_step] if same else []
    if later:
        if overwrite:
            return RunDir(out, clear=resume_step)
        raise LatticeConfigError(
            f"{out} holds checkpoints after the resumed step {resume_step} ({', '.join(later)}), which this run "
            f"would replace; resume the newest with --resume {out}, write to another --out-dir, or pass --overwrite "
            f"to delete the later ones")
    return RunDir(out)


def _step(checkpoint_dir: Path) -> int:
    return int(checkpoint_dir.name.split("-")[1])


def create(run: RunDir) -> list[str]:
    """Make the chosen directory ready (one process): delete what --overwrite deletes; for a
    fresh numbered directory, point runs/latest at it. Returns lines worth telling the user."""
    out, told = run.out, []
    if run.clear == "run":
        removed = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
        for name in removed:
            target = out / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        told.append(f"--overwrite: deleted the run in {out} ({', '.join(removed)})")
    elif run.clear is not None:
        later = [p for p in sharded.complete(out) if _step(p) > run.clear]
        for p in later:
            shutil.rmtree(p)
        told.append(f"--overwrite: deleted the checkpoints after step {run.clear} in {out} "
                    f"({', '.join(p.name for p in later)})")
    out.mkdir(parents=True, exist_ok=True)
    if run.fresh:
        link = out.parent / LATEST
        if link.is_symlink() or not link.exists():
            tmp = out.parent / f".{LATEST}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(out.name)
            os.replace(tmp, link)  # atomic: a reader sees the old link or the new one
        else:
            told.append(f"{link} is a directory (not the link to the newest run), left as it is; this run is in {out}")
    return told


def without_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """`argv` without the given flags ({flag: how many values it takes}), whether written
    `--flag value`, `--flag=value` or as an unambiguous abbreviation (as argparse accepts them)."""
    kept, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name, eq, _ = token.partition("=")
        # argparse accepts unambiguous abbreviations: "--out" is --out-dir
        flag = next((f for f in flags if len(name) > 3 and f.startswith(name)), None) if name.startswith("--") else None
        if flag is None:
            kept.append(token)
        elif not eq:
            skip = flags[flag]
    return kept


def resume_command(argv: list[str], out: Path) -> str:
    """The command that continues a stopped run: `argv` (the train command line as given, or as
    torchrun's workers got it) without --resume/--out-dir/--stop-at/--overwrite, plus --resume OUT
    (which continues in OUT)."""
    kept = without_flags(argv, {"--resume": 1, "--out-dir": 1, "--stop-at": 1, "--overwrite": 0})
    launched_by_user = "WORLD_SIZE" in os.environ and not any(t == "--nproc" or t.startswith("--nproc=") for t in argv)
    if launched_by_user:  # workers of the user's own torchrun
        world, local = os.environ["WORLD_SIZE"], os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        prefix = (f"torchrun --standalone --nproc-per-node {world} -m lattice" if world == local
                  else "torchrun <your rendezvous options> -m lattice")
    else:
        prefix = "lattice"
    return " ".join([prefix, *map(shlex.quote, kept), "--resume", shlex.quote(str(out))])


# ----------------------------------------------------------------------------- restarts


def read_job(out: Path) -> dict | None:
    """The run's job record (JOB_FILE): the launcher job it belongs to ("run_id", torchrun's
    TORCHELASTIC_RUN_ID), its "state" ("running", "finished", or "stopped" with the "reason"
    a restart would meet again), and its "recoveries"; None where there is none or it is not
    readable (a record half written by a killed process reads as none)."""
    try:
        record = json.loads((Path(out) / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_job(out: Path, *, new: bool = False, **fields) -> dict:
    """Update the run's job record with `fields` (one process; atomic); `new`: a job of its own
    starts (a person's run or resume), whose record keeps nothing of the jobs before it."""
    record = {**({} if new else read_job(out) or {}), **fields, "updated": time.time()}
    atomic_write(Path(out) / JOB_FILE, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1) + "\n"))
    return record


def newest_intact(out: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of the run in `out` that verifies whole (`sharded.verify`), and the
    newer ones passed over with the reason of each: a step directory without its marker (its
    save was interrupted, or the marker is gone), a truncated file, a chunk whose checksum fails."""
    base = Path(out) / sharded.SUBDIR
    steps = sorted((p for p in base.glob("step-*") if p.is_dir()), key=lambda p: p.name, reverse=True) \
        if base.is_dir() else []
    skipped = []
    for path in steps:
        problem = sharded.verify(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def set_aside(out: Path, skipped: list[tuple[Path, str]]) -> list[str]:
    """Move checkpoints a restart passed over into OUT/skipped/ (with the reason beside each),
    so that the steps trained again can be saved under their names and nothing is deleted."""
    told = []
    for path, reason in skipped:
        if not path.exists():
            continue
        target = Path(out) / SKIPPED_DIR / f"{path.name}-{int(time.time())}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        (target.parent / f"{target.name}.reason.txt").write_text(reason + "\n")
        told.append(f"set aside {path} in {target}: {reason}")
    return told
