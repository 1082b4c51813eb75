"""Checkpoints: bad files refused in one line on every rank, atomic writes, weights-only loading,
and resharding between layouts (a run saved under one layout continues under another)."""

import os
import shutil
from dataclasses import dataclass

import pytest
import torch
from multiproc import cached_init, run_distributed

import lattice
from lattice import checkpoint
from lattice.checkpoint import convert
from lattice.parallel.context import LatticeConfigError
from lattice.training.trainer import TrainConfig, Trainer

TINY = dict(model="tiny", vocab_size=512, batch_size=4, lr=3e-3, warmup=2, grad_clip=0.3,
            eval_interval=50, eval_batches=2, progress=False, steps=6)


@dataclass
class NotATensor:
    """An arbitrary object: a checkpoint holding one can run code when unpickled."""

    payload: str = "rm -rf"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    """A single file of full tensors, exported from a training checkpoint as `lattice convert RUN RUN.pt` does."""
    root = tmp_path_factory.mktemp("good")
    trainer = Trainer(TrainConfig(**TINY), lattice.init("serial"))
    trainer.train_step()
    return str(convert.export_single(checkpoint.read(trainer.save(root / "run")), root / "ckpt.pt"))


@pytest.fixture(scope="module")
def bad_files(good, tmp_path_factory) -> dict[str, str]:
    """name -> (path of a bad checkpoint)."""
    d = tmp_path_factory.mktemp("bad")
    data = open(good, "rb").read()
    files = {"missing": d / "nope.pt", "truncated": d / "truncated.pt", "empty": d / "empty.pt",
             "text": d / "notes.txt", "foreign": d / "foreign.pt", "tensor": d / "tensor.pt",
             "object": d / "object.pt", "version": d / "version.pt", "other_model": d / "other_model.pt"}
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["empty"].write_bytes(b"")
    files["text"].write_text("step=10 loss=3.2\n")
    torch.save({"state_dict": {"weight": torch.ones(3)}, "epoch": 3}, files["foreign"])
    torch.save(torch.ones(3), files["tensor"])
    ckpt = torch.load(good, weights_only=True)
    torch.save({**ckpt, "extra": NotATensor()}, files["object"])  # loads fine without weights_only
    torch.save({**ckpt, "version": checkpoint.VERSION + 1}, files["version"])
    torch.save({**ckpt, "model_config": {**ckpt["model_config"], "d_model": 96, "n_layers": 3}}, files["other_model"])
    return {**{k: str(v) for k, v in files.items()}, "single": good}


EXPECT = {"missing": "does not exist", "truncated": "truncated", "empty": "empty file",
          "text": "not a torch.save archive", "foreign": "not a lattice checkpoint",
          "tensor": "not a lattice checkpoint", "object": "objects other than tensors",
          "version": "format version", "other_model": "d_model 96 vs 48",
          "single": "is a single-file checkpoint, and training resumes sharded ones"}


def _resume_errors(paths: dict[str, str]) -> dict[str, str | None]:
    ctx = cached_init(mode="serial", dp=2)
    out = {}
    for name, path in paths.items():
        try:
            Trainer(TrainConfig(**TINY), ctx, resume=path)
            out[name] = None
        except LatticeConfigError as e:
            out[name] = str(e)
    return out


def test_bad_checkpoints_fail_in_one_line_on_every_rank(bad_files):
    """Catches a bad file that hangs the other rank in a collective, a raw torch/pickle
    traceback instead of a message naming the problem and the fix, or one rank accepting a file
    the other refuses; and a trainer that resumes a single file's moments by a second loading
    path instead of sending it through the conversion to the sharded form."""
    per_rank = run_distributed(2, _resume_errors, bad_files)
    assert per_rank[0] == per_rank[1]
    for name, msg in per_rank[0].items():
        assert msg is not None, f"{name} was accepted"
        assert "\n" not in msg and EXPECT[name] in msg, (name, msg)
        assert "--resume" in msg or "use" in msg, (name, msg)


def test_loading_is_weights_only(bad_files):
    """Catches torch.load(weights_only=False): the file with an arbitrary object would load."""
    with pytest.raises(LatticeConfigError, match="objects other than tensors"):
        checkpoint.read(bad_files["object"])
    assert torch.load(bad_files["object"], weights_only=False)["extra"] == NotATensor()


def test_save_is_atomic(good, tmp_path, monkeypatch):
    """Catches a save that writes in place: a crash mid-write must leave the previous
    checkpoint intact and no stray temporary file."""
    path = tmp_path / "ckpt.pt"
    shutil.copy(good, path)
    before = path.read_bytes()

    def crash(obj, f):
        open(f, "wb").write(b"PK\x03\x04 half")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"step": 1}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]
    checkpoint.read(path)


def _resume_under(mode: str, tp: int, dp: int, path: str, steps: int):
    ctx = cached_init(mode=mode, tp=tp, dp=dp)
    trainer = Trainer(TrainConfig(**TINY), ctx, resume=path)
    start = trainer.step
    losses = [trainer.train_step()["train_loss"] for _ in range(steps)]
    return start, losses


def _train_and_save(mode: str, tp: int, dp: int, path: str, steps: int):
    ctx = cached_init(mode=mode, tp=tp, dp=dp)
    trainer = Trainer(TrainConfig(**TINY), ctx)
    losses = [trainer.train_step()["train_loss"] for _ in range(steps)]
    trainer.save(path)
    return losses, trainer.model.full_state_dict(), checkpoint.gather_optimizer(trainer.model, trainer.optimizer)


def _serial_straight(steps: int) -> list[float]:
    trainer = Trainer(TrainConfig(**TINY), lattice.init("serial"))
    return [trainer.train_step()["train_loss"] for _ in range(steps)]


def test_serial_checkpoint_resumes_data_parallel(tmp_path):
    """Catches a checkpoint that only loads under the layout that wrote it, or a resume that
    restarts the data or schedule: serial 3 steps + dp=2 for 3 more equals serial 6."""
    path = str(tmp_path / "run")
    serial = Trainer(TrainConfig(**TINY), lattice.init("serial"))
    first = [serial.train_step()["train_loss"] for _ in range(3)]
    serial.save(path)
    results = run_distributed(2, _resume_under, "serial", 1, 2, path, 3)
    straight = _serial_straight(6)
    assert first == straight[:3]
    for start, losses in results:
        assert start == 3
        assert losses == pytest.approx(straight[3:], abs=1e-5)


@pytest.mark.parametrize("mode,tp,dp", [("serial", 1, 2), ("1d", 2, 1)])
def test_parallel_checkpoint_resumes_serial(mode, tp, dp, tmp_path):
    """Catches shards (weights or AdamW moments) gathered into the wrong place of the full
    tensor: a checkpoint written under a parallel layout must load in serial to exactly the
    tensors that layout held, and continue on the serial trajectory."""
    path = str(tmp_path / "run")
    losses, params, moments = run_distributed(tp * dp, _train_and_save, mode, tp, dp, path, 3)[0]
    resumed = Trainer(TrainConfig(**TINY), lattice.init("serial"), resume=path)
    assert resumed.step == 3
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.optimizer.state[p][key], moments[key][name]), (name, key)
    more = [resumed.train_step()["train_loss"] for _ in range(3)]
    assert losses + more == pytest.approx(_serial_straight(6), abs=1e-5)
