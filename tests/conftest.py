import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import multiproc  # noqa: E402

# The suite's processes (up to 9 ranks, launched commands) outnumber the 2 cores, and OpenMP's
# threads spin at every barrier while the other core runs someone else: a serial resume check
# took 11.6 s at 2 threads and 4.7 s at 1 beside 3 busy processes. One thread here, and in the
# commands the tests launch (they inherit the environment).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_sessionfinish(session, exitstatus):
    multiproc.shutdown_all()


@pytest.fixture
def tiny_config():
    import lattice
    return lattice.GPTConfig(vocab_size=96, seq_len=16, d_model=24, n_heads=6, n_layers=2)
