import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import multiproc  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    multiproc.shutdown_all()


@pytest.fixture
def tiny_config():
    import lattice
    return lattice.GPTConfig(vocab_size=96, seq_len=16, d_model=24, n_heads=6, n_layers=2)
