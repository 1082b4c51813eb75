"""The processes of `lattice bench`: one gloo world per process count on this machine, in which
every applicable mode is prepared and timed with its steps interleaved round-robin."""

from __future__ import annotations

import argparse
import math
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from lattice import cost as costmodel
from lattice.bench.measure import Prepared, applicable, prepare, report_row
from lattice.cost.calibrate import calibrate
from lattice.models import arch_of_config, build_model, get_arch
from lattice.modes import REFERENCE_MODE


def _world(payload: dict):
    """Runs in every process of a world: prepare every mode, then time them with their steps
    interleaved round-robin (the order rotating each round), so that a change in the machine's
    load falls on all of them alike; calibrate just before and after the timing."""
    import lattice

    cfg = get_arch(payload["arch"]).config_class(**payload["cfg"])
    args = argparse.Namespace(**payload["args"])
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    serial = build_model(cfg, lattice.plan(REFERENCE_MODE))
    sd = serial.full_state_dict()
    with torch.no_grad():
        ref_loss = float(serial(tokens, targets))
    del serial
    jobs = ([(REFERENCE_MODE, REFERENCE_MODE, {})] if payload["reference"] else []) + list(payload["runs"])
    prepared = [prepare(label, mode, options, cfg, sd, tokens, targets, ref_loss, args) for label, mode, options in jobs]
    runs = [r for r in prepared if isinstance(r, Prepared)]
    machines = [calibrate(cfg, args.batch)] if args.calibrate else []
    for i in range(args.warmup + args.steps):
        for k in range(len(runs)):
            runs[(i + k) % len(runs)].step(record=i >= args.warmup)
    if args.calibrate:
        machines.append(calibrate(cfg, args.batch))
    gathered = []
    for run in runs:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"times": run.times, **run.info})
        gathered.append(everyone)
    if dist.get_rank() != 0:
        return None
    machine = _mean_machine(machines) if machines else None
    rows = []
    for item in prepared:
        if not isinstance(item, Prepared):
            rows.append(item)
            continue
        row = report_row(item, gathered[runs.index(item)])
        # serial runs alone on rank 0 of a larger world, not under the calibration's sharing
        if machine is not None and (item.mode != REFERENCE_MODE or dist.get_world_size() == 1):
            row.update({k + "_pred_s": v for k, v in item.analytic.time(machine).items()})
        rows.append(row)
    return {"p": dist.get_world_size(), "cfg": payload["cfg"], "batch": args.batch, "rows": rows,
            "skipped": payload["skipped"], "calibration": None if machine is None else vars(machine),
            "calibrations": [vars(m) for m in machines]}


def _mean_machine(machines: list[costmodel.Machine]) -> costmodel.Machine:
    """Geometric mean of the calibrations before and after the timed steps."""
    fields = {k: v for k, v in vars(machines[0]).items()}
    for k, v in fields.items():
        if isinstance(v, float):
            fields[k] = math.prod(vars(m)[k] for m in machines) ** (1 / len(machines))
    return costmodel.Machine(**fields)


def _entry(rank, world, port, payload, queue, threads):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=payload["timeout"]))
        out = _world(payload)
        if rank == 0:
            queue.put(("ok", out))
        dist.destroy_process_group()
    except BaseException:  # report any failure, with its traceback, to the parent
        queue.put(("error", rank, traceback.format_exc()))
        raise


def run_world(p: int, payload: dict) -> dict:
    """Start p gloo processes on this machine, run the benchmark in them, return rank 0's result."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one thread per rank: a rank is one core, the CPU stand-in for one device
    procs = [ctx.Process(target=_entry, args=(r, p, port, payload, results, 1), daemon=True) for r in range(p)]
    for proc in procs:
        proc.start()
    try:
        msg = results.get(timeout=payload["timeout"])
    except queue_mod.Empty:
        msg = ("error", "?", f"no result within {payload['timeout']} s")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if msg[0] != "ok":
        raise RuntimeError(f"benchmark on {p} processes failed on rank {msg[1]}:\n{msg[2]}")
    return msg[1]


def bench_size(cfg, p: int, batch: int, args, *, serial: bool) -> dict:
    """Every applicable mode (and serial on rank 0 if asked) on p processes."""
    runs, skipped = applicable(cfg, batch, p, args.modes)
    if p == 1:
        runs, serial = [], True
    payload = {"arch": arch_of_config(cfg).name, "cfg": cfg.to_dict(), "runs": runs, "skipped": skipped, "reference": serial, "timeout": args.timeout,
               "args": {"batch": batch, **{k: getattr(args, k) for k in ("steps", "warmup", "seed", "calibrate",
                                                                         "activation_checkpointing")}}}
    return run_world(p, payload)
