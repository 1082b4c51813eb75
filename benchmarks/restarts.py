"""A job that heals itself, measured: workers killed while a run trains, restarted by the launcher,
resuming on their own; each case against the same run never killed.

    python benchmarks/restarts.py soak --kills 5                       # lattice train --max-restarts
    python benchmarks/restarts.py soak --kills 3 --launcher torchrun   # plain torchrun --max-restarts
    python benchmarks/restarts.py soak --kills 3 --layout pp           # with a pipeline (pp = 2)
    python benchmarks/restarts.py soak --kills 3 --layout cp           # with context parallelism (cp = 2)
    python benchmarks/restarts.py corrupt                              # newest checkpoint damaged first
    python benchmarks/restarts.py agents                               # two torchrun agents, one rendezvous
    python benchmarks/restarts.py recovery --trials 5                  # kill -> next step, and where it goes
    python benchmarks/restarts.py all -o benchmarks/results/restarts.json

soak: dp = 2 x 1d tp = 2, ZeRO-1, bf16 weights, async checkpoints every 3 steps (the default
layout; `--layout pp`: pp = 2 x dp = 2, `--layout cp`: cp = 2 x dp = 2), `--kills` SIGKILLs of a
random worker at random steps, one of them while a checkpoint is being written; the job must end
by itself with exit 0 and its final loss and weights equal the uninterrupted run's. corrupt: a
run's newest checkpoint gets a flipped byte in one shard and the one before loses its marker,
then the job's workers are killed; the restart must skip both, say so, and end equal. agents: two
`torchrun` agents on this host with one c10d rendezvous (two "nodes" of 2 workers); one agent is
killed with SIGKILL and started again by hand. recovery: from a kill to the first step after it,
as the run reports it (`recovered: ...`), for the default model (nproc 2, dp 2) and for 2d
tp = 4 x dp = 2 (nproc 8), median of --trials.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lattice import checkpoint  # noqa: E402
from lattice.bench.provenance import provenance  # noqa: E402
from lattice.checkpoint import run_dir, sharded  # noqa: E402

TINY = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "8", "--eval-batches", "1", "--no-progress",
        "--dropout", "0.1"]
LAYOUTS = {"default": ["--dp", "2", "--mode", "1d", "--tp", "2", "--zero", "1", "--precision", "bf16"],
           "pp": ["--dp", "2", "--pp", "2", "--microbatches", "2", "--precision", "bf16"],
           "cp": ["--dp", "2", "--cp", "2", "--zero", "1", "--precision", "bf16", "--dropout", "0"]}  # no attention dropout under cp
# as docs/checkpoints.md advises for torchrun (lattice's own launcher sets it itself)
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _command(launcher: str, nproc: int, args: list[str], restarts: int, out: Path) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", str(restarts), "-m", "lattice", "train", *args, "--out-dir", str(out)]
    return [sys.executable, "-m", "lattice", "train", *args, "--nproc", str(nproc), "--max-restarts", str(restarts),
            "--out-dir", str(out)]


def _beats(out: Path, world: int) -> list[tuple[int, int]]:
    """(step, pid) of every rank that has beaten, by rank."""
    rows = []
    for r in range(world):
        try:
            step, pid, _, _ = (out / run_dir.HEARTBEAT_DIR / f"rank{r}").read_text().split()
            rows.append((int(step), int(pid)))
        except (OSError, ValueError):
            return []
    return rows


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def _final(text: str) -> str | None:
    return next((line for line in text.splitlines() if line.startswith("final val loss")), None)


def _checksum(out: Path) -> str:
    weights = checkpoint.full_model(checkpoint.read(out))
    return f"{sum(float(t.double().abs().sum()) for t in weights.values()):.12e}"


def _equal(a: Path, b: Path) -> bool:
    x, y = checkpoint.full_model(checkpoint.read(a)), checkpoint.full_model(checkpoint.read(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _reference(args: list[str], nproc: int, root: Path) -> tuple[str, Path]:
    out = root / "reference"
    done = subprocess.run(_command("lattice", nproc, args, 0, out), env=ENV, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(done.stdout), out


def _kill_at(out: Path, world: int, steps: list[int], rng: random.Random, during_save: int | None,
             job: subprocess.Popen, deadline: float) -> list[dict]:
    """SIGKILL a random worker once the slowest rank reached each of `steps` (the `during_save`-th
    kill as soon as a checkpoint's partial directory appears); what was killed, and when."""
    killed, pids_seen = [], set()
    for k, step in enumerate(steps):
        while time.monotonic() < deadline and job.poll() is None:
            rows = _beats(out, world)
            fresh = rows and all(pid not in pids_seen for _, pid in rows)
            if fresh and min(s for s, _ in rows) >= step:
                if k == during_save and not list((out / sharded.SUBDIR).glob(".step-*.partial")):
                    time.sleep(0.01)
                    continue
                rank = rng.randrange(world)
                pid = rows[rank][1]
                os.kill(pid, signal.SIGKILL)
                killed.append({"step": min(s for s, _ in rows), "rank": rank, "pid": pid, "at": time.time(),
                               "during_save": k == during_save})
                pids_seen.update(p for _, p in rows)
                break
            time.sleep(0.05)
    return killed


def soak(args) -> dict:
    layout = LAYOUTS[args.layout]
    nproc = 4
    run = [*TINY, *layout, "--steps", str(args.steps), "--eval-interval", str(args.steps // 2),
           "--checkpoint-interval", "3", "--async-checkpoint"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference, ref_out = _reference(run, nproc, root)
        out = root / "job"
        rng = random.Random(args.seed)
        steps = sorted(rng.sample(range(4, args.steps - 3), args.kills))
        t0 = time.monotonic()
        job = subprocess.Popen(_command(args.launcher, nproc, run, args.kills + 2, out), env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        killed = _kill_at(out, nproc, steps, rng, rng.randrange(args.kills), job, time.monotonic() + 1800)
        said, err = job.communicate(timeout=1800)
        record = run_dir.read_job(out) or {}
        result = {"layout": args.layout, "launcher": args.launcher, "nproc": nproc, "command": run,
                  "kills": killed, "exit": job.returncode, "seconds": time.monotonic() - t0,
                  "final": _final(said), "reference": reference, "equal_loss": _final(said) == reference,
                  "weights_checksum": _checksum(out) if job.returncode == 0 else None,
                  "reference_checksum": _checksum(ref_out),
                  "equal_weights": job.returncode == 0 and _equal(out, ref_out),
                  "restarts": re.findall(r"restart \d+ of job \S+ [^\n]*", said),
                  "recoveries": record.get("recoveries", []),
                  "stderr_tail": err[-1500:] if job.returncode else ""}
    return result


def corrupt(args) -> dict:
    nproc = 2
    run = [*TINY, "--dp", "2", "--steps", "30", "--eval-interval", "15", "--checkpoint-interval", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference, ref_out = _reference(run, nproc, root)
        out = root / "job"
        job = subprocess.Popen(_command("lattice", nproc, run, 2, out), env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            rows = _beats(out, nproc)
            if rows and min(s for s, _ in rows) >= 14:
                for _, pid in rows:
                    os.kill(pid, signal.SIGSTOP)  # hold the workers while their checkpoints are damaged
                break
            time.sleep(0.05)
        newest, before = sharded.complete(out)[-2:][::-1]
        shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        shard.write_bytes(raw)
        (before / sharded.MARKER).unlink()
        resumed_from = sharded.complete(out)[-2]  # the newest intact one
        for _, pid in rows:
            os.kill(pid, signal.SIGCONT)
        os.kill(rows[1][1], signal.SIGKILL)
        said, err = job.communicate(timeout=900)
        return {"damaged": {newest.name: "a flipped byte in " + shard.name, before.name: "its marker removed"},
                "exit": job.returncode, "said": [line for line in said.splitlines()
                                                 if line.startswith(("set aside", "restart", "recovered"))],
                "expected_resume": resumed_from.name, "final": _final(said), "reference": reference,
                "equal_loss": _final(said) == reference, "equal_weights": job.returncode == 0 and _equal(out, ref_out),
                "skipped_kept": sorted(p.name for p in (out / run_dir.SKIPPED_DIR).iterdir()),
                "stderr_tail": err[-1500:] if job.returncode else ""}


def agents(args) -> dict:
    run = [*TINY, "--dp", "4", "--steps", "40", "--eval-interval", "20", "--checkpoint-interval", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference, ref_out = _reference(run, 4, root)
        out = root / "job"
        port = 29500 + random.Random().randrange(1000)

        def agent() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                     "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                     f"localhost:{port}", "--rdzv-id", "two-agents", "--max-restarts", "5",
                                     "-m", "lattice", "train", *run, "--out-dir", str(out)],
                                    env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)

        first, second = agent(), agent()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (_beats(out, 4) and min(s for s, _ in _beats(out, 4)) >= 12):
            time.sleep(0.1)
        os.killpg(second.pid, signal.SIGKILL)  # the agent and its workers, as a node that died
        killed_at = time.time()
        time.sleep(2)
        third = agent()
        # an agent whose workers are done waits for the other in torchelastic's exit barrier
        # (exit_barrier_timeout, 300 s by default): each agent's end is recorded
        ended = {}
        for name, agent_process in (("first", first), ("restarted", third)):
            agent_process.wait(timeout=900)
            ended[name] = time.time()
        said, err = first.communicate()
        said3, err3 = third.communicate()
        second.communicate()
        trained = (run_dir.read_job(out) or {}).get("updated")
        return {"exit": [first.returncode, third.returncode], "killed_at": killed_at,
                "agents_ended_s_after_the_run": {k: round(v - trained, 1) for k, v in ended.items()} if trained else None,
                "said": [line for line in (said + said3).splitlines() if line.startswith(("restart", "recovered"))],
                "final": _final(said) or _final(said3), "reference": reference,
                "equal_loss": (_final(said) or _final(said3)) == reference,
                "equal_weights": _equal(out, ref_out), "stderr_tail": (err + err3)[-2000:]}


def recovery(args) -> dict:
    cases = {"default model, nproc 2 (dp 2)": (2, ["--dp", "2"]),
             "2d tp = 4 x dp = 2, nproc 8": (8, ["--mode", "2d", "--tp", "4", "--dp", "2"])}
    out_rows = {}
    for name, (nproc, layout) in cases.items():
        model = [] if nproc == 2 else ["--model", "tiny", "--batch-size", "8"]
        rows = []
        for trial in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "job"
                run = [*model, *layout, "--no-progress", "--steps", "100000", "--eval-interval", "1000000",
                       "--checkpoint-interval", "5", "--async-checkpoint"]
                job = subprocess.Popen(_command("lattice", nproc, run, 1, out), env=ENV, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True)
                rng = random.Random(trial)
                killed = _kill_at(out, nproc, [8 + rng.randrange(5)], rng, None, job, time.monotonic() + 900)
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline and not (run_dir.read_job(out) or {}).get("recoveries"):
                    time.sleep(0.2)
                os.killpg(job.pid, signal.SIGTERM)
                job.communicate(timeout=300)
                got = (run_dir.read_job(out) or {}).get("recoveries", [])
                if got:
                    rows.append({**got[0], "killed_at_step": killed[0]["step"] if killed else None})
        keys = ("seconds", "restart", "start-up", "load", "first step")
        out_rows[name] = {"trials": rows, "median": {k: statistics.median(r[k] for r in rows) for k in keys}
                          if rows else None}
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["soak", "corrupt", "agents", "recovery", "all"])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layout", choices=list(LAYOUTS), default="default")
    p.add_argument("--launcher", choices=["lattice", "torchrun"], default="lattice")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    results = {}
    if args.case in ("soak", "all"):
        results["soak"] = soak(args)
        if args.case == "all":
            for launcher, layout, kills in (("torchrun", "default", 3), ("lattice", "pp", 3), ("lattice", "cp", 3)):
                results[f"soak {launcher} {layout}"] = soak(argparse.Namespace(**{**vars(args), "launcher": launcher,
                                                                                 "layout": layout, "kills": kills}))
    if args.case in ("corrupt", "all"):
        results["corrupt"] = corrupt(args)
    if args.case in ("agents", "all"):
        results["agents"] = agents(args)
    if args.case in ("recovery", "all"):
        results["recovery"] = recovery(args)
    text = json.dumps({"provenance": provenance(), **results}, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
