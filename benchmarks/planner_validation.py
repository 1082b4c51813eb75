"""The planner (`lattice plan --auto`) against measured step times on this machine: for each model
shape and world size p, the layouts the planner finds feasible are trained for a few steps each in
one world (the real Trainer: DDP or ZeRO, pipeline schedules, context parallelism), their steps
interleaved round-robin so that load changes fall on all alike; the step time is the median over
rounds of the slowest rank's mean step. Reported per case: whether the planner's first choice is
the measured best or within 5% of it, the Spearman rank correlation of predicted and measured
times, and over every run the median |error| of the predicted step time.

    python benchmarks/planner_validation.py --calibrate          # the cpu preset's rows (lattice.cost.machines)
    python benchmarks/planner_validation.py --ranks 4 -o benchmarks/results/planner_validation_p4.json  # one world size a file

The predictions use the `cpu-2core` machine preset with its rates calibrated afresh just before
each case is measured (`--preset`: as stored), by `--calibrate`'s micro-benchmarks (matrix
products, attention, elementwise operators, each collective between compute, AdamW) at that case's
shape, never from the step times judged here. The planner picks the layouts to measure with the
calibration before; then, since this machine's speed drifts by up to a fifth within minutes, the
three figures are judged at the mean of that calibration and one right after the measurement: the
planner ranks every feasible layout again at those rates for its first choice (where that one was
not measured it counts as a miss), and prices the measured ones for the Spearman and error
figures. The first choice at the calibration before is reported beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time

import lattice
from lattice.bench.provenance import provenance
from lattice.bench.world import spawn
from lattice.cost.machine import BY_WORLD_FIELDS
from lattice.cost.machines import frozen, machine_named
from lattice.cost import model_config
from lattice.planner.search import price, search

BATCH = 8
ROUNDS_RULE = "12 at 2 ranks, 5 above"  # the default rounds per case, as default_rounds gives them


def default_rounds(ranks: int) -> int:
    """Rounds per case at `ranks` ranks (ROUNDS_RULE): at 2 ranks each rank has a core of its own,
    so any other work on the host falls on one rank's steps alone and their medians move more from
    round to round. With 12 and 5 the Spearman figures came out 0.85-0.93 at 2 ranks and 0.95-0.98
    at 4 (2026-11-29), where 6 and 3 gave 0.78-0.93 and 0.87-0.94."""
    return 12 if ranks <= 2 else 5


#: the shapes: the gpt2 `small` preset, a wide and a deep GPT-2, and a Llama with grouped-query attention
SHAPES = {
    "gpt2-small": ("gpt2", {"model": "small"}),
    "gpt2-wide": ("gpt2", {"model": "small", "d_model": 384, "n_layers": 2, "seq_len": 64}),
    "gpt2-deep": ("gpt2", {"model": "small", "d_model": 96, "n_heads": 8, "n_layers": 8, "seq_len": 64}),
    "llama-gqa": ("llama", {"model": "small"}),
    # shapes the cpu-2core preset's rates were not fitted around: an encoder, an encoder-decoder and
    # a decoder on a long sequence
    "bert-small": ("bert", {"model": "small"}),
    "t5-small": ("t5", {"model": "small", "seq_len": 128, "target_len": 129, "d_model": 256, "n_heads": 8}),
    "gpt2-long": ("gpt2", {"model": "small", "n_layers": 2, "seq_len": 512}),
}


def _gib(mib: float | None) -> float | None:
    return mib / 1024 if mib else None


def _config(shape: str):
    arch, sizes = SHAPES[shape]
    return model_config(arch, sizes.get("model"), vocab_size=2048,
                        **{k: v for k, v in sizes.items() if k != "model"})


def _calibrate_world(shape: str) -> dict:
    import torch.distributed as dist

    from lattice.calibration.calibrate import calibrate

    machine = calibrate(_config(shape), BATCH)
    return vars(machine) if dist.get_rank() == 0 else {}


def _rows(shape: str, worlds: list[int], verbose: bool = False) -> list[tuple]:
    """`--calibrate`'s rows (BY_WORLD_FIELDS) of `shape` at each world size."""
    rows = []
    for n in worlds:
        m = spawn(n, _calibrate_world, shape, timeout=1800)[0]  # (8 ranks of a 512-token shape: over 10 minutes)
        rows.append(tuple(m[k] if k != "ranks" else n for k in BY_WORLD_FIELDS))
        if verbose:
            print(json.dumps(m), flush=True)
    return rows


def _mean_row(a: tuple, b: tuple) -> tuple:
    """The mean of two calibrations of one world size (rows of BY_WORLD_FIELDS), field by field and,
    in the collectives' column, collective by collective."""
    def mean(x, y):
        if isinstance(x, tuple):
            return tuple(mean(u, v) for u, v in zip(x, y))
        return x if isinstance(x, str) else (x + y) / 2

    assert a[0] == b[0], (a[0], b[0])
    return (a[0],) + tuple(mean(x, y) for x, y in zip(a[1:], b[1:]))


def _measure_world(shape: str, layouts: list[dict], rounds: int, steps: int) -> dict:
    """In a world of p ranks: `rounds` rounds of `steps` steps of each layout, each turn on a
    Trainer built for it (two steps of warm-up) whose process groups are destroyed after it: a
    gloo group polls even while idle (~0.05% of a core each; the 70 or so of 14 layouts' cost
    every rank 2-4% of a core), and at 8 ranks on 2 cores the groups of 12 idle layouts slowed the
    timed ones' steps by 13-15%, which a run of one layout does not pay."""
    import gc

    import torch
    import torch.distributed as dist

    from lattice.modes.layout import Layout
    from lattice.training.config import TrainConfig
    from lattice.training.trainer import Trainer

    arch, sizes = SHAPES[shape]

    def turn(record: dict) -> float:
        ctx = lattice.init(Layout(**record["layout"]))
        cfg = TrainConfig(arch=arch, **sizes, vocab_size=2048, batch_size=BATCH, steps=10 ** 6, warmup=1,
                          eval_interval=10 ** 6, checkpoint_interval=0, zero=record["zero"],
                          activation_checkpointing=record["activation_checkpointing"],
                          selective_checkpointing=record.get("selective_checkpointing", False))
        trainer = Trainer(cfg, ctx)
        for _ in range(2):  # warm-up
            trainer.train_step()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        mean = torch.tensor((time.perf_counter() - t) / steps, dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        del trainer
        gc.collect()
        ctx.destroy_groups()
        return float(mean)

    times = [[] for _ in layouts]
    for r in range(rounds):
        order = list(range(len(layouts)))
        for k in order[r % len(order):] + order[:r % len(order)]:
            times[k].append(turn(layouts[k]))
    return {"step_s": [statistics.median(t) for t in times], "rounds": times} if dist.get_rank() == 0 else {}


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def _chosen(ranked: list, limit: int) -> list:
    """The planner's first `limit` // 2 and the rest spread evenly over its ranking."""
    if len(ranked) <= limit:
        return ranked
    head = ranked[:limit // 2]
    rest = ranked[limit // 2:]
    step = len(rest) / (limit - len(head))
    return head + [rest[int(i * step)] for i in range(limit - len(head))]


def _first_over_best(ranked: list, runs: list[dict]) -> float:
    """The measured step of the planner's first choice in `ranked` over the best measured of `runs`
    (inf where that layout was not measured)."""
    measured = {r["setup"]: r["measured_s"] for r in runs}
    top = ranked[0].choice.describe()
    return measured[top] / min(measured.values()) if top in measured else math.inf


def _reprice(paths: list[str], out: str | None, preset: str, at_preset: bool = False) -> int:
    """Each measured layout of the runs in `paths` priced by the cost model as it is now, at its
    case's stored calibration (the one its predictions used) or, `at_preset`, at the preset's own
    rows as `lattice plan --machine` prices, beside the step measured then; the first choice is the
    model's top at those rates."""
    cases, errors = [], []
    base = machine_named(preset)
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for case in run["cases"]:
            cfg = _config(case["shape"])
            machine = base if at_preset else dataclasses.replace(base, by_world=frozen(case["by_world"]))
            plan = search(cfg, gpus=case["p"], machine=machine, batch=BATCH, ranks_per_node=case["p"],
                          precisions=(machine.precision,), memory_gib=_gib(case.get("memory_limit_mib")))
            now = {c.choice.describe(): c.step_s for c in plan.ranked}
            runs = [{**r, "predicted_s": now[r["setup"]]} for r in case["runs"] if r["setup"] in now]
            dropped = len(case["runs"]) - len(runs)
            predicted, measured = [r["predicted_s"] for r in runs], [r["measured_s"] for r in runs]
            errs = [(pr - me) / me for pr, me in zip(predicted, measured)]
            errors += errs
            cases.append({**case, "runs": runs, "spearman": _spearman(predicted, measured),
                          "first_over_best": _first_over_best(plan.ranked, case["runs"]),
                          "median_abs_error": statistics.median(map(abs, errs)), "repriced_from": path})
            print(f"{case['shape']} p={case['p']} ({path}): first choice / measured best "
                  f"{cases[-1]['first_over_best']:.3f}; "
                  f"Spearman {cases[-1]['spearman']:.2f}; median |error| {cases[-1]['median_abs_error']:.1%}"
                  + (f"; {dropped} measured layout{'s' * (dropped > 1)} the search no longer lists" if dropped else ""), flush=True)
    summary = {"cases": len(cases), "first_choice_within_5pct": sum(c["first_over_best"] <= 1.05 for c in cases),
               "spearman_min": min(c["spearman"] for c in cases), "spearman_at_least_0.8": sum(
                   c["spearman"] >= 0.8 for c in cases),
               "median_abs_error": statistics.median(map(abs, errors)), "runs": len(errors)}
    print(f"first choice within 5% of the measured best: {summary['first_choice_within_5pct']} of {len(cases)} cases; "
          f"Spearman min {summary['spearman_min']:.2f} (>= 0.8 in {summary['spearman_at_least_0.8']}); median |error| "
          f"{summary['median_abs_error']:.1%} over {len(errors)} runs")
    if out:
        with open(out, "w") as f:
            calibration = f"the {preset} preset's" if at_preset else "stored, per case"
            json.dump({"provenance": provenance(), "machine": "repriced", "calibration": calibration,
                       "summary": summary, "cases": cases}, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--ranks", default="2,4,8", help="world sizes (comma-separated)")
    p.add_argument("--limit", type=int, default=14, help="layouts measured per case (the planner's top half of them, "
                                                          "the rest spread over its ranking)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds per case (default: {ROUNDS_RULE}; at 2 ranks each rank has a core of its own, so "
                        f"any other work on the host falls on one rank's steps alone)")
    p.add_argument("--steps", type=int, default=3, help="steps per layout per round")
    p.add_argument("--machine", default="cpu-2core")
    p.add_argument("--memory-mib", type=float, default=None,
                   help="a memory limit per rank for the planner (MiB): the layouts it finds feasible under it, "
                        "with ZeRO stages, activation checkpointing and accumulation, are the ones measured")
    p.add_argument("--preset", action="store_true", help="predict with the preset's rates as stored (default: "
                                                          "calibrated afresh before each case; with --reprice: "
                                                          "the stored calibration of each case)")
    p.add_argument("--calibrate", action="store_true", help="print the calibration rows of each world size and stop")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each case in this many separate worlds (the median is judged) and report how well "
                        "the repeats agree with each other: the ceiling of the Spearman and error figures")
    p.add_argument("-o", "--out", default=None)
    p.add_argument("--reprice", nargs="+", metavar="RUN.json",
                   help="price the layouts of earlier runs again with the model as it is now, at each case's stored "
                        "calibration (with --preset, at the preset's own rows), and report the figures (no step is "
                        "measured; a first choice the run did not measure counts as a miss)")
    args = p.parse_args()
    if args.reprice:
        return _reprice(args.reprice, args.out, args.machine, at_preset=args.preset)
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.calibrate:
        rows = _rows("gpt2-small", [1] + ranks, verbose=True)
        print("by_world =", json.dumps(rows))
        return 0
    preset = machine_named(args.machine)
    cases, errors = [], []
    for shape in args.shapes.split(","):
        cfg = _config(shape)
        for n in ranks:
            # this machine's speed drifts by up to a fifth within an hour (other work on its host), so
            # by default the rates are calibrated afresh, on this shape, just before its steps are timed
            machine = preset if args.preset else dataclasses.replace(
                preset, by_world=tuple(_rows(shape, sorted({preset.cores or n, n}))))
            plan = search(cfg, gpus=n, machine=machine, batch=BATCH, ranks_per_node=n,
                          precisions=(machine.precision,), memory_gib=_gib(args.memory_mib))
            chosen, feasible = _chosen(plan.ranked, args.limit), len(plan.ranked)
            layouts = [{"layout": c.choice.layout.record(), "zero": c.choice.zero,
                        "activation_checkpointing": c.choice.checkpointing,
                        "selective_checkpointing": c.choice.selective} for c in chosen]
            started = time.time()
            rounds = args.rounds or default_rounds(n)
            repeats = [spawn(n, _measure_world, shape, layouts, rounds, args.steps, timeout=3600)[0]["step_s"]
                       for _ in range(args.repeat)]
            measured = [statistics.median(times) for times in zip(*repeats)]
            first_before = None
            if not args.preset:  # the machine's speed drifts while the steps are timed: calibrated again after
                # them, the planner ranks and prices at the mean of the rates before and after
                machine = dataclasses.replace(machine, by_world=tuple(
                    _mean_row(a, b) for a, b in zip(machine.by_world, _rows(shape, sorted({preset.cores or n, n})))))
                chosen = [price(cfg, c.choice, batch=BATCH, machine=machine) for c in chosen]
                first_before = measured[0] / min(measured)
                plan = search(cfg, gpus=n, machine=machine, batch=BATCH, ranks_per_node=n,
                              precisions=(machine.precision,), memory_gib=_gib(args.memory_mib))
            predicted = [c.step_s for c in chosen]
            # the planner's first choice against the measured best
            first = _first_over_best(plan.ranked, [{"setup": c.choice.describe(), "measured_s": me}
                                                   for c, me in zip(chosen, measured)])
            rho = _spearman(predicted, measured)
            errs = [(pr - me) / me for pr, me in zip(predicted, measured)]
            errors += errs
            case = {"shape": shape, "p": n, "config": repr(cfg), "memory_limit_mib": args.memory_mib,
                    "candidates": feasible, "measured": len(chosen),
                    "rounds": rounds, "first_over_best": first, "first_over_best_before": first_before,
                    "spearman": rho, "median_abs_error": statistics.median(map(abs, errs)),
                    "seconds": time.time() - started, "by_world": [list(row) for row in machine.by_world],
                    "runs": [{"setup": c.choice.describe(), "predicted_s": pr, "measured_s": me}
                             for c, pr, me in zip(chosen, predicted, measured)]}
            if args.repeat > 1:  # the same layouts measured again: how far the measurement agrees with itself
                again = list(itertools.combinations(repeats, 2))
                case.update(repeats=repeats, repeat_spearman=min(_spearman(a, b) for a, b in again),
                            repeat_median_abs_difference=statistics.median(
                                abs(x - y) / ((x + y) / 2) for a, b in again for x, y in zip(a, b)))
                print(f"{shape} p={n}: {args.repeat} repeats agree with Spearman {case['repeat_spearman']:.2f}, "
                      f"median |difference| {case['repeat_median_abs_difference']:.1%}", flush=True)
            cases.append(case)
            print(f"{shape} p={n}" + (f" under {args.memory_mib:g} MiB" if args.memory_mib else "")
                  + f": {feasible} feasible, {len(chosen)} measured; first choice / measured best "
                  f"{first:.3f}" + (f" (at the calibration before: {first_before:.3f})" if first_before else "")
                  + f"; Spearman {rho:.2f}; median |error| {case['median_abs_error']:.1%} "
                  f"({case['seconds']:.0f} s)", flush=True)
            for run in sorted(case["runs"], key=lambda r: r["measured_s"]):
                print(f"    {run['measured_s'] * 1e3:8.1f} ms measured {run['predicted_s'] * 1e3:8.1f} ms predicted  "
                      f"{run['setup']}", flush=True)
            if args.out:  # after every case, so that a run cut short leaves the cases it finished
                _write(args.out, preset.name, args, cases, errors)
    summary = _summary(cases, errors)  # (the JSON was written after the last case)
    within = summary["first_choice_within_5pct"]
    before = summary.get("first_choice_within_5pct_before")
    print(f"first choice within 5% of the measured best: {within} of {len(cases)} cases"
          + (f" (at the calibration before: {before})" if before is not None else "") + "; Spearman min "
          f"{summary['spearman_min']:.2f} (>= 0.8 in {summary['spearman_at_least_0.8']}); median |error| "
          f"{summary['median_abs_error']:.1%} over {len(errors)} runs")
    if args.repeat > 1:
        print(f"repeats against each other: Spearman min {summary['repeat_spearman_min']:.2f} (below 0.8 in "
              f"{summary['repeat_spearman_below_0.8']} of {len(cases)} cases); median |difference| "
              f"{summary['repeat_median_abs_difference']:.1%}")
    return 0


def _summary(cases: list[dict], errors: list[float]) -> dict:
    summary = {"cases": len(cases), "first_choice_within_5pct": sum(c["first_over_best"] <= 1.05 for c in cases),
               "spearman_min": min(c["spearman"] for c in cases),
               "spearman_at_least_0.8": sum(c["spearman"] >= 0.8 for c in cases),
               "median_abs_error": statistics.median(map(abs, errors)), "runs": len(errors)}
    if cases[0].get("first_over_best_before") is not None:
        summary["first_choice_within_5pct_before"] = sum(c["first_over_best_before"] <= 1.05 for c in cases)
    if "repeat_spearman" in cases[0]:
        summary["repeat_spearman_min"] = min(c["repeat_spearman"] for c in cases)
        summary["repeat_spearman_below_0.8"] = sum(c["repeat_spearman"] < 0.8 for c in cases)
        summary["repeat_median_abs_difference"] = statistics.median(c["repeat_median_abs_difference"] for c in cases)
    return summary


def _write(path: str, machine: str, args, cases: list[dict], errors: list[float]) -> None:
    with open(path, "w") as f:
        json.dump({"provenance": provenance(), "machine": machine,
                   "calibration": "stored" if args.preset else "fresh, per case",
                   "rounds": args.rounds or ROUNDS_RULE, "summary": _summary(cases, errors),
                   "cases": cases}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
