"""This host's own rates for the cost model (`lattice plan --machine here`): the machine calibrated
here (lattice.calibration.calibrate, every rank of a gloo world at once, on GPT-2 `small` at a
batch of 8, as the `cpu-2core` preset was) at each world size a plan needs, and cached by host so
that the next plan reads them.

    machine, rates = host_machine([4])      # calibrates 1 and 4 ranks the first time (about 2 minutes on 2 cores)

The cache is one JSON file per host (its name, cores and torch version) under
$XDG_CACHE_HOME/lattice/machines (~/.cache/lattice/machines), a row of BY_WORLD_FIELDS per world
size with the time it was measured; `lattice plan --recalibrate` measures again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from lattice.cost.machine import BY_WORLD_FIELDS
from lattice.cost.machines import MACHINES, frozen
from lattice.parallel.context import LatticeConfigError

#: the most ranks one core is calibrated for (the planner validation's 8 ranks on 2 cores)
RANKS_PER_CORE = 4
#: the model and batch the rates are measured on (the `cpu-2core` preset's)
CALIBRATION_MODEL, CALIBRATION_BATCH = ("gpt2", "small"), 8
#: micro-benchmark repetitions (the median taken): as the presets were calibrated; at 2 the rates of
#: one host spread by up to a third between calibrations minutes apart
REPS = 5


def cores() -> int:
    return len(os.sched_getaffinity(0))


def cache_file() -> Path:
    """This host's cache: by host name, cores and torch version (a new torch may change the rates)."""
    import torch

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lattice" / "machines"
    return base / f"{socket.gethostname()}-{cores()}cores-torch{torch.__version__}.json"


def _calibrate_rank(reps: int) -> dict | None:
    import torch.distributed as dist

    from lattice.calibration.calibrate import calibrate
    from lattice.cost.model import model_config

    machine = calibrate(model_config(*CALIBRATION_MODEL, vocab_size=2048), CALIBRATION_BATCH, reps=reps)
    return {k: getattr(machine, k) for k in BY_WORLD_FIELDS if k != "ranks"} if dist.get_rank() == 0 else None


def read_cache(path: Path) -> dict:
    """The cached rows ({"rows": {world: {"row": {...}, "measured": ISO time, "seconds": s}}}), empty
    where there is no cache; a cache that does not parse is refused in one line."""
    if not path.exists():
        return {"rows": {}}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data.get("rows"), dict):
            raise ValueError("no rows")
        return data
    except (OSError, ValueError) as e:
        raise LatticeConfigError(f"the cached rates {path} cannot be read ({e}); delete the file, or pass "
                                 f"--recalibrate to measure again") from None


def _write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def host_machine(worlds, *, recalibrate: bool = False, log=print):
    """(the Machine of this host with a row for 1 rank and each of `worlds`, a line saying whose
    rates they are and how old): the cached rows, and any world size missing (all of them with
    `recalibrate`) calibrated now and added to the cache. A world of more than RANKS_PER_CORE
    ranks per core is refused: it is another machine, to be named by its preset."""
    from lattice.bench.world import spawn

    worlds = sorted({1, *worlds})
    most = RANKS_PER_CORE * cores()
    if worlds[-1] > most:
        raise LatticeConfigError(f"--machine here calibrates this host's ranks, and {worlds[-1]} ranks is more than "
                                 f"its {cores()} cores run ({most} at most); name the machine the plan is for "
                                 f"(--machine {', '.join(m for m in MACHINES if m != 'cpu-2core')})")
    path = cache_file()
    data = {"rows": {}} if recalibrate else read_cache(path)
    for world in worlds:
        if str(world) in data["rows"]:
            continue
        log(f"calibrating this host at {world} rank{'s' if world > 1 else ''} (once: cached in {path}) ...")
        start = time.perf_counter()
        row = spawn(world, _calibrate_rank, REPS, timeout=900)[0]
        data["rows"][str(world)] = {"row": row, "seconds": round(time.perf_counter() - start, 1),
                                    "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        _write_cache(path, data)
    rows = [(world, data["rows"][str(world)]) for world in worlds]
    base = {k: frozen(v) for k, v in rows[0][1]["row"].items()}
    by_world = tuple((world, *(frozen(entry["row"][k]) for k in BY_WORLD_FIELDS[1:])) for world, entry in rows)
    machine = dataclasses.replace(MACHINES["cpu-2core"], **base, by_world=by_world, cores=cores(),
                                  name=f"this host ({socket.gethostname()}, {cores()} cores, gloo, 1 thread per rank)")
    oldest = min(datetime.fromisoformat(entry["measured"]) for _, entry in rows)
    age = datetime.now(timezone.utc) - oldest
    counts = " and ".join(str(w) for w, _ in rows) + (" rank" if len(rows) == 1 else " ranks")
    return machine, (f"rates: this host's, calibrated at {counts} "
                     f"{_age(age.total_seconds())} ago ({path}; --recalibrate to measure again)")


def _age(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
