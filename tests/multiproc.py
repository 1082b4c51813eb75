"""Run a function on N gloo processes (CPU) from a test, with a timeout and every rank's traceback.

    from multiproc import run_distributed
    results = run_distributed(4, check_fn, arg)   # check_fn: a module-level function

Each world size's processes start once per test session and run many checks, so the suite stays
fast on 2 cores. A check that deadlocks fails after its timeout (the world is then killed and
restarted for the next check) instead of hanging CI; shortly before the deadline every rank dumps
its Python stacks (faulthandler), and the failure report shows where each stuck rank was. Inside a check, call `cached_init(...)`
rather than `lattice.init(...)` to reuse the process groups of an identical layout.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections import OrderedDict
from datetime import timedelta

DEFAULT_TIMEOUT = float(os.environ.get("LATTICE_TEST_TIMEOUT", "180"))
ERROR_GRACE = 5.0  # seconds to wait for the other ranks once one rank has failed
STACK_DUMP_BEFORE = 2.0  # seconds before a check's deadline at which every rank dumps its stacks


class DistributedCheckFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_file(port: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"lattice-test-stacks-{port}-{rank}.txt")


def _worker(rank: int, world: int, port: int, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=DEFAULT_TIMEOUT))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs, deadline = task
        with open(_stack_file(port, rank), "w") as stacks:
            # the parent's deadline is wall-clock time: a world still starting up dumps on time too
            faulthandler.dump_traceback_later(max(0.1, deadline - time.time() - STACK_DUMP_BEFORE), file=stacks)
            try:
                out = ("ok", fn(*args, **kwargs))
            except BaseException:  # report anything, including assertion failures, to the parent
                out = ("error", traceback.format_exc())
            finally:
                faulthandler.cancel_dump_traceback_later()
        if out[0] == "ok":  # after an error the ranks may disagree on which groups exist
            _destroy_groups_outside_the_cache()
        results.put((task_id, rank, out))
    dist.destroy_process_group()


class World:
    def __init__(self, size: int):
        self.size = size
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        port = self.port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()
        self.next_id = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, kwargs, timeout: float):
        self.next_id += 1
        task_id = self.next_id
        wall_deadline = time.time() + timeout
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs, wall_deadline))
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        first_error = None
        while len(got) < self.size:
            now = time.monotonic()
            if now > deadline or (first_error is not None and now > first_error + ERROR_GRACE):
                break
            try:
                tid, rank, out = self.results.get(timeout=0.5)
            except queue.Empty:
                if not self.alive():
                    break
                continue
            if tid != task_id:
                continue
            got[rank] = out
            if out[0] == "error" and first_error is None:
                first_error = time.monotonic()
        errors = {r: o[1] for r, o in got.items() if o[0] == "error"}
        missing = [r for r in range(self.size) if r not in got]
        if missing or errors:
            if missing:  # ranks still inside a collective: this world can't be reused
                self.close(force=True)
            report = [f"{fn.__name__} on {self.size} processes failed"]
            if missing:
                why = "died" if not self.alive() else f"no answer within {timeout:.0f}s (deadlock?)"
                report.append(f"ranks {missing}: {why}")
                for r in missing:
                    report.append(f"--- rank {r} stacks {STACK_DUMP_BEFORE:.0f}s before the deadline:\n{self.stacks(r)}")
            for r in sorted(errors):
                report.append(f"--- rank {r} traceback:\n{errors[r]}")
            raise DistributedCheckFailed("\n".join(report))
        return [got[r][1] for r in range(self.size)]

    def stacks(self, rank: int) -> str:
        try:
            with open(_stack_file(self.port, rank)) as f:
                return f.read().strip() or "(none dumped: the rank ended or died before the dump)"
        except FileNotFoundError:
            return "(no stack file)"

    def close(self, force: bool = False):
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self.procs = []


_worlds: dict[int, World] = {}


def run_distributed(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run fn(*args, **kwargs) on every rank of a gloo world of `world_size`; return per-rank results."""
    world = _worlds.get(world_size)
    if world is None or not world.procs or not world.alive():
        world = _worlds[world_size] = World(world_size)
    try:
        return world.run(fn, args, kwargs, timeout)
    finally:
        if not world.procs:
            _worlds.pop(world_size, None)


def shutdown_all():
    for world in list(_worlds.values()):
        world.close()
    _worlds.clear()


atexit.register(shutdown_all)

# Layouts whose process groups a worker keeps between checks. Every gloo group owns a transport
# thread that wakes 100 times a second even when idle (measured: 40 idle groups on 8 workers used
# 0.49 cores), and with every layout of the suite cached ~20 workers held dozens each; older
# layouts give their groups back.
KEEP_LAYOUTS = 2
_ctx_cache: OrderedDict = OrderedDict()  # layout key -> (context, the process groups its init created)


def _live_groups() -> set:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map) - {dist.group.WORLD}


def _destroy(groups) -> None:
    import torch.distributed as dist

    for group in groups:
        dist.destroy_process_group(group)


def _destroy_groups_outside_the_cache() -> None:
    """Groups a check created for itself (a plain lattice.init, a checkpointer's group): every
    rank ran the same check, so every rank destroys the same groups."""
    kept = set().union(*(groups for _, groups in _ctx_cache.values()))
    _destroy(_live_groups() - kept)


def cached_init(**kwargs):
    """lattice.init, memoised per layout inside a worker (process groups are costly to create);
    the KEEP_LAYOUTS most recently used layouts stay."""
    import lattice

    key = tuple(sorted(kwargs.items()))
    if key in _ctx_cache:
        _ctx_cache.move_to_end(key)
    else:
        before = _live_groups()
        ctx = lattice.init(**kwargs)
        _ctx_cache[key] = (ctx, _live_groups() - before)
        while len(_ctx_cache) > KEEP_LAYOUTS:
            _, (_, oldest_groups) = _ctx_cache.popitem(last=False)
            _destroy(oldest_groups)
    return _ctx_cache[key][0]
