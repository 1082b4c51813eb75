"""The `lattice` command: train (in process and on 2 launched processes), info, and the
delegated bench/plan subcommands."""

import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import lattice
from lattice.cli import main as cli
from lattice.data.corpus import load_corpus
from lattice.modes.options import given_mode_options

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1",
             "--no-progress"]


def test_info_prints_groups_and_every_parameter_slice(capsys):
    """Catches an info command that starts processes, misses parameters, or prints wrong groups:
    serial with dp=2 has one dp group [0, 1] and every parameter whole on both ranks."""
    assert cli.main(["info", "--mode", "serial", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp: [0, 1]" in out and "rank 1: dp=1" in out
    serial = lattice.GPT(lattice.GPTConfig.preset("small", vocab_size=2048), lattice.init("serial"))
    lines = out.splitlines()
    for name, p in serial.named_parameters():
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name} {list(p.shape)}"))
        assert lines[at + 1].strip() == f"[{', '.join(':' for _ in p.shape)}] on ranks [0, 1]"


def test_train_prints_final_val_loss_and_unigram_baseline(tmp_path, capsys):
    """Catches a train command that does not finish, skips the final evaluation, or reports a
    baseline other than the unigram cross-entropy of the validation split."""
    args = ["train", *TINY_ARGS, "--steps", "3", "--out-dir", str(tmp_path)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    val = next(line for line in lines if line.startswith("final val loss:"))
    base = next(line for line in lines if line.startswith("unigram baseline:"))
    corpus = load_corpus(512)
    counts, total = Counter(corpus.train.tolist()), len(corpus.train) + 512
    expect = -sum(math.log((counts[t] + 1) / total) for t in corpus.val.tolist()) / len(corpus.val)
    assert float(base.split()[2]) == pytest.approx(expect, abs=1e-4)
    assert 0 < float(val.split()[3]) < 10
    assert lattice.checkpoint.read(tmp_path)["step"] == 3 and (tmp_path / "metrics.csv").exists()


def test_train_on_two_launched_processes(tmp_path):
    """Catches a --nproc launch that hangs, runs every rank as rank 0 (printing the result twice),
    or mistakes our options for torchrun's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "lattice", "train", "--nproc", "2", "--dp", "2", "--steps", "2", *TINY_ARGS,
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("final val loss:") == 1 and proc.stdout.count("unigram baseline:") == 1
    assert lattice.checkpoint.read(tmp_path)["step"] == 2


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh-interpreters"])
def test_both_ways_of_starting_local_workers_train_as_serial_does(fresh, tmp_path, capfd, monkeypatch):
    """Catches a --nproc launch whose workers, forked from the launcher (torch built without CUDA)
    or started as fresh interpreters (with CUDA; forced here by a torch that says it has CUDA),
    hang, print the result once per rank, or train otherwise than serial: both print serial's
    final validation loss, once, in a relative --out-dir."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--steps", "2", "--eval-interval", "2", *TINY_ARGS]
    assert cli.main([*args, "--out-dir", "serial"]) == 0
    serial = re.search(r"final val loss: ([\d.]+)", capfd.readouterr().out).group(1)
    if fresh:
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
        monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert cli.main([*args, "--nproc", "2", "--dp", "2", "--out-dir", "launched"]) == 0
    out = capfd.readouterr().out
    assert out.count("final val loss:") == 1 and out.count("config: ") == 1, out
    assert re.search(r"final val loss: ([\d.]+)", out).group(1) == serial, out
    assert lattice.checkpoint.read(tmp_path / "launched")["step"] == 2


def test_layout_that_needs_other_process_count_is_refused_before_launch(capsys):
    """Catches a launch of processes for a layout that cannot run (they would all fail or hang)."""
    assert cli.main(["train", "--nproc", "3", "--dp", "2", *TINY_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--nproc 3 does not match" in err and "use --nproc 2" in err


def test_a_layout_of_several_ranks_in_one_process_names_nproc(capsys):
    """Catches `lattice train --dp 4` (as `plan --auto` used to print it) in one process being
    refused with torchrun's --nproc-per-node only, which `lattice train` does not take."""
    assert cli.main(["train", "--dp", "4", *TINY_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "dp=4 has 4 ranks" in err and "add --nproc 4" in err
    assert "torchrun --nproc-per-node 4 -m lattice train" in err


def test_config_file_round_trip_and_command_line_override(tmp_path, capsys):
    """Catches a config file that is ignored, overrides the command line, or cannot be read back
    from what a run saved (config.toml in the out-dir)."""
    run1 = tmp_path / "a"
    (tmp_path / "run.toml").write_text('steps = 3\nlr = 0.004\nmodel = "tiny"\nvocab-size = 512\nbatch_size = 4\n'
                                       'eval_batches = 1\nno_progress = true\nd_model = 24\nn_heads = 4\n')
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--steps", "2", "--out-dir", str(run1)]) == 0
    out = capsys.readouterr().out
    assert "steps=2" in out and "lr=0.004" in out and "d_model=24" in out  # the file, with --steps from the command line
    saved = lattice.checkpoint.read(run1)
    assert saved["step"] == 2 and saved["train_config"]["lr"] == 0.004 and saved["model_config"]["d_model"] == 24
    # the saved config reproduces the run
    run2 = tmp_path / "b"
    assert cli.main(["train", "--config", str(run1 / "config.toml"), "--out-dir", str(run2)]) == 0
    again = lattice.checkpoint.read(run2)
    assert again["train_config"] == {**saved["train_config"], "out_dir": str(run2)}
    weights, saved_weights = lattice.checkpoint.full_model(again), lattice.checkpoint.full_model(saved)
    assert all(torch.equal(weights[k], v) for k, v in saved_weights.items())
    (tmp_path / "bad.toml").write_text("stepz = 3\n")
    assert cli.main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    assert "unknown keys ['stepz']" in capsys.readouterr().err


def _other_value(f, default):
    """A valid value of a TrainConfig flag field other than its default."""
    kind = f.type.split(" |")[0]
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"]() if c != default)
    return {"bool": lambda: not default, "int": lambda: (default or 0) + 2, "float": lambda: default / 2 if default else 0.5,  # (inside every range)
            "str": lambda: f"{default or ''}x"}[kind]()


def test_every_layout_and_train_field_round_trips_through_config_toml(tmp_path):
    """Catches a Layout or TrainConfig field that the flags, the run's config.toml or `--config`
    drop or rename (a field read back at its default instead of the run's value): a run with
    every field away from its default, and family sizes given (a bool set to False among them),
    is written as config.toml and read back through `--config` to the same Layout and
    TrainConfig."""
    from dataclasses import fields

    from lattice.cli.arguments import layout_from_args, train_request, with_config_file
    from lattice.training.config import config_toml, run_config
    from lattice.training.trainer import TrainConfig

    layout = lattice.Layout("1d", tp=2, dp=2, pp=2, microbatches=4, pp_schedule="interleaved", pp_virtual=2,
                            pp_layers=(1, 2, 1, 1), pp_scatter_gather=False, options={"sequence_parallel": True},
                            ranks_per_node=2)
    set_elsewhere = {"data_hash", "model_from", "model_sizes"}  # by the trainer, by --resume, by the size flags
    changed = {f.name: _other_value(f, f.default) for f in fields(TrainConfig) if f.name not in set_elsewhere}
    changed.update(zero=3)  # (whose resharding flags are among the fields)
    changed.update(arch="llama", model="tiny", batch_size=8, target_len=None,  # an encoder-decoder's: below
                   model_sizes={"n_kv_heads": 2, "norm_eps": 1e-6, "tie_embeddings": True})
    # bf16 weights exclude autocast and float64 weights, and the two recomputations each other: the second
    # run has those, the first the others; an encoder-decoder packs no documents
    mixed = {"precision": changed.pop("precision"), "grad_reduce_dtype": changed.pop("grad_reduce_dtype"),
             "selective_checkpointing": changed.pop("selective_checkpointing"), "activation_checkpointing": False}
    for tcfg in (TrainConfig(**changed), TrainConfig(**{**changed, "arch": "t5", "task": "seq2seq", "target_len": 12,
                                                        **mixed, "bf16": False, "dtype": "float32", "pack_documents": False,
                                                        "model_sizes": {"d_ff": 40, "tie_embeddings": False}})):
        (tmp_path / "run.toml").write_text(config_toml(run_config(layout, tcfg)))
        args = with_config_file(["train", "--config", str(tmp_path / "run.toml")], str(tmp_path / "run.toml"))
        assert layout_from_args(args) == layout
        assert train_request(args).config() == tcfg


def test_a_single_file_run_directory_resumes_exactly_through_the_sharded_form(tmp_path, capsys):
    """Catches `--resume` of a run directory holding OUT/ckpt.pt (what runs wrote before training
    wrote only sharded checkpoints; now `lattice convert`'s export) failing, or converting
    anything inexactly (moments, step, dropout count, RNG): 2 steps exported to one file, then
    2 more resumed from it, equal 4 steps resumed from the sharded checkpoint itself."""
    common = ["train", *TINY_ARGS, "--dropout", "0.1", "--eval-interval", "2", "--steps", "4"]
    assert cli.main([*common, "--steps", "2", "--out-dir", str(tmp_path / "a")]) == 0
    old_style = tmp_path / "old"
    old_style.mkdir()
    assert cli.main(["convert", str(tmp_path / "a"), str(old_style / "ckpt.pt")]) == 0
    assert cli.main([*common, "--allow-config-change", "--resume", str(tmp_path / "a"),
                     "--out-dir", str(tmp_path / "from_sharded")]) == 0
    capsys.readouterr()
    assert cli.main([*common, "--allow-config-change", "--resume", str(old_style),
                     "--out-dir", str(tmp_path / "from_one_file")]) == 0
    assert "converted the single-file checkpoint" in capsys.readouterr().out
    a, b = (lattice.checkpoint.read(tmp_path / run) for run in ("from_sharded", "from_one_file"))
    assert a["step"] == b["step"] == 4
    weights_a, weights_b = lattice.checkpoint.full_model(a), lattice.checkpoint.full_model(b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    rows = (Path(tmp_path / run / "metrics.csv").read_text().splitlines()[-1] for run in ("from_sharded", "from_one_file"))
    assert len({row.rsplit(",", 2)[0] for row in rows}) == 1  # the same losses (the times differ)
    # launched processes: rank 0 converts alone while the others wait (a conversion that used the
    # whole world's collectives hung or raced the other ranks), then 1d resumes it
    layout = ["--mode", "1d", "--tp", "2", "--nproc", "2"]
    assert cli.main([*common, *layout, "--allow-config-change", "--resume", str(old_style),
                     "--out-dir", str(tmp_path / "from_one_file_1d")]) == 0
    assert lattice.checkpoint.read(tmp_path / "from_one_file_1d")["step"] == 4
    val = [float(Path(tmp_path / run / "metrics.csv").read_text().splitlines()[-1].split(",")[3])
           for run in ("from_sharded", "from_one_file_1d")]
    assert val[1] == pytest.approx(val[0], rel=1e-4)  # (1d's float32 sums differ from serial's in the last bits)


def test_every_train_option_has_help_with_its_default_in_a_group():
    """Catches a `lattice train` flag added without help text or without naming its default, or
    left outside the help's groups (layout, model, data, training, checkpoints, logging, faults)."""
    parser = cli.build_parser("train")
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    grouped = {a.dest for g in train._action_groups if g.title not in ("options", "optional arguments")
               for a in g._group_actions}
    for action in train._actions:
        if action.dest in ("help", "config"):
            continue
        assert action.help and "default" in action.help, (action.option_strings, action.help)
        assert action.dest in grouped, action.option_strings
    titles = [g.title for g in train._action_groups][2:]
    assert titles == ["layout", "model", "data", "training", "checkpoints", "logging", "faults"], titles


def test_batch_is_the_global_batch_in_plan_as_in_train(capsys):
    """Catches `plan --batch` meaning sequences per replica while train's --batch is the global
    batch of one step: with --dp 2, plan's replicas compute on half of it (the tensor-parallel
    figures of --dp 2 --batch 8 are those of --dp 1 --batch 4), and a batch the replicas cannot
    split, or a --dp below 1, is refused in one line."""
    def figures(argv):
        assert cli.main(["plan", "--mode", "1d", "--tp", "2", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        return lines[1], [line for line in lines if line.strip().startswith("forward ")]

    (head_dp2, forward_dp2), (head_dp1, forward_dp1) = figures(["--dp", "2", "--batch", "8"]), figures(["--batch", "4"])
    assert head_dp2.startswith("batch 4 x ") and head_dp1.startswith("batch 4 x ")
    assert forward_dp2 and forward_dp2 == forward_dp1
    assert cli.main(["plan", "--mode", "1d", "--tp", "2", "--dp", "2", "--batch", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "global batch" in err and "multiple of 2" in err
    assert cli.main(["plan", "--mode", "1d", "--tp", "2", "--dp", "0"]) == 2  # not a division by zero
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "dp must be a positive integer" in err


def test_plan_machine_from_a_file_or_refused_in_one_line(tmp_path, capsys):
    """Catches `plan --machine FILE` treating the path as JSON text (a traceback)."""
    machine = tmp_path / "m.json"
    machine.write_text('{"flop_rate": 1e12, "alpha_intra": 1e-6, "beta_intra": 1e-10, "alpha_inter": 1e-5, '
                       '"beta_inter": 1e-9, "ranks_per_node": 4}')
    assert cli.main(["plan", "--mode", "1d", "--tp", "2", "--machine", str(machine)]) == 0
    assert "time on given: F = 1e+03 GFLOP/s" in capsys.readouterr().out
    assert cli.main(["plan", "--mode", "1d", "--tp", "2", "--machine", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is no preset" in err and "JSON file or inline JSON" in err


def test_info_into_a_closed_pipe_ends_quietly():
    """Catches `lattice info | head` ending in a BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(f"{sys.executable} -m lattice info --mode 2d --tp 4 | head -1", shell=True, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("layout: mode 2d") and "Traceback" not in proc.stderr and proc.stderr == ""


def test_commands_that_touch_no_checkpoint_start_without_dcp_or_plotting():
    """Catches a module-level import that puts torch.distributed.checkpoint (with DTensor under it,
    a second of start-up) or matplotlib back on the path of `lattice --help`, info and plan."""
    script = ("import sys; from lattice.cli.main import main; main(['info', '--mode', '2d', '--tp', '4']); "
              "main(['plan', '--mode', '1d', '--tp', '2']); print(sorted(m for m in sys.modules if "
              "m.startswith(('torch.distributed.checkpoint', 'torch.distributed.tensor', 'matplotlib'))), "
              "file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "layout: mode 2d" in proc.stdout and proc.stderr.strip().splitlines()[-1] == "[]"


def test_a_batch_the_layout_cannot_split_is_refused_before_launch(capsys):
    """Catches `--mode 2d --tp 9 --nproc 9` starting 9 processes before refusing a batch that
    q = 3 does not divide."""
    assert cli.main(["train", "--mode", "2d", "--tp", "9", "--nproc", "9", "--batch-size", "16", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "batch size = 16 is not divisible by the 2D mesh side q = 3" in err


def test_generate_and_eval_load_a_trained_run(tmp_path, capsys):
    """Catches generate/eval that cannot read what train wrote, evaluate another model or split,
    or decode anything but the continuation of the prompt."""
    assert cli.main(["train", *TINY_ARGS, "--steps", "3", "--out-dir", str(tmp_path)]) == 0
    final = float(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("final val loss")).split()[3])
    assert cli.main(["eval", str(tmp_path)]) == 0
    out = capsys.readouterr().out.split()
    loss, perplexity = float(out[2]), float(out[5])
    assert abs(loss - final) <= 5e-5 and abs(perplexity - math.exp(loss)) <= 0.01 * perplexity
    assert cli.main(["generate", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def f(x):") and "5 tokens in" in captured.err and "tokens/s" in captured.err
    assert cli.main(["eval", str(tmp_path), "--mode", "2d", "--tp", "4"]) == 2  # one process for 4 ranks
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has 4 ranks" in err and "add --nproc 4" in err and "-m lattice eval" in err


def test_own_data_end_to_end_train_eval_generate_resume(tmp_path, capsys):
    """The README's own-data path. Catches a run that trains on the built-in corpus despite
    --data, a run directory without its tokenizer (generate would decode with another one), a
    resume that silently switches back to the built-in corpus, and one that accepts changed data."""
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 300)
    (data / "b.txt").write_text("Pack my box with five dozen liquor jugs. " * 300)
    run = tmp_path / "run"
    common = ["--model", "tiny", "--vocab-size", "300", "--batch-size", "4", "--eval-batches", "1", "--no-progress"]
    assert cli.main(["train", "--data", str(data), *common, "--steps", "4", "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    from lattice.data.corpus import data_hash, load_corpus
    baseline = float(next(line for line in out.splitlines() if line.startswith("unigram baseline")).split()[2])
    # a unigram model of this text, counted here from its characters' tokens: the run's baseline is
    # the own data's (the built-in corpus's is far from it)
    assert abs(baseline - lattice.data.corpus.unigram_baseline(load_corpus(300))) > 0.5
    assert baseline < 3.5  # two repeated sentences: a few dozen tokens carry the text
    assert (run / "tokenizer.json").exists() and data_hash(str(data)) in (run / "data.json").read_text()
    assert cli.main(["eval", str(run)]) == 0 and "perplexity" in capsys.readouterr().out
    other = tmp_path / "other.txt"
    other.write_text("Pack my box with five dozen liquor jugs. " * 200)  # b.txt alone: the last 10% differ
    assert cli.main(["eval", str(run), "--data", str(other), "--eval-batches", "1"]) == 0
    assert f"tokens of {other}" in capsys.readouterr().out
    assert cli.main(["generate", str(run), "--prompt", "The quick", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    # resume without --data continues on the recorded data ...
    assert cli.main(["train", *common, "--steps", "6", "--allow-config-change", "--resume", str(run),
                     "--out-dir", str(run)]) == 0
    assert f"unigram baseline: {baseline:.4f}" in capsys.readouterr().out
    # ... and refuses it once it changed, unless --data is given
    (data / "b.txt").write_text("Something else entirely. " * 300)
    assert cli.main(["train", *common, "--steps", "8", "--allow-config-change", "--resume", str(run),
                     "--out-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "changed since" in err and f"pass --data {data}" in err
    assert cli.main(["train", "--data", str(data), *common, "--steps", "8", "--allow-config-change", "--resume",
                     str(run), "--out-dir", str(run)]) == 0


def test_mode_option_switches_turn_on_and_off(capsys):
    """Catches a bool option that is on by default (3d's overlap) but whose flag can only turn
    it on, and help text that names the mode twice."""
    parser = cli.build_parser("train")
    args = parser.parse_args(["train", "--mode", "3d", "--tp", "8", "--no-overlap"])
    assert given_mode_options(args) == {"overlap": False}
    args = parser.parse_args(["train", "--mode", "1d", "--tp", "2", "--sequence-parallel"])
    assert given_mode_options(args) == {"sequence_parallel": True}
    assert given_mode_options(parser.parse_args(["train"])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "3d: 3d:" not in out and "subgraph: sub-graph:" not in out and "--no-overlap" in out


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["eval"], ["convert", "--to", "single"]])
def test_a_missing_run_is_refused_naming_only_flags_the_command_has(command, tmp_path, capsys):
    """Catches a refusal that sends a user of generate, eval or convert to `--resume`, a flag
    only train has (the checkpoint readers' shared way out)."""
    extra = [str(tmp_path / "out.pt")] if command[0] == "convert" else []
    assert cli.main([command[0], str(tmp_path / "missing"), *extra, *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and "--resume" not in err, err


def test_a_run_reads_each_checkpoint_once(tmp_path, capsys, monkeypatch):
    """Catches a run that decides things twice: the request's checks and the trainer each reading
    the --init-from checkpoint (a single file is loaded whole) or the one it resumes. The run
    plan reads each once, and the trainer builds from it."""
    assert cli.main(["train", *TINY_ARGS, "--steps", "2", "--out-dir", str(tmp_path / "a")]) == 0
    # one file of full tensors
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "single.pt")]) == 0
    reads = []
    real_read = lattice.checkpoint.read
    monkeypatch.setattr(lattice.checkpoint, "read", lambda path: reads.append(str(path)) or real_read(path))
    assert cli.main(["train", *TINY_ARGS, "--steps", "1", "--init-from", str(tmp_path / "single.pt"),
                     "--out-dir", str(tmp_path / "b")]) == 0
    assert reads == [str(tmp_path / "single.pt")]
    reads.clear()
    assert cli.main(["train", *TINY_ARGS, "--steps", "3", "--resume", str(tmp_path / "a"),
                     "--allow-config-change"]) == 0
    assert reads == [str(tmp_path / "a")]
    assert "initialised from" in capsys.readouterr().out


def test_a_resume_continues_the_run_as_it_was_and_keeps_its_tokenizer(tmp_path, capsys):
    """Catches `--resume` reading the family but not the preset or vocabulary ("saved for a
    different model (d_model 48 vs 192)" for a run of --model tiny resumed as its hint says), and a
    resume on new --data training a new BPE over the run's tokenizer.json (the weights' ids would
    no longer mean their tokens): the run's model and tokenizer are kept, byte for byte, and a
    --tokenizer with other ids is refused in one line."""
    import hashlib

    from tokenizers import ByteLevelBPETokenizer

    run = tmp_path / "a"
    common = ["--batch-size", "4", "--eval-batches", "1", "--no-progress", "--allow-config-change"]
    assert cli.main(["train", "--arch", "llama", "--model", "tiny", "--vocab-size", "512", "--steps", "2",
                     "--batch-size", "4", "--eval-batches", "1", "--no-progress", "--out-dir", str(run)]) == 0
    before = hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
    assert cli.main(["train", "--resume", str(run), "--steps", "3", *common]) == 0  # no model flag
    other = tmp_path / "other.txt"
    other.write_text("Completely different words for a second corpus, read with the run's tokenizer.\n" * 300)
    assert cli.main(["train", "--resume", str(run), "--data", str(other), "--steps", "4", *common]) == 0
    assert hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest() == before
    saved = lattice.checkpoint.read(run)
    assert saved["step"] == 4 and saved["arch"] == "llama" and saved["model_config"]["d_model"] == 64
    assert saved["model_config"]["vocab_size"] == 512  # the tokenizer's 512, unchanged
    capsys.readouterr()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([other.read_text()], vocab_size=400, min_frequency=2, show_progress=False)
    bpe.save(str(tmp_path / "new.json"))
    assert cli.main(["train", "--resume", str(run), "--tokenizer", str(tmp_path / "new.json"), "--steps", "5",
                     *common]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other ids, and the resumed weights were trained on those ids" in err


def test_every_size_of_every_family_is_a_flag_and_reaches_the_model(tmp_path, capsys):
    """Catches a family config field the command line cannot set (a Llama of 2 kv heads, a
    Mistral window, an untied Qwen2 needed a preset), a size flag read but dropped on the way to
    the model, and a size of another family accepted silently: each family's sizes, given as
    flags, are in the trained checkpoint's model config; another family's is refused in one line."""
    from dataclasses import fields

    from lattice.models import family_sizes

    declared = {f.name for arch in lattice.available_archs() for f in fields(lattice.get_arch(arch).config_class)}
    set_elsewhere = {"vocab_size", "num_labels", "pad_token_id", "eos_token_id", "decoder_start_token_id",
                     "rope_scaling"}  # the tokenizer, the data, the task; a dict (the preset's or an HF config's)
    assert set(family_sizes()) == declared - set_elsewhere
    runs = {"llama": ["--n-kv-heads", "2", "--intermediate-size", "96", "--norm-eps", "1e-6", "--rope-theta", "5e4"],
            "mistral": ["--sliding-window", "7", "--n-kv-heads", "8"],
            "qwen2": ["--tie-embeddings", "--init-std", "0.01"]}
    for arch, flags in runs.items():
        out = tmp_path / arch
        assert cli.main(["train", "--arch", arch, *TINY_ARGS, "--steps", "1", *flags, "--out-dir", str(out)]) == 0
        saved = lattice.checkpoint.read(out)["model_config"]
        given = dict(zip(flags[::2], flags[1::2])) if arch != "qwen2" else {"--init-std": "0.01"}
        for flag, value in given.items():
            assert saved[flag[2:].replace("-", "_")] == type(saved[flag[2:].replace("-", "_")])(value), (arch, flag)
        assert arch != "qwen2" or saved["tie_embeddings"] is True
    out = tmp_path / "qwen2_moe"  # a list of layers as a flag
    assert cli.main(["train", "--arch", "qwen2_moe", *TINY_ARGS, "--steps", "1", "--mlp-only", "0,1", "--n-experts", "8",
                     "--out-dir", str(out)]) == 0
    saved = lattice.checkpoint.read(out)["model_config"]
    assert saved["mlp_only"] == [0, 1] and saved["n_experts"] == 8
    capsys.readouterr()
    assert cli.main(["train", *TINY_ARGS, "--sliding-window", "4", "--out-dir", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--arch gpt2 has no --sliding-window" in err
