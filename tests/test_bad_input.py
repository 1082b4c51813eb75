"""What a user mistypes or a file system refuses, through every command: one line naming the
problem and the fix, exit status 2, no traceback, before any process or process group starts.
The table is the list of cases; `test_every_rank_prints_the_line` shows one of them under
torchrun, where every rank checks on its own."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lattice.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1", "--no-progress"]

# case: (command line, a fragment of the one line expected); the files are made by `workspace`
TABLE = {
    # train
    "data missing": (["train", "--data", "nope.txt"], "--data nope.txt names no file"),
    "data an empty file": (["train", "--data", "empty.txt"], "--data empty.txt holds no text (1 empty file)"),
    "data a directory without text": (["train", "--data", "emptydir"], "--data emptydir names no file"),
    "data binary": (["train", "--data", "binary.so"], "is not text (NUL bytes)"),
    "data not JSON lines": (["train", "--data", "text.txt", "--data-format", "jsonl"], "is not a JSON object"),
    "tokenizer missing": (["train", "--tokenizer", "nope.json"], "--tokenizer nope.json has no tokenizer.json"),
    "tokenizer unparsable": (["train", "--tokenizer", "text.txt"], "is not a tokenizer the tokenizers library reads"),
    "tokenizer beyond --vocab-size": (["train", "--tokenizer", "run/tokenizer.json", "--vocab-size", "256"],
                                      "has 512 tokens but --vocab-size is 256"),
    "resume missing": (["train", "--resume", "nope"], "checkpoint nope does not exist"),
    "resume a text file": (["train", "--resume", "text.txt"], "is not a torch.save archive"),
    "resume a directory without checkpoint": (["train", "--resume", "emptydir"], "emptydir holds no checkpoint"),
    "resume another family": (["train", "--resume", "run", "--arch", "llama"],
                              "holds a gpt2 model, and --arch llama asks for another family; drop --arch"),
    "resume another family with sizes it refuses": (["train", "--resume", "run", "--arch", "llama", "--n-kv-heads",
                                                     "5"], "holds a gpt2 model, and --arch llama asks for another"),
    "resume another size": (["train", "--resume", "run", "--vocab-size", "1024"], "vocab_size 512 vs 1024"),
    "resume changing the schedule": (["train", "--resume", "run", "--steps", "9"], "steps 2 -> 9"),
    "resume an older step": (["train", "--resume", "run/checkpoints/step-00000001"],
                             "after the resumed step 1 (step-00000002)"),
    "out-dir holding another run": (["train", "--out-dir", "run"], "--out-dir run holds a run with checkpoints"),
    "out-dir a file": (["train", "--out-dir", "text.txt"], "--out-dir text.txt is a file, not a directory"),
    "out-dir cannot be created": (["train", "--out-dir", "/proc/lattice/out"], "cannot be created"),
    "config missing": (["train", "--config", "nope.toml"], "--config nope.toml cannot be read"),
    "config a directory": (["train", "--config", "emptydir"], "--config emptydir cannot be read (Is a directory)"),
    "config not TOML": (["train", "--config", "bad.toml"], "--config bad.toml is not valid TOML"),
    "config unknown key": (["train", "--config", "unknown.toml"], "has unknown keys ['nosuchkey']"),
    "sizes that do not divide": (["train", "--mode", "1d", "--tp", "2", "--n-heads", "3", "--d-model", "48"],
                                 "n_heads = 3 is not divisible by tp = 2"),
    "process count of another layout": (["train", "--mode", "1d", "--tp", "2", "--nproc", "3"],
                                        "--nproc 3 does not match the layout"),
    "process count of another dp": (["train", "--mode", "1d", "--tp", "2", "--dp", "1", "--nproc", "4"],
                                    "--nproc 4 does not match the layout"),
    "attention dropout under cp, before the processes start": (["train", "--cp", "2", "--nproc", "2", "--dropout",
                                                                 "0.1"], "attention dropout (0.1) is not implemented"),
    "--max-restarts below zero": (["train", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    "a task the family does not train on": (["train", "--task", "classify"],
                                            "--arch gpt2 does not train on --task classify"),
    "classify text that is not JSON lines": (["train", "--arch", "bert", "--task", "classify", "--data", "text.txt"],
                                             "--task classify reads labelled JSON lines"),
    "classify lines without a label": (["train", "--arch", "bert", "--task", "classify", "--data", "unlabelled.jsonl",
                                        "--data-format", "jsonl"],
                                       "is not a JSON object with 'text' and 'label' fields"),
    "classify one label only": (["train", "--arch", "bert", "--task", "classify", "--data", "onelabel.jsonl",
                                 "--data-format", "jsonl"], "has 1 distinct label(s) under 'label'"),
    "classify through a pipeline": (["train", "--arch", "bert", "--task", "classify", "--pp", "2", "--n-layers", "2"],
                                    "fine-tune with --pp 1"),
    "seq2seq pairs from plain text": (["train", "--arch", "t5", "--data", "text.txt"],
                                      "--task seq2seq reads source/target pairs from JSON lines"),
    "seq2seq lines without a source or target": (["train", "--arch", "t5", "--data", "unlabelled.jsonl",
                                                  "--data-format", "jsonl"],
                                                 "is not a JSON object with 'src' and 'tgt' fields"),
    "seq2seq built-in targets too short": (["train", "--arch", "t5", "--seq-len", "16"],
                                           "target_len = 10 is too short; pass --target-len 17"),
    "an encoder-decoder's blocks over stages": (["train", "--arch", "t5", "--pp", "3", "--microbatches", "3"],
                                                "n_layers + n_decoder_layers = 4 blocks do not split evenly into 3"),
    "a target length for a decoder": (["train", "--target-len", "5"], "--target-len is an encoder-decoder's"),
    "init-from another family": (["train", "--arch", "bert", "--init-from", "run"],
                                 "holds a gpt2 model, this run trains --arch bert; drop --arch"),
    "a learning rate that is no number": (["train", "--lr", "nan", "--out-dir", "fresh"],
                                          "--lr nan is out of range: it must be a finite number in (0, inf)"),
    "an infinite gradient clip": (["train", "--grad-clip", "inf"], "--grad-clip inf is out of range"),
    "a beta of one or more": (["train", "--beta2", "1.5"], "--beta2 1.5 is out of range"),
    "init-from another size": (["train", "--init-from", "run", "--d-model", "96"], "holds another model: {'d_model'"),
    # eval and generate
    "eval a missing run": (["eval", "nope"], "checkpoint nope does not exist"),
    "eval a file that is no checkpoint": (["eval", "binary.so"], "is not a torch.save archive"),
    "eval another family": (["eval", "run", "--arch", "llama"], "holds a gpt2 model, not llama"),
    "eval data binary": (["eval", "run", "--data", "binary.so"], "is not text (NUL bytes)"),
    "eval batches below one": (["eval", "run", "--eval-batches", "0"], "--eval-batches must be at least 1"),
    "eval a layout that cannot be": (["eval", "run", "--mode", "2d", "--tp", "3"], "tp=3 is not such a square"),
    "generate a broken run tokenizer": (["generate", "badtok", "--prompt", "x"], "the run's tokenizer"),
    "generate no new tokens": (["generate", "run", "--prompt", "x", "--max-new-tokens", "0"],
                               "--max-new-tokens must be at least 1"),
    "generate a negative temperature": (["generate", "run", "--prompt", "x", "--temperature", "-1"],
                                        "--temperature must be at least 0"),
    # convert
    "convert a missing source": (["convert", "nope", "out.pt"], "checkpoint nope does not exist"),
    "convert from a directory that is no HF model": (["convert", "--from", "hf", "emptydir", "x"], "no config.json"),
    "convert into a run": (["convert", "run", "--to", "sharded", "run"], "destination run holds a run"),
    "convert to HF into a file": (["convert", "run", "--to", "hf", "text.txt"], "destination text.txt is a file"),
    "convert into a place that cannot be created": (["convert", "run", "/proc/lattice/x.pt"], "cannot be created"),
    "convert the wrong family": (["convert", "run", "x.pt", "--arch", "llama"], "holds a gpt2 model, not llama"),
    "convert from a truncated safetensors file": (["convert", "--from", "hf", "truncated_hf", "imported"],
                                                  "truncated_hf/model.safetensors cannot be read as safetensors"),
    "convert onto an existing file": (["convert", "run", "text.txt"], "destination text.txt already exists (6 bytes)"),
    # info, plan, bench
    "info sizes that do not divide": (["info", "--mode", "1d", "--tp", "2", "--n-heads", "3", "--d-model", "48"],
                                      "n_heads = 3 is not divisible by tp = 2"),
    "info an unknown preset": (["info", "--model", "huge"], "unknown model preset 'huge'"),
    "plan a layout that cannot be": (["plan", "--mode", "3d", "--tp", "4"], "tp=4 is not such a cube"),
    "plan a missing machine file": (["plan", "--machine", "nope.json"], "is no preset"),
    "bench an unknown mode": (["bench", "--modes", "4d"], "unknown mode(s) ['4d']"),
    "bench output into a file": (["bench", "--out", "text.txt", "--modes", "serial"], "--out text.txt is a file"),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory with a finished 2-step run and the bad files the table names."""
    here = tmp_path_factory.mktemp("bad_input")
    cwd = os.getcwd()
    os.chdir(here)
    try:
        assert cli.main(["train", *TINY, "--steps", "2", "--checkpoint-interval", "1", "--keep", "0",
                         "--out-dir", "run"]) == 0
    finally:
        os.chdir(cwd)
    assert cli.main(["convert", str(here / "run"), "--to", "hf", str(here / "truncated_hf")]) == 0
    weights = here / "truncated_hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    (here / "text.txt").write_text("hello\n")
    (here / "empty.txt").write_bytes(b"")
    (here / "emptydir").mkdir()
    (here / "binary.so").write_bytes(bytes(range(256)) * 64)
    (here / "bad.toml").write_text("not = [toml\n")
    (here / "unknown.toml").write_text("nosuchkey = 3\n")
    (here / "unlabelled.jsonl").write_text('{"text": "hello"}\n')
    (here / "onelabel.jsonl").write_text('{"text": "hello", "label": "a"}\n' * 20)
    (here / "badtok").mkdir()
    os.symlink(here / "run" / "checkpoints", here / "badtok" / "checkpoints")
    (here / "badtok" / "tokenizer.json").write_text("garbage\n")
    return here


def _timeout(signum, frame):
    raise TimeoutError("a refusal case ran for more than 60 s (it was not refused up front)")


@pytest.mark.parametrize("case", TABLE)
def test_a_bad_input_is_one_line_with_the_fix(case, workspace, capsys, monkeypatch):
    """Catches a traceback, several lines, exit status 0/1, a refusal that happens only after
    processes, a process group or training started (the 60 s alarm), or one that leaves a
    directory or file behind (a stub run directory that the next try is then refused for)."""
    argv, expected = TABLE[case]
    argv = ["train", *TINY, *argv[1:]] if argv[0] == "train" else argv  # the case's own flags come last and win
    monkeypatch.chdir(workspace)
    before = sorted(p.name for p in workspace.iterdir())
    capsys.readouterr()
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(60)
    try:
        rc = cli.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in captured.err + captured.out, (rc, captured.err)
    assert lines[0].startswith(("error: ", "lattice bench: ")) and expected in lines[0], lines[0]
    assert sorted(p.name for p in workspace.iterdir()) == before


def test_every_rank_prints_the_line(workspace):
    """Catches a refusal printed by rank 0 only (the other ranks wait in a collective until the
    timeout) under the user's own torchrun, where no launcher of ours checked first.

    torchrun's agent ends the other workers at its first look after one has failed (every 0.1 s
    by default), and on a loaded machine rank 1 reached its check later than that (CI: one
    refusal, rank 1 ended by SIGTERM). The agent here looks after 20 s: time for a rank that checks
    to print, none for one stuck in a collective (its group's timeout is far longer). Also catches
    the two ranks' lines run together on the pipe they share (a line written apart from its
    newline: "...run firsterror: --out-dir ...", one line counted, in 1 of 3 runs here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "20", "-m", "lattice", "train", *TINY, "--dp", "2", "--out-dir", "run"],
                          cwd=workspace, env=env, capture_output=True, text=True, timeout=180)
    refusals = [line for line in proc.stderr.splitlines() if "--out-dir run holds a run with checkpoints" in line]
    # (torchrun's agent prints its own traceback of the failed children; none may come from a worker)
    assert proc.returncode != 0 and len(refusals) == 2, proc.stderr[-2000:]
    assert f'File "{ROOT / "lattice"}' not in proc.stderr, proc.stderr[-2000:]
