"""A layout is one file: a throwaway mode added as a single module under lattice/modes/ (a
variant of 1d under another name, with mesh axes of its own) passes the conformance suite,
appears in `lattice train --help`, `lattice plan` and `lattice info`, and trains from the command
line, with no edit anywhere else in the repository.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAME = "shard1d"


def _mode_source() -> str:
    """megatron1d.py renamed, its TP axis replaced by an Enum the file declares itself."""
    src = (REPO / "lattice" / "modes" / "megatron1d.py").read_text()
    src = src.replace('    name = "1d"', f'    name = "{NAME}"')
    src = src.replace('    peer = "dtensor"', "    peer = None")
    src = src.replace("MeshAxis.TP", "ShardAxis.SHARD")
    src = src.replace("from lattice.context import MeshAxis\n",
                      "import enum\n\nfrom lattice.context import MeshAxis  # noqa: F401\n\n\n"
                      "class ShardAxis(str, enum.Enum):\n    SHARD = \"shard\"\n")
    assert f'name = "{NAME}"' in src and "ShardAxis.SHARD" in src and "MeshAxis.TP" not in src
    return src


def _run(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def copy_with_new_mode(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    for part in ("lattice", "tests", "pyproject.toml", "README.md"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / part,
                                                           **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                              if src.is_dir() else {}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    assert _run(git + ["init", "-q"], root).returncode == 0
    assert _run(git + ["add", "-A"], root).returncode == 0
    assert _run(git + ["commit", "-qm", "base"], root).returncode == 0
    (root / "lattice" / "modes" / f"{NAME}.py").write_text(_mode_source())
    return root


def test_the_new_module_is_the_only_change(copy_with_new_mode):
    """Catches a registry that needs a second edit (a list of modes, a CLI choice) to see a mode."""
    status = _run(["git", "status", "--porcelain", "--untracked-files=all"], copy_with_new_mode).stdout
    assert status.split() == ["??", f"lattice/modes/{NAME}.py"]


def test_the_new_mode_passes_the_conformance_suite(copy_with_new_mode):
    """Catches tooling that a new mode cannot plug into: the suite must find it and its layouts."""
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py",
                "-k", NAME], copy_with_new_mode, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_the_new_mode_appears_in_the_commands_and_trains(copy_with_new_mode):
    """Catches a CLI, planner or info command with a hard-coded list of modes, and a trainer that
    cannot run a mode it was not written for."""
    root = copy_with_new_mode
    assert NAME in _run([sys.executable, "-m", "lattice", "train", "--help"], root).stdout
    plan = _run([sys.executable, "-m", "lattice", "plan", "--mode", NAME, "--tp", "2"], root)
    assert plan.returncode == 0 and plan.stdout.startswith(f"{NAME} on dp=1 x shard=2"), plan.stdout + plan.stderr
    info = _run([sys.executable, "-m", "lattice", "info", "--mode", NAME, "--tp", "2", "--model", "tiny"], root)
    assert info.returncode == 0 and "shard: [0, 1]" in info.stdout, info.stdout + info.stderr
    train = _run([sys.executable, "-m", "lattice", "train", "--mode", NAME, "--tp", "2", "--nproc", "2",
                  "--model", "tiny", "--steps", "2", "--eval-interval", "2", "--no-progress",
                  "--out-dir", str(root / "run")], root, timeout=600)
    assert train.returncode == 0 and "final val loss" in train.stdout, train.stdout[-2000:] + train.stderr[-2000:]
