"""Kill a training run at N random moments and resume it each time; count what survived.

    python benchmarks/fault_injection.py --trials 8 --steps 1500 --checkpoint-interval 3
    python benchmarks/fault_injection.py --trials 5 --nproc 2 --mode 1d --tp 2
    python benchmarks/fault_injection.py --trials 5 --async-checkpoint

Each trial starts `lattice train` (resuming from the out-dir when it holds a checkpoint), waits
a random time, and kills the whole job with SIGKILL (mid-step, mid-save or mid-evaluation alike).
Then it reads the checkpoint as a resume would. At the end one more resume finishes the run, and
its weights are compared with an uninterrupted run of the same command. Prints: trials, successful
resumes, corrupt checkpoints, stale temporary files or partial checkpoint directories left after the
final run, and whether the final weights are equal (expected: N, N, 0, 0, equal).
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


def _command(args, out: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "lattice", "train", "--model", "tiny", "--vocab-size", "512", "--batch-size", "4",
           "--eval-batches", "1", "--eval-interval", "50", "--no-progress", "--steps", str(args.steps),
           "--checkpoint-interval", str(args.checkpoint_interval), "--mode", args.mode, "--tp", str(args.tp),
           "--out-dir", str(out)]
    if args.async_checkpoint:
        cmd.append("--async-checkpoint")
    if args.nproc > 1:
        cmd += ["--nproc", str(args.nproc)]
    return cmd + (["--resume", str(out)] if resume else [])


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
    args = ap.parse_args(argv)
    from lattice import checkpoint
    from lattice import sharded_checkpoint as sharded
    from lattice.context import LatticeConfigError

    def has_checkpoint(out: Path) -> bool:
        return (out / checkpoint.FILENAME).exists() or bool(sharded.complete(out))

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lattice-faults-"))
    out, reference = work / "run", work / "reference"
    resumes = corrupt = stale = 0
    for trial in range(args.trials):
        has_ckpt = has_checkpoint(out)
        job = subprocess.Popen(_command(args, out, has_ckpt), env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
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
        print(f"trial {trial}: killed after {'resuming' if has_ckpt else 'starting'}; the next start resumes at step {step}")
    finished = subprocess.run(_command(args, out, has_checkpoint(out)), env=_env(), capture_output=True, text=True)
    stale = len(list(out.glob(f".{checkpoint.FILENAME}.*.tmp"))) + len(list(out.glob(f"{sharded.SUBDIR}/.step-*")))
    straight = subprocess.run(_command(args, reference, False), env=_env(), capture_output=True, text=True)
    if finished.returncode or straight.returncode:
        print(finished.stderr[-2000:], straight.stderr[-2000:])
        return 1
    a, b = checkpoint.full_model(checkpoint.read(out)), checkpoint.full_model(checkpoint.read(reference))
    equal = all(torch.equal(a[k], b[k]) for k in a)
    print(f"trials {args.trials}, successful resumes {resumes}, corrupt checkpoints {corrupt}, stale files {stale}, "
          f"final weights equal to an uninterrupted run: {equal}")
    return 0 if equal and not corrupt and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
