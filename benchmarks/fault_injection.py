"""Kill a training run at N random moments and resume it each time; count what survived.

    python benchmarks/fault_injection.py --trials 8 --steps 1500 --checkpoint-interval 3
    python benchmarks/fault_injection.py --trials 5 --nproc 2 --mode 1d --tp 2
    python benchmarks/fault_injection.py --trials 5 --async-checkpoint
    # one rank killed, not the job: the others must notice and end, and the run must resume
    python benchmarks/fault_injection.py --kill one-rank --trials 10 --nproc 4 --mode 2d --tp 4 \
        --async-checkpoint --steps 400 --checkpoint-interval 5

Each trial starts `lattice train` (resuming from the out-dir when it holds a checkpoint), waits
a random time, and kills the whole job with SIGKILL (mid-step, mid-save or mid-evaluation alike),
or with `--kill one-rank` one worker chosen at random, after which the job must end by itself
(its time to end is printed; a job still running after --hang-after s counts as hung).
Then it reads the checkpoint as a resume would. At the end one more resume finishes the run, and
its weights are compared with an uninterrupted run of the same command. Prints: trials, successful
resumes, corrupt checkpoints, stale temporary files or partial checkpoint directories left after the
final run, hung jobs, and whether the final weights are equal (expected: N, N, 0, 0, 0, equal).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _workers(launcher: int) -> list[int]:
    """The pids of the job's training workers: the launcher's children that carry RANK in their
    environment (torchrun starts each in a session of its own, so not the launcher's group)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:  # parent pid
                continue
            if b"\0RANK=" in b"\0" + (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # it ended while we looked
    return found


def _training(out: Path, workers: list[int], nproc: int) -> bool:
    """Every worker of this job is in its training loop (its heartbeat names its pid)."""
    from lattice.checkpoint.run_dir import HEARTBEAT_DIR

    try:
        pids = {int((out / HEARTBEAT_DIR / f"rank{r}").read_text().split()[1]) for r in range(nproc)}
    except (OSError, ValueError, IndexError):
        return False
    return pids <= set(workers)


def _kill_one_rank(job: subprocess.Popen, out: Path, nproc: int, rng: random.Random, max_wait: float,
                   hang_after: float) -> tuple[str, float | None]:
    """Wait until every worker trains, then SIGKILL one at a random moment; how the job ended and
    after how many seconds (None: it did not end within hang_after and was killed whole)."""
    deadline = time.monotonic() + 120
    while not (len(workers := _workers(job.pid)) == nproc and _training(out, workers, nproc)) \
            and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if len(workers) < nproc or not _training(out, workers, nproc):
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        return "the workers never all trained", 0.0
    time.sleep(rng.uniform(0.0, max_wait))
    victim = rng.choice(_workers(job.pid) or workers)
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        pass
    killed = time.monotonic()
    try:
        job.wait(timeout=hang_after)
        return f"killed worker pid {victim}", time.monotonic() - killed
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        return f"killed worker pid {victim}; the job hung", None


def _command(args, out: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "lattice", "train", "--model", "tiny", "--vocab-size", "512", "--batch-size", "4",
           "--eval-batches", "1", "--eval-interval", "50", "--no-progress", "--steps", str(args.steps),
           "--checkpoint-interval", str(args.checkpoint_interval), "--mode", args.mode, "--tp", str(args.tp),
           "--out-dir", str(out)]
    if args.async_checkpoint:
        cmd.append("--async-checkpoint")
    if args.nproc > 1:
        cmd += ["--nproc", str(args.nproc)]
    # a run killed before its first checkpoint left only its config and metrics: start it over
    return cmd + (["--resume", str(out)] if resume else ["--overwrite"])


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--checkpoint-interval", type=int, default=3)
    ap.add_argument("--mode", default="serial")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-checkpoint", action="store_true")
    ap.add_argument("--max-wait", type=float, default=4.0, help="kill within this many seconds of a start")
    ap.add_argument("--kill", choices=("job", "one-rank"), default="job",
                    help="SIGKILL the whole job (default) or one worker chosen at random")
    ap.add_argument("--hang-after", type=float, default=90.0,
                    help="with --kill one-rank: a job still running this long after the kill counts as hung")
    args = ap.parse_args(argv)
    from lattice import checkpoint
    from lattice.checkpoint import sharded
    from lattice.parallel.context import LatticeConfigError

    def has_checkpoint(out: Path) -> bool:
        return (out / checkpoint.FILENAME).exists() or bool(sharded.complete(out))

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lattice-faults-"))
    out, reference = work / "run", work / "reference"
    resumes = corrupt = stale = hung = 0
    ends = []
    for trial in range(args.trials):
        has_ckpt = has_checkpoint(out)
        job = subprocess.Popen(_command(args, out, has_ckpt), env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        how = "killed the job"
        if args.kill == "one-rank":
            how, ended = _kill_one_rank(job, out, args.nproc, rng, args.max_wait, args.hang_after)
            hung += ended is None
            ends += [ended] if ended else []
            how += f"; the job ended {ended:.1f} s later" if ended is not None else ""
        else:
            time.sleep(rng.uniform(1.0, args.max_wait))
            os.killpg(job.pid, signal.SIGKILL)  # the launcher and every worker, at once
            job.wait()
        step = 0  # killed before the first checkpoint: the next start begins afresh, which is fine
        if has_checkpoint(out):
            try:
                step = checkpoint.read(out)["step"]  # what the next start resumes from
            except LatticeConfigError as e:
                corrupt += 1
                print(f"trial {trial}: {e}")
                continue
        resumes += 1
        print(f"trial {trial}: {how} after {'resuming' if has_ckpt else 'starting'}; the next start resumes at step "
              f"{step}", flush=True)
    finished = subprocess.run(_command(args, out, has_checkpoint(out)), env=_env(), capture_output=True, text=True)
    stale = len(list(out.glob(f".{checkpoint.FILENAME}.*.tmp"))) + len(list(out.glob(f"{sharded.SUBDIR}/.step-*")))
    straight = subprocess.run(_command(args, reference, False), env=_env(), capture_output=True, text=True)
    if finished.returncode or straight.returncode:
        print(finished.stderr[-2000:], straight.stderr[-2000:])
        return 1
    a, b = checkpoint.full_model(checkpoint.read(out)), checkpoint.full_model(checkpoint.read(reference))
    equal = all(torch.equal(a[k], b[k]) for k in a)
    ended = f", the job ended within {max(ends):.1f} s of every kill" if ends else ""
    print(f"trials {args.trials}, successful resumes {resumes}, corrupt checkpoints {corrupt}, stale files {stale}, "
          f"hung jobs {hung}{ended}, final weights equal to an uninterrupted run: {equal}")
    return 0 if equal and not corrupt and not stale and not hung else 1


if __name__ == "__main__":
    sys.exit(main())
