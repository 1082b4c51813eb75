"""An architecture is one file: a throwaway family added as a single module under lattice/models/
(GPT-2 with a ReLU MLP and no biases, under another name) passes the conformance suite in every
mode and in pipeline stages, appears in `lattice train --help`, `lattice info` and `lattice plan`,
and trains from the command line with `--arch`, with no edit anywhere else in the repository.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAME = "relugpt"

FAMILY_SOURCE = '''"""GPT-2 with a ReLU MLP and no biases: a family written as one file."""

from dataclasses import dataclass

import torch.nn as nn

from lattice.models.base import Model, ModelConfig, Parts, register
from lattice.models.components import MLP, SelfAttention


@dataclass
class ReluConfig(ModelConfig):
    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 48
    n_heads: int = 6
    n_layers: int = 2
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = False

    presets = {"tiny": dict(seq_len=64, d_model=48, n_heads=6, n_layers=2),
               "small": dict(seq_len=128, d_model=96, n_heads=6, n_layers=2)}
    default_preset = "tiny"


class Block(nn.Module):
    def __init__(self, cfg, mode, seeds):
        super().__init__()
        self.ln_1 = mode.norm("layer", eps=1e-5, bias=False)
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, bias=False)
        self.ln_2 = mode.norm("layer", eps=1e-5, bias=False)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=4 * cfg.d_model, activation="relu", bias=False)

    def forward(self, x, cache=None, start=0):
        x = x + self.attn(self.ln_1(x), cache=cache, start=start)
        return x + self.mlp(self.ln_2(x))


@register
class ReluGPT(Model):
    name = "relugpt"
    config_class = ReluConfig
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=24, n_heads=4, n_layers=2),)

    def build(self):
        self.embed = self.mode.embedding()
        self.blocks = nn.ModuleList(Block(self.cfg, self.mode, self.seeds) for _ in range(self.cfg.n_layers))
        self.ln_f = self.mode.norm("layer", eps=1e-5, bias=False)
        self.head = self.mode.lm_head(self.embed)

    def embed_tokens(self, tokens, start=0):
        return self.embed(tokens, start)

    def finish(self, x):
        return self.ln_f(x)

    def head_loss(self, x, targets):
        return self.head.loss(x, targets)

    def head_logits(self, x):
        return self.head.logits(x)

    def parts(self):
        return Parts(first=("embed",), blocks="blocks", last=("ln_f", "head"), shared=("embed.wte",))

    def cost_layout(self, b):
        h = self.cfg.d_model
        b.embedding(positions=True)
        with b.layer():
            b.norm("layer", bias=False)
            b.linear(h, 3 * h, block="attention", position="in", bias=False)
            b.attention(heads=self.cfg.n_heads, kv_heads=self.cfg.n_heads, head_size=h // self.cfg.n_heads)
            b.linear(h, h, block="attention", position="out", bias=False, input_from_attention=True)
            b.norm("layer", bias=False)
            b.linear(h, 4 * h, block="mlp", position="in", bias=False)
            b.activation(4 * h, kind="relu")
            b.linear(4 * h, h, block="mlp", position="out", bias=False)
        b.norm("layer", bias=False)
        b.lm_head()
'''


def _run(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def copy_with_new_family(tmp_path_factory):
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
    (root / "lattice" / "models" / f"{NAME}.py").write_text(FAMILY_SOURCE)
    return root


def test_the_new_module_is_the_only_change(copy_with_new_family):
    """Catches a registry that needs a second edit (a list of families, a CLI choice) to see a family."""
    status = _run(["git", "status", "--porcelain", "--untracked-files=all"], copy_with_new_family).stdout
    assert status.split() == ["??", f"lattice/models/{NAME}.py"]


def test_the_new_family_passes_the_conformance_suite(copy_with_new_family):
    """Catches tooling a new family cannot plug into: the suite must find it and run it in every
    mode and in pipeline stages, against its serial model and its cost description."""
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py",
                "-k", NAME], copy_with_new_family, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = [line for line in out.stdout.splitlines() if "passed" in line][-1]
    modes = _run([sys.executable, "-c", "import lattice; print(len(lattice.available_modes()))"], copy_with_new_family)
    # every mode's first layout and two pipeline layouts for the exactness check, every mode for the refusals
    assert ran.startswith(f"{2 * int(modes.stdout) + 2} passed"), ran


def test_the_new_family_appears_in_the_commands_and_trains(copy_with_new_family):
    """Catches a CLI, planner or info command with a hard-coded family, and a trainer that cannot
    run a family it was not written for."""
    root = copy_with_new_family
    assert NAME in _run([sys.executable, "-m", "lattice", "train", "--help"], root).stdout
    plan = _run([sys.executable, "-m", "lattice", "plan", "--arch", NAME, "--mode", "1d", "--tp", "2"], root)
    assert plan.returncode == 0 and "ReluConfig(" in plan.stdout, plan.stdout + plan.stderr
    info = _run([sys.executable, "-m", "lattice", "info", "--arch", NAME, "--mode", "1d", "--tp", "2"], root)
    assert info.returncode == 0 and f"model: {NAME} tiny" in info.stdout, info.stdout + info.stderr
    assert "blocks.0.mlp.fc.weight" in info.stdout and "blocks.0.mlp.fc.bias" not in info.stdout
    train = _run([sys.executable, "-m", "lattice", "train", "--arch", NAME, "--mode", "1d", "--tp", "2", "--nproc", "2",
                  "--steps", "2", "--eval-interval", "2", "--no-progress", "--out-dir", str(root / "run")], root,
                 timeout=600)
    assert train.returncode == 0 and "final val loss" in train.stdout, train.stdout[-2000:] + train.stderr[-2000:]
    evaluated = _run([sys.executable, "-m", "lattice", "eval", str(root / "run")], root)
    assert evaluated.returncode == 0 and "val loss" in evaluated.stdout, evaluated.stdout + evaluated.stderr
