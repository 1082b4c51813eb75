"""Run directories that never mix, and saves that fail cleanly: a second `lattice train` with the
defaults, an explicit --out-dir holding another run, resuming an older step, the printed resume
command, --keep and the checkpoint just written, too little disk space, a write that fails on one
rank (sync and async)."""

import errno
import os
import shlex
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from multiproc import cached_init, run_distributed

import lattice
from lattice.checkpoint import files as checkpoint_files
from lattice.checkpoint import sharded
from lattice.checkpoint.run_dir import resume_command
from lattice.cli import main as cli
from lattice.training.trainer import TrainConfig, Trainer

TINY = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
        "--eval-interval", "100"]


def _steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in sharded.complete(run)]


def _metric_steps(run: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]


def test_a_second_default_run_gets_its_own_directory_and_loses_nothing(tmp_path, monkeypatch):
    """Catches the second run writing into the first one's directory: its metrics.csv and
    config.toml replaced, its checkpoint deleted by --keep (which kept the old, higher steps)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *TINY, "--steps", "6", "--checkpoint-interval", "2", "--keep", "2"]) == 0
    assert cli.main(["train", *TINY, "--steps", "2", "--checkpoint-interval", "2"]) == 0
    first, second = tmp_path / "runs" / "run-1", tmp_path / "runs" / "run-2"
    assert _steps(first) == [4, 6] and _metric_steps(first) == list(range(1, 7))
    assert "steps = 6" in (first / "config.toml").read_text()
    assert _steps(second) == [2] and _metric_steps(second) == [1, 2]
    assert os.readlink(tmp_path / "runs" / "latest") == "run-2"


def test_an_out_dir_holding_another_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    """Catches a new run silently mixing into a used --out-dir, and an --overwrite that leaves
    the old run's checkpoints or metrics behind."""
    out = tmp_path / "a"
    assert cli.main(["train", *TINY, "--steps", "4", "--checkpoint-interval", "2", "--out-dir", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["train", *TINY, "--steps", "2", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds a run with checkpoints at steps 2, 4" in err
    assert f"--resume {out}" in err and "--overwrite" in err
    assert cli.main(["train", *TINY, "--steps", "2", "--checkpoint-interval", "0", "--out-dir", str(out),
                     "--overwrite"]) == 0
    assert _steps(out) == [2] and _metric_steps(out) == [1, 2] and "steps = 2" in (out / "config.toml").read_text()


def test_resume_continues_in_its_run_and_refuses_to_replace_later_checkpoints(tmp_path, capsys, monkeypatch):
    """Catches a resumed run writing into a default directory instead of its own, and a resume of
    an older step whose saves would interleave with the later checkpoints of the first history."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "a"
    base = ["train", *TINY, "--steps", "4", "--checkpoint-interval", "2", "--keep", "0"]
    assert cli.main([*base, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    older = str(out / "checkpoints" / "step-00000002")
    assert cli.main([*base, "--resume", older]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "after the resumed step 2 (step-00000004)" in err and "--overwrite" in err
    assert cli.main([*base, "--resume", older, "--overwrite"]) == 0
    assert _steps(out) == [2, 4] and _metric_steps(out) == [1, 2, 3, 4]
    assert not (tmp_path / "runs").exists()  # nothing written elsewhere


def test_the_printed_resume_command_continues_the_stopped_run_and_only_it(tmp_path, capsys, monkeypatch):
    """Catches a stop hint that does not work as printed (a missing flag changes the schedule and
    is refused; a missing out-dir starts writing into another run)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *TINY, "--steps", "4", "--warmup", "1", "--stop-at", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stopped by --stop-at at step 2"))
    command = shlex.split(line.split("continue with: ", 1)[1])
    assert command[:2] == ["lattice", "train"] and "--stop-at" not in command
    assert cli.main(command[1:]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "run-1"]
    assert _steps(tmp_path / "runs" / "run-1")[-1] == 4 and _metric_steps(tmp_path / "runs" / "run-1") == [1, 2, 3, 4]


@pytest.mark.parametrize("arch", [a for a in lattice.available_archs() if a != "probe"])  # not the test family
def test_ctrl_c_then_the_printed_command_continues_a_run_of_a_non_default_preset(arch, tmp_path, capsys, monkeypatch):
    """Catches a Ctrl-C hint that does not continue a run of a preset other than the family's
    default (a resume that read the family but not the preset or the vocabulary refused it as
    "saved for a different model"): SIGINT after the first step saves, prints the command, and
    the command as printed continues the run to its last step, in every family."""
    import signal

    monkeypatch.chdir(tmp_path)
    step = Trainer.train_step

    def step_then_ctrl_c(self):
        row = step(self)
        if self.step == 1:
            signal.raise_signal(signal.SIGINT)  # the handler lattice installs: stop at this step's end
        return row

    monkeypatch.setattr(Trainer, "train_step", step_then_ctrl_c)
    assert cli.main(["train", "--arch", arch, "--model", "tiny", "--vocab-size", "300", "--batch-size", "4",
                     "--eval-batches", "1", "--no-progress", "--steps", "3", "--warmup", "1"]) == 128 + signal.SIGINT
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stopped by SIGINT at step 1"))
    monkeypatch.setattr(Trainer, "train_step", step)
    command = shlex.split(line.split("continue with: ", 1)[1])
    assert cli.main(command[1:]) == 0, capsys.readouterr().err
    assert _steps(tmp_path / "runs" / "run-1")[-1] == 3 and _metric_steps(tmp_path / "runs" / "run-1") == [1, 2, 3]


def test_resume_command_drops_every_spelling_of_the_run_flags():
    """Catches abbreviated or --flag=value spellings of --out-dir/--stop-at surviving into the
    hint (the printed command would write elsewhere or stop again at once)."""
    argv = ["train", "--steps", "9", "--out=x", "--stop-at", "3", "--resume", "old", "--overwrite", "--lr=0.1"]
    assert resume_command(argv, Path("runs/run 2")) == "lattice train --steps 9 --lr=0.1 --resume 'runs/run 2'"


def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    """Catches pruning by step number deleting the newest save when higher steps exist."""
    for step in (100, 200, 300, 20):
        d = tmp_path / sharded.SUBDIR / sharded.step_name(step)
        d.mkdir(parents=True)
        (d / sharded.MARKER).write_text("{}")
    written = tmp_path / sharded.SUBDIR / sharded.step_name(20)
    sharded.prune(tmp_path, 3, written=written)
    assert _steps(tmp_path) == [20, 200, 300]


def test_a_save_without_room_stops_the_run_naming_the_figures_and_keeps_the_last(tmp_path, capsys, monkeypatch):
    """Catches a full disk surfacing as DCP's 'unexpected pos' traceback, a half-written
    checkpoint directory left behind, an estimate of the checkpoint's size that is off, and
    `lattice convert` writing a sharded checkpoint without the same check."""
    out = tmp_path / "a"
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(checkpoint_files, "free_bytes", lambda path: free["bytes"])
    assert cli.main(["train", *TINY, "--steps", "4", "--stop-at", "2", "--checkpoint-interval", "2",
                     "--out-dir", str(out)]) == 0
    written = sum(f.stat().st_size for f in (out / "checkpoints" / "step-00000002").iterdir())
    # the checkpoint is the float32 weights and AdamW's two moments (independent of the estimate)
    n_params = sum(p.numel() for p in Trainer(TrainConfig(model="tiny", vocab_size=512), lattice.init("serial"))
                   .model.parameters())
    assert 3 * 4 * n_params < written < 1.25 * 3 * 4 * n_params  # plus the index and a header per tensor
    free["bytes"] = written // 2
    capsys.readouterr()
    assert cli.main(["train", *TINY, "--steps", "4", "--checkpoint-interval", "2", "--resume", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    need = float(err.split("needs about ")[1].split(" MB")[0])
    assert err.count("\n") == 0 and err.startswith("error: step 4: the checkpoint needs about ")
    assert written / 2**20 - 0.05 <= need <= 1.25 * written / 2**20  # never below what a save writes
    assert "step-00000002" in err and f"--resume {out}" in err and "--keep" in err
    assert _steps(out) == [2] and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    assert cli.main(["convert", str(out), "--to", "sharded", str(tmp_path / "copy")]) == 3  # convert's writes too
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the checkpoint needs about" in err and not _steps(tmp_path / "copy")


def _fail_a_write_on_rank_1(out: str, async_checkpoint: bool):
    """dp=2: rank 1's files of the second checkpoint fail as on a full disk."""
    import torch.distributed as dist

    ctx = cached_init(mode="serial", dp=2)
    trainer = Trainer(TrainConfig(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False, steps=4,
                                  eval_interval=100, checkpoint_interval=2, out_dir=out,
                                  async_checkpoint=async_checkpoint), ctx)
    original = dcp_filesystem._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if "step-00000004" in str(getattr(stream, "name", "")) and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(transforms, stream, *args, **kwargs)

    dcp_filesystem._write_item = write_item
    try:
        trainer.fit()
    except sharded.WriteFailed as e:
        return str(e)
    finally:
        dcp_filesystem._write_item = original
        trainer.checkpoints.async_writer and trainer.checkpoints.async_writer.close()
    return None


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_a_write_failing_on_one_rank_stops_every_rank_alike(tmp_path, async_checkpoint):
    """Catches a failed write that leaves the other ranks waiting in a collective, a partial
    checkpoint directory left behind, or ranks that disagree on what happened."""
    messages = run_distributed(2, _fail_a_write_on_rank_1, str(tmp_path), async_checkpoint, timeout=120)
    assert messages[0] == messages[1] and messages[0] is not None
    assert messages[0].startswith("step 4: writing the checkpoint into") and "(no space left on the device;" in messages[0]
    assert "last intact checkpoint is" in messages[0] and messages[0].endswith("step-00000002")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_refused_run_leaves_no_directory_behind(tmp_path, capsys, monkeypatch):
    """Catches a run refused for its data or sizes that still creates its --out-dir (or runs/)
    first, leaving an empty run that `lattice eval runs/latest` then says holds no checkpoint."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary.so").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "one.txt").write_text("a")  # text, but a single token: refused once tokenized
    refused = (["--data", "binary.so"], ["--data", "one.txt"], ["--n-heads", "5"], ["--batch-size", "3", "--dp", "2"])
    for flags in refused:
        for out in (["--out-dir", "new"], []):
            assert cli.main(["train", "--model", "tiny", "--vocab-size", "512", *flags, *out]) == 2, flags
            assert capsys.readouterr().err.startswith("error: ")
            assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.so", "one.txt"], (flags, out)
