"""`--nproc N` without torchrun: the same command line re-run on N local processes through
torch.distributed.run's Python API."""

from __future__ import annotations

import os
import sys


def launch_local(nproc: int, argv: list[str], resume_hint: str | None = None) -> int:
    """Re-run `lattice argv` on `nproc` local processes through torchrun's Python API
    (`elastic_launch`; its command-line parser would mistake our --nproc for --nproc-per-node).
    The caller has refused what it can before: a bad request fails once, in one line, instead of
    in every child's traceback. `resume_hint`: the command that continues a run stopped by a signal."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # as torchrun does: N processes with all the cores' threads each would oversubscribe the CPU;
    # set for the workers only (they inherit this process's environment), then restored, so that
    # a caller in the same process (a test, a notebook) keeps its own setting
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "lattice", *argv)
    except ChildFailedError as e:
        print(f"error: {len(e.failures)} of {nproc} processes failed (their messages are above)", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent passed the signal on; the workers saved at a step boundary
        print(f"stopped by {e.sigval.name}: the workers saved a checkpoint; continue with: {resume_hint}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    return 0
