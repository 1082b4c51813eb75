"""Run a benchmark's worker on N local processes (spawned, one gloo rank each) and collect
what each reports.

    rows = run_world(4, _worker, args)   # calls _worker(rank, 4, port, args, results) in each;
                                          # each worker puts its result on `results` once
"""

from __future__ import annotations

import socket


def run_world(n: int, worker, *args, timeout: float = 1800) -> list:
    """Start `worker(rank, n, port, *args, results)` on n spawned processes, with a free port
    for the rendezvous; return the n items they put on `results` (in arrival order)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, n, port, *args, results)) for rank in range(n)]
    for p in procs:
        p.start()
    out = [results.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join()
    return out
