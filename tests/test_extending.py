"""A layout is one file, and so is an architecture: a throwaway mode added as a single module under
lattice/modes/ (a variant of 1d under another name, with mesh axes of its own) and a throwaway
family added as a single module under lattice/models/ (GPT-2 with a ReLU MLP and no biases,
under another name) pass the conformance suite -- the family in every mode and in pipeline
stages, the mode with every family --, appear in `lattice train --help`, `lattice plan` and
`lattice info`, and train from the command line, with no edit anywhere else in the repository.
Both go into one copy of the repository, so the suite runs once for the two.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_conformance

import lattice
from lattice.modes import get_mode

REPO = Path(__file__).resolve().parents[1]
MODE, FAMILY, REFERENCE = "shard1d", "relugpt", "gpt2"


def _mode_source() -> str:
    """megatron1d.py renamed, its TP axis replaced by an Enum the file declares itself."""
    src = (REPO / "lattice" / "modes" / "megatron1d.py").read_text()
    src = src.replace('    name = "1d"', f'    name = "{MODE}"')
    src = src.replace('    peer = "dtensor"', "    peer = None")
    # one layout is enough to show the suite runs it (the 1d file declares five)
    start = src.index("    test_layouts = (")
    end = src.index("\n", src.index(")\n", start) + 1)
    src = src[:start] + '    test_layouts = ({"tp": 2, "dp": 2, "sequence_parallel": True},)' + src[end:]
    src = src.replace("MeshAxis.TP", "ShardAxis.SHARD")
    src = src.replace("from lattice.parallel.context import MeshAxis\n",
                      "import enum\n\nfrom lattice.parallel.context import MeshAxis  # noqa: F401\n\n\n"
                      "class ShardAxis(str, enum.Enum):\n    SHARD = \"shard\"\n")
    assert f'name = "{MODE}"' in src and "ShardAxis.SHARD" in src and "MeshAxis.TP" not in src
    return src



FAMILY_SOURCE = '''"""GPT-2 with a ReLU MLP and no biases: a family written as one file."""

from dataclasses import dataclass

import torch.nn as nn

from lattice.models import Model, ModelConfig, Parts, register
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
def extended_copy(tmp_path_factory):
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
    (root / "lattice" / "modes" / f"{MODE}.py").write_text(_mode_source())
    (root / "lattice" / "models" / f"{FAMILY}.py").write_text(FAMILY_SOURCE)
    return root


def test_the_new_modules_are_the_only_change(extended_copy):
    """Catches a registry that needs a second edit (a list of modes or families, a CLI choice) to
    see a new one."""
    status = _run(["git", "status", "--porcelain", "--untracked-files=all"], extended_copy).stdout
    assert sorted(status.split()) == sorted(["??", f"lattice/modes/{MODE}.py", "??", f"lattice/models/{FAMILY}.py"])


def test_the_new_mode_and_family_pass_the_conformance_suite(extended_copy, tmp_path):
    """Catches tooling that a new mode or family cannot plug into: the conformance checks run the
    family in every mode (the new one included) and in pipeline stages, and the mode with the
    reference family, against serial and their cost descriptions. The two files are imported
    from the copy into this session's registries (and its worker processes'), so the suite's
    running processes serve them; discovery from the package directory is the CLI test's."""
    plugins = (str(extended_copy / "lattice" / "modes" / f"{MODE}.py"),
               str(extended_copy / "lattice" / "models" / f"{FAMILY}.py"))
    with test_conformance.plugins_registered(plugins):
        modes = lattice.available_modes()
        assert MODE in modes and FAMILY in lattice.available_archs()
        exact = [(FAMILY, layout) for layout in test_conformance._layouts(FAMILY)]
        exact += [(FAMILY, dict(layout)) for layout in test_conformance.PIPELINE_LAYOUTS]
        exact += [(REFERENCE, {"mode": MODE, **layout}) for layout in get_mode(MODE).test_layouts]
        refusals = [(FAMILY, layout) for layout in test_conformance._layouts(FAMILY)]
        refusals += [(REFERENCE, {"mode": MODE, **layout}) for layout in get_mode(MODE).test_layouts]
        assert len({layout["mode"] for _, layout in exact}) == len(modes), "the family must run in every mode"
        for family, layout in exact:
            test_conformance.assert_layout_equals_serial(family, layout, plugins)
        for k, (family, layout) in enumerate(refusals):
            test_conformance.assert_refusals_and_round_trips(family, layout, tmp_path / str(k), plugins)
    assert MODE not in lattice.available_modes() and FAMILY not in lattice.available_archs(), "registries leaked"
    print(f"{FAMILY} in {len(modes)} modes and {len(test_conformance.PIPELINE_LAYOUTS)} pipeline layouts, {MODE} "
          f"with {REFERENCE}: {len(exact)} exactness and {len(refusals)} refusal/round-trip checks passed")


def test_the_new_mode_and_family_appear_in_the_commands_and_train(extended_copy):
    """Catches a CLI, planner or info command with a hard-coded list of modes or families, and a
    trainer, eval or run directory that cannot run a mode or hold a family it was not written
    for: the new family trains in the new mode."""
    root = extended_copy
    help_text = _run([sys.executable, "-m", "lattice", "train", "--help"], root).stdout
    assert MODE in help_text and FAMILY in help_text
    plan = _run([sys.executable, "-m", "lattice", "plan", "--mode", MODE, "--tp", "2"], root)
    assert plan.returncode == 0 and plan.stdout.startswith(f"{MODE} on dp=1 x shard=2"), plan.stdout + plan.stderr
    plan = _run([sys.executable, "-m", "lattice", "plan", "--arch", FAMILY, "--mode", "1d", "--tp", "2"], root)
    assert plan.returncode == 0 and "ReluConfig(" in plan.stdout, plan.stdout + plan.stderr
    info = _run([sys.executable, "-m", "lattice", "info", "--arch", FAMILY, "--mode", MODE, "--tp", "2"], root)
    assert info.returncode == 0 and "shard: [0, 1]" in info.stdout and f"model: {FAMILY} tiny" in info.stdout, \
        info.stdout + info.stderr
    assert "blocks.0.mlp.fc.weight" in info.stdout and "blocks.0.mlp.fc.bias" not in info.stdout
    train = _run([sys.executable, "-m", "lattice", "train", "--arch", FAMILY, "--mode", MODE, "--tp", "2", "--nproc", "2",
                  "--steps", "2", "--eval-interval", "2", "--no-progress", "--out-dir", str(root / "run")], root,
                 timeout=600)
    assert train.returncode == 0 and "final val loss" in train.stdout, train.stdout[-2000:] + train.stderr[-2000:]
    evaluated = _run([sys.executable, "-m", "lattice", "eval", str(root / "run")], root)  # the family read from the run
    assert evaluated.returncode == 0 and "val loss" in evaluated.stdout, evaluated.stdout + evaluated.stderr


def test_a_family_whose_config_lacks_a_shared_field_is_refused_when_it_registers():
    """Catches a family whose config omits a field the modes read (tie_embeddings, seq_len: the
    embedding and the head ask for them), which would otherwise fail with an AttributeError deep
    in a mode when the model is built."""
    import dataclasses

    from lattice.models.gpt2 import GPT, GPTConfig
    from lattice.models.registry import register

    fields = [(f.name, f.type, f) for f in dataclasses.fields(GPTConfig) if f.name != "tie_embeddings"]
    untied = dataclasses.make_dataclass("UntiedConfig", fields, bases=(lattice.models.ModelConfig,))
    family = type("Untied", (GPT,), {"name": "untied", "config_class": untied})
    with pytest.raises(TypeError, match="UntiedConfig does not declare tie_embeddings"):
        register(family)
    assert "untied" not in lattice.available_archs()
