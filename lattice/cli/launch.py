"""`--nproc N` without torchrun: the same command line re-run on N local processes through
torch.distributed.run's Python API.

With a build of torch without CUDA the workers are forked from this process, which has already
imported torch and lattice: a fresh interpreter spends about 4 s of CPU on those imports, which
N workers on a few cores pay N times over before the first step. With CUDA they start as fresh
interpreters (`python -m lattice`), as torchrun starts them: a process that has initialised CUDA
cannot be forked safely."""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

import torch



#: torch's switch that gives the workers' process group a store of its own, apart from the rendezvous's
SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def launch_local(nproc: int, argv: list[str], resume_hint: str | None = None, max_restarts: int = 0) -> int:
    """Re-run `lattice argv` on `nproc` local processes through torchrun's Python API
    (`elastic_launch`; its command-line parser would mistake our --nproc for --nproc-per-node).
    The caller has refused what it can before: a bad request fails once, in one line, instead of
    in every child's traceback. `resume_hint`: the command that continues a run stopped by a signal;
    `max_restarts`: how often the agent starts the workers again after one fails (each resumes its
    run's newest intact checkpoint: lattice.training.request.elastic_restart)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # as torchrun does: N processes with all the cores' threads each would oversubscribe the CPU;
    # set for the workers only (they inherit this process's environment), then restored, so that
    # a caller in the same process (a test, a notebook) keeps its own setting
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", SHARED_STORE)}
    # restarted workers that share the rendezvous store with their process group read the addresses
    # of the workers before them (pytorch#135712): a restart then fails at its first connection
    os.environ.setdefault(SHARED_STORE, "1")
    # torchrun's agent installs its own handlers in this process and leaves them: restored below
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    fork = not torch.backends.cuda.is_built()
    if fork:
        # tokenizers warns in every forked child that has not been told whether to use threads
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        sys.stdout.flush()  # (a child would write this process's unflushed output a second time)
        sys.stderr.flush()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          start_method="fork" if fork else "spawn")
    try:
        if fork:
            elastic_launch(config, _forked_worker)(argv, int(os.environ["OMP_NUM_THREADS"]), os.getpid())
        else:
            elastic_launch(config, sys.executable)("-m", "lattice", *argv)
    except ChildFailedError as e:
        print(f"error: {len(e.failures)} of {nproc} processes failed (their messages are above)", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent passed the signal on; the workers saved at a step boundary
        print(f"stopped by {e.sigval.name}: the workers saved a checkpoint; continue with: {resume_hint}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


# a command's exit status when SIGINT or SIGTERM stopped it (after its checkpoint was saved)
STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)
RESULT_HANDED_S = 0.5


def _leave_soon() -> None:
    """A worker stopped by a signal hands its result to the agent and waits until the agent has
    read it; but an agent that got the signal itself is shutting down, reads no result, and
    SIGKILLs its workers after 30 s. So the worker leaves by itself, with status 0, RESULT_HANDED_S
    after its command ended: by then its result is in the pipe (written as the command returns),
    where a live agent still reads it after the exit."""
    import threading

    def leave():
        time.sleep(RESULT_HANDED_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=leave, daemon=True, name="lattice-leave-after-signal").start()


def _forked_worker(argv: list[str], threads: int, launcher: int) -> None:
    """One worker forked from the launcher (process `launcher`): `python -m lattice argv` in this
    process, leaving with its exit status. OpenMP read OMP_NUM_THREADS when the launcher imported
    torch, so the workers' share is set here. After a successful command the agent's process
    keeps a worker waiting until the launcher has read every rank's result; a launcher killed
    meanwhile would leave it waiting for ever, so the SIGTERM that its death sends
    (faults.die_with_parent, asked for here for every command) ends it again, and one that died
    before that ends it here."""
    from lattice.training import faults

    # the agent's handlers, inherited through fork, would raise its SignalException in this worker
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faults.die_with_parent()
    torch.set_num_threads(threads)
    sys.argv = ["lattice", *argv]
    try:
        runpy.run_module("lattice", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code in STOPPED_BY_SIGNAL:  # saved and stopped: a clean end for the agent
            _leave_soon()
        elif stop.code:
            raise
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run's graceful stop is over
    if os.getppid() != launcher:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
