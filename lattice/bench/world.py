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
from lattice.calibration.calibrate import calibrate
from lattice.models import arch_of_config, build_model, get_arch
from lattice.modes import REFERENCE_MODE


def _world(payload: dict):
    """Runs in every process of a world: prepare every mode, then time them with their steps
    interleaved round-robin (the order rotating each round), so that a change in the machine's
    load falls on all of them alike; calibrate just before and after the timing."""
    from lattice.modes.layout import context

    cfg = get_arch(payload["arch"]).config_class(**payload["cfg"])
    args = argparse.Namespace(**payload["args"])
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    serial = build_model(cfg, context(REFERENCE_MODE))
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


def _entry(rank: int, world: int, port: int, fn, args: tuple, queue, threads: int, timeout: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        queue.put(("ok", rank, fn(*args)))
        dist.destroy_process_group()
    except BaseException:  # report any failure, with its traceback, to the parent
        queue.put(("error", rank, traceback.format_exc()))
        raise


def spawn(n: int, fn, *args, timeout: float = 1800, threads: int = 1) -> list:
    """Run `fn(*args)` (a module-level function) on n spawned local processes, one gloo rank
    each, with the default process group created before the call and destroyed after it; return
    what each rank's call returned, by rank. The first failure raises RuntimeError with that
    rank's traceback, and a world that has not answered within `timeout` seconds is killed.
    `threads` per process: one by default, a rank being the CPU stand-in for one device.

    `lattice bench` and the scripts in benchmarks/ start their processes with it. `lattice
    train --nproc` uses torchrun's agent instead (the launcher users know, forwarding signals to
    workers that checkpoint on them), and the tests keep their worlds alive across checks and
    dump every rank's stacks before a deadline (tests/multiproc.py), which a one-call world needs
    neither of."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, n, port, fn, args, results, threads, timeout), daemon=True)
             for r in range(n)]
    for proc in procs:
        proc.start()
    out = {}
    try:
        while len(out) < n:
            try:
                status, rank, value = results.get(timeout=timeout)
            except queue_mod.Empty:
                raise RuntimeError(f"{n} processes gave {len(out)} results within {timeout:g} s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {n} processes failed:\n{value}")
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [out[r] for r in range(n)]


def run_world(p: int, payload: dict) -> dict:
    """The benchmark on p processes of this machine: rank 0's result."""
    try:
        return spawn(p, _world, payload, timeout=payload["timeout"])[0]
    except RuntimeError as e:
        raise RuntimeError(f"benchmark on {p} processes: {e}") from None


def bench_size(cfg, p: int, batch: int, args, *, serial: bool) -> dict:
    """Every applicable mode (and serial on rank 0 if asked) on p processes."""
    runs, skipped = applicable(cfg, batch, p, args.modes)
    if p == 1:
        runs, serial = [], True
    payload = {"arch": arch_of_config(cfg).name, "cfg": cfg.to_dict(), "runs": runs, "skipped": skipped, "reference": serial, "timeout": args.timeout,
               "args": {"batch": batch, **{k: getattr(args, k) for k in ("steps", "warmup", "seed", "calibrate",
                                                                         "activation_checkpointing")}}}
    return run_world(p, payload)
