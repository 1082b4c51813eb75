"""`lattice plan --auto` at this host's own rates (`--machine here`) against the steps measured:
the host calibrated afresh (lattice.bench.host, as a first `plan --machine here` does), the plan
printed, and its first `--top` choices trained with the command the plan prints, timed in turns.

    python benchmarks/planner_here.py --gpus 4 --batch 8 --rounds 3 --repeat 3 -o benchmarks/results/planner_here.json

The model is the README's example, GPT-2 `small` (vocabulary 2048); each turn is `lattice train`
of 24 steps, and its step time the median over its steps after the fourth (tokens per second
from OUT/metrics.csv); a setup's time is the median of its turns. The error of a prediction is
(predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lattice.bench.provenance import provenance  # noqa: E402

STEPS, WARM = 24, 4


def _lattice(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "lattice", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"lattice {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def _step_seconds(command: str, batch: int, seq_len: int) -> float:
    """One turn: the plan's train command for STEPS steps, the median step after WARM."""
    words = shlex.split(command)[2:]  # after `lattice train`
    with tempfile.TemporaryDirectory() as out:
        _lattice("train", *words, "--steps", str(STEPS), "--eval-interval", str(10 ** 6), "--checkpoint-interval", "0",
                 "--no-progress", "--out-dir", out)
        with open(Path(out) / "metrics.csv") as f:
            rates = [float(row["tokens_per_s"]) for row in csv.DictReader(f)]
    return statistics.median(batch * seq_len / r for r in rates[WARM:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=2, help="the plan's first choices measured")
    p.add_argument("--repeat", type=int, default=1, help="calibrations, each followed by its plan and steps")
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    plan_args = ["plan", "--auto", "--model", "small", "--gpus", str(args.gpus), "--batch", str(args.batch),
                 "--machine", "here"]
    trials = [_trial(plan_args, args) for _ in range(args.repeat)]
    errors = [t["rows"][0]["error"] for t in trials]
    print(f"the first choice's error over {len(trials)} calibrations: {', '.join(f'{e:+.1%}' for e in errors)}; "
          f"median |error| {statistics.median(abs(e) for e in errors):.1%}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"provenance": provenance(), "plan": plan_args, "rounds": args.rounds, "trials": trials}, f,
                      indent=1)


def _trial(plan_args: list[str], args) -> dict:
    """Calibrate afresh, plan, and time the plan's first --top choices in turns."""
    start = time.perf_counter()
    _lattice(*plan_args, "--recalibrate")
    calibration_s = time.perf_counter() - start
    answer = json.loads(_lattice(*plan_args, "--json", "--top", str(args.top)))
    setups = answer["top"][:args.top]
    commands = [_train_command(setup, args) for setup in setups]
    times = [[] for _ in setups]
    for r in range(args.rounds):
        order = list(range(len(setups)))
        for k in order[r % len(order):] + order[:r % len(order)]:
            times[k].append(_step_seconds(commands[k], args.batch, answer["seq_len"]))
    rows = []
    print(answer["rates"])
    print(f"calibration (1 and {args.gpus} ranks, `--recalibrate`): {calibration_s:.0f} s")
    for setup, command, t in zip(setups, commands, times):
        measured = statistics.median(t)
        error = (setup["step_s"] - measured) / measured
        rows.append({"setup": setup["setup"], "command": command, "predicted_s": setup["step_s"],
                     "measured_s": measured, "turns_s": t, "error": error})
        print(f"{setup['setup']:<50} predicted {setup['step_s'] * 1e3:7.1f} ms  measured {measured * 1e3:7.1f} ms "
              f"(turns {', '.join(f'{x * 1e3:.1f}' for x in t)})  error {error:+.1%}", flush=True)
    return {"rates": answer["rates"], "calibration_s": calibration_s, "rows": rows}


def _train_command(setup: dict, args) -> str:
    """`lattice train` of one ranked setup, as `plan --auto` prints it for its first."""
    flags = setup["train_flags"]
    return f"lattice train --nproc {args.gpus} --arch gpt2 --model small --batch-size {args.batch} {flags}"


if __name__ == "__main__":
    main()
