"""Sharded checkpoints (torch.distributed.checkpoint): each rank writes its own shards, a
checkpoint resumes exactly in every other layout, a crash during a save never costs the previous
checkpoint, bad checkpoints are refused in one line on every rank, and `lattice convert` moves
between the sharded form, the single file and a HuggingFace directory."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiproc import cached_init, run_distributed
from numerics import rel_diff

import lattice
from lattice import checkpoint
from lattice.checkpoint import sharded
from lattice.checkpoint.dcp_io import item_name
from lattice.checkpoint.files import crc_file
from lattice.cli import main as cli
from lattice.data.batches import train_batch
from lattice.parallel.context import LatticeConfigError
from lattice.training.trainer import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
# a model every mode can split: 8 heads for 1d tp=4, 2d q=2, 3d q=2 and 2 sub-grids; vocab 512 pads
EXACT = dict(model="tiny", d_model=64, n_heads=8, seq_len=32, vocab_size=512, batch_size=8, lr=3e-3, warmup=2,
             grad_clip=0.5, eval_interval=100, eval_batches=1, progress=False, steps=10, dtype="float64")
TINY = dict(model="tiny", vocab_size=512, batch_size=4, lr=3e-3, warmup=2, eval_interval=100, eval_batches=1,
            progress=False, steps=6)


def _train_and_save(mode: str, tp: int, dp: int, root: str, steps: int, options: dict):
    trainer = Trainer(TrainConfig(**EXACT), cached_init(mode=mode, tp=tp, dp=dp, **options))
    losses = [trainer.train_step()["train_loss"] for _ in range(steps)]
    trainer.save(root)
    return losses


def _resume(mode: str, tp: int, dp: int, root: str, steps: int, options: dict):
    trainer = Trainer(TrainConfig(**EXACT), cached_init(mode=mode, tp=tp, dp=dp, **options), resume=root)
    start = trainer.step
    return start, [trainer.train_step()["train_loss"] for _ in range(steps)]


@pytest.fixture(scope="module")
def straight_serial() -> list[float]:
    trainer = Trainer(TrainConfig(**EXACT), lattice.init("serial"))
    return [trainer.train_step()["train_loss"] for _ in range(10)]


@pytest.fixture(scope="module")
def saved_in_2d(tmp_path_factory, straight_serial) -> str:
    root = str(tmp_path_factory.mktemp("2d"))
    losses = run_distributed(4, _train_and_save, "2d", 4, 1, root, 5, {})[0]
    assert rel_diff(torch.tensor(losses), torch.tensor(straight_serial[:5])) < 1e-10
    return root


RESUME_LAYOUTS = [("1d", 4, 1, {}), ("serial", 1, 2, {}), ("2d", 4, 1, {}), ("3d", 8, 1, {}),
                  ("subgraph", 4, 1, {"subgrids": 2}), ("1d", 2, 2, {"sequence_parallel": True})]


@pytest.mark.parametrize("mode,tp,dp,options", RESUME_LAYOUTS,
                         ids=[f"{m}-tp{t}-dp{d}{'-' + '-'.join(o) if o else ''}" for m, t, d, o in RESUME_LAYOUTS])
def test_float64_2d_checkpoint_resumes_in_every_layout(saved_in_2d, straight_serial, mode, tp, dp, options):
    """Catches a shard read into the wrong region of the full tensor (a wrong offset, vocabulary
    padding saved as rows, a 2D vector read off row 0), AdamW moments not resharded with their
    weights, or a step, schedule or data position lost: 5 float64 steps in 2d q=2 + a sharded
    save + 5 steps in another layout must follow an uninterrupted serial run to 1e-10."""
    results = run_distributed(tp * dp, _resume, mode, tp, dp, saved_in_2d, 5, options)
    for start, losses in results:
        assert start == 5
        assert rel_diff(torch.tensor(losses), torch.tensor(straight_serial[5:])) < 1e-10, (losses, straight_serial[5:])


def _full_state(mode: str, tp: int, root: str):
    trainer = Trainer(TrainConfig(**EXACT), cached_init(mode=mode, tp=tp), resume=root)
    return trainer.model.full_state_dict(), checkpoint.gather_optimizer(trainer.model, trainer.optimizer)


def test_serial_resume_holds_exactly_the_tensors_2d_held(saved_in_2d):
    """Catches a resharded load that is close but not equal (a dtype round trip, moments taken
    from the wrong parameter): serial after loading holds bit for bit what 2d q=2 held."""
    params_2d, moments_2d = run_distributed(4, _full_state, "2d", 4, saved_in_2d)[0]
    serial = Trainer(TrainConfig(**EXACT), lattice.init("serial"), resume=saved_in_2d)
    assert serial.step == 5
    for name, p in serial.model.named_parameters():
        assert torch.equal(p.detach(), params_2d[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(serial.optimizer.state[p][key], moments_2d[key][name]), (name, key)
            assert float(serial.optimizer.state[p]["step"]) == moments_2d["step"] == 5


def _written_files(root: str) -> list[str]:
    return sorted(os.listdir(sharded.complete(root)[-1]))


def test_every_rank_writes_only_its_own_shards(saved_in_2d):
    """Catches a sharded save that still funnels everything through rank 0, or writes a
    replicated tensor once per replica: each of 2d's 4 ranks wrote one file, and the files hold
    the model and both moments once (their sizes add up to the tensors' bytes plus framing)."""
    path = sharded.complete(saved_in_2d)[-1]
    files = [f for f in _written_files(saved_in_2d) if f.endswith(".distcp")]
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    saved = sharded.read(path)
    numel = sum(torch.Size(s).numel() for s in saved["tensors"].values())
    data_bytes = sum((path / f).stat().st_size for f in files)
    assert numel * 8 <= data_bytes < numel * 8 * 1.5  # float64: each element once, not once per replica
    sizes = [(path / f).stat().st_size for f in files]
    assert max(sizes) < 0.6 * data_bytes  # no rank wrote (nearly) everything


# ----------------------------------------------------------------------------- crashes during a save
_CRASH_CHILD = r"""
import os, signal, sys
import torch.distributed.checkpoint.filesystem as fs
import lattice
from lattice.checkpoint import sharded as sc
from lattice.training.trainer import TrainConfig, Trainer

moment, out = sys.argv[1], sys.argv[2]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
saves = {"n": 0}
real_write, real_item, real_atomic, real_fsync = sc.write, fs._write_item, sc.atomic_write, sc.fsync_dir

def write(*args, **kwargs):
    saves["n"] += 1
    return real_write(*args, **kwargs)

def armed():
    return saves["n"] == 2  # the second checkpoint (step 4); step 2's is complete by then

items = {"n": 0}
def write_item(*args, **kwargs):
    items["n"] += 1
    if armed() and moment == "data" and items["n"] > 3:
        die()  # half way through the data file
    return real_item(*args, **kwargs)

def checksums(*args, **kwargs):
    if armed() and moment == "index":
        die()  # every shard and DCP's .metadata written, the marker not yet
    return sc_checksums(*args, **kwargs)

def atomic(path, fn):
    if armed() and moment == "marker":
        real_atomic(path.parent / "x", fn)  # the marker's bytes on disk, under a temporary name
        die()
    return real_atomic(path, fn)

def fsync_dir(path):
    if armed() and moment == "renamed":
        die()  # renamed into place: the new checkpoint is complete
    return real_fsync(path)

sc_checksums = sc.checksums
sc.write, fs._write_item, sc.checksums, sc.atomic_write, sc.fsync_dir = write, write_item, checksums, atomic, fsync_dir
cfg = TrainConfig(model="tiny", vocab_size=512, batch_size=4, lr=3e-3, warmup=2, eval_interval=100, eval_batches=1,
                  progress=False, steps=6, checkpoint_interval=2, out_dir=out)
Trainer(cfg, lattice.init("serial")).fit()
"""


@pytest.fixture(scope="module")
def straight_tiny() -> list[float]:
    trainer = Trainer(TrainConfig(**TINY), lattice.init("serial"))
    return [trainer.train_step()["train_loss"] for _ in range(6)]


@pytest.mark.parametrize("moment", ["data", "index", "marker", "renamed"])
def test_a_process_killed_during_a_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path, moment, straight_tiny):
    """Catches a save that damages or hides the previous checkpoint, or leaves a half-written one
    that loads: a process SIGKILLed while writing step 4's checkpoint (in the middle of its data
    file, after the data and DCP's index, after the marker's bytes, after the rename) must leave
    step 2's checkpoint (or, once renamed, step 4's) loadable, and resuming it must reproduce an
    uninterrupted run exactly."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _CRASH_CHILD, moment, str(out)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -9, proc.stderr[-2000:]
    expected_step = 4 if moment == "renamed" else 2
    saved = checkpoint.read(out)
    assert saved["step"] == expected_step
    if moment != "renamed":
        assert sharded.remove_partial(out), "the interrupted save left nothing behind?"
    resumed = Trainer(TrainConfig(**TINY), lattice.init("serial"), resume=out)
    losses = [resumed.train_step()["train_loss"] for _ in range(6 - expected_step)]
    assert losses == straight_tiny[expected_step:]


def test_async_save_writes_its_step_while_training_goes_on(tmp_path, monkeypatch):
    """Catches an async save that writes the live tensors (so the checkpoint would hold weights
    of later steps) or that blocks training until it is written: the writer is held back while
    the trainer takes two more steps, and the checkpoint must still hold step 2's weights and
    moments exactly."""
    import threading

    release, real_write = threading.Event(), sharded.write

    def held_write(*args, **kwargs):
        assert release.wait(60)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(sharded, "write", held_write)
    trainer = Trainer(TrainConfig(**TINY, out_dir=str(tmp_path), async_checkpoint=True), lattice.init("serial"))
    for _ in range(2):
        trainer.train_step()
    at_save = {k: v.clone() for k, v in trainer.model.full_state_dict().items()}
    moments = {k: {n: t.clone() for n, t in v.items()} for k, v in checkpoint.gather_optimizer(
        trainer.model, trainer.optimizer).items() if k != "step"}
    trainer.save(tmp_path)
    trainer.train_step()
    trainer.train_step()  # two steps while the checkpoint of step 2 is still being written
    assert not sharded.complete(tmp_path)
    release.set()
    assert trainer.checkpoints.async_writer.wait().name == "step-00000002"
    resumed = Trainer(TrainConfig(**TINY), lattice.init("serial"), resume=tmp_path)
    assert resumed.step == 2
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p.detach(), at_save[name]), name
        assert not torch.equal(p.detach(), dict(trainer.model.named_parameters())[name].detach()), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.optimizer.state[p][m], moments[m][name]), (name, m)


def test_keep_k_keeps_the_newest_complete_checkpoints(tmp_path):
    """Catches --keep deleting the newest checkpoint, or never deleting any."""
    Trainer(TrainConfig(**TINY, out_dir=str(tmp_path), checkpoint_interval=1, keep=2), lattice.init("serial")).fit()
    assert [p.name for p in sharded.complete(tmp_path)] == ["step-00000005", "step-00000006"]
    assert checkpoint.read(tmp_path)["step"] == 6


# ----------------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def good_sharded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good_sharded")
    trainer = Trainer(TrainConfig(**TINY), lattice.init("serial"))
    trainer.train_step()
    return trainer.save(root)


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _bad_sharded(good: Path, d: Path) -> dict[str, str]:
    made = {}

    def copy(name):
        made[name] = d / name / "checkpoints" / good.name
        shutil.copytree(good, made[name])
        return made[name]

    (copy("incomplete") / sharded.MARKER).unlink()
    data = copy("truncated") / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    data = copy("flipped") / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    (copy("missing_file") / "__0_0.distcp").unlink()
    marker = copy("foreign") / sharded.MARKER
    marker.write_text(json.dumps({"format": "something-else", "step": 1}))
    marker = copy("version") / sharded.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": sharded.VERSION + 1}))
    marker = copy("other_model") / sharded.MARKER
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "model_config": {**record["model_config"], "d_model": 96}}))
    # the index rewritten but still readable: one key renamed, the length and the pickle intact
    index = copy("rewritten_index") / ".metadata"
    raw = index.read_bytes()
    assert raw.count(b"exp_avg_sq") > 0
    index.write_bytes(raw.replace(b"exp_avg_sq", b"exp_avg_sQ", 1))
    forged = copy("forged_index")
    (forged / ".metadata").write_bytes(pickle.dumps(Boom()))
    record = json.loads((forged / sharded.MARKER).read_text())
    record["files"][".metadata"] = [(forged / ".metadata").stat().st_size, crc_file(forged / ".metadata")]
    (forged / sharded.MARKER).write_text(json.dumps(record))
    return {k: str(v) for k, v in made.items()}


EXPECT = {"incomplete": "is incomplete", "truncated": "truncated", "flipped": "does not match its checksum",
          "missing_file": "lacks its file __0_0.distcp", "foreign": "not the marker of a lattice sharded checkpoint",
          "version": "format version", "other_model": "d_model 96 vs 48",
          "forged_index": "cannot be read safely (posix.system is not part of a checkpoint index)",
          "rewritten_index": ".metadata does not match its checksum"}


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


def test_bad_sharded_checkpoints_fail_in_one_line_on_every_rank(good_sharded, tmp_path):
    """Catches a damaged sharded checkpoint that hangs a rank in DCP's collectives, loads
    silently (a flipped bit, a cut file), runs code from a forged index (DCP itself unpickles it
    with plain pickle), trusts an index rewritten but still readable (its CRC never checked: a
    renamed key would surface later as a missing tensor, or load into the wrong place), or is
    refused on one rank and accepted on the other."""
    per_rank = run_distributed(2, _resume_errors, _bad_sharded(good_sharded, tmp_path))
    assert per_rank[0] == per_rank[1]
    for name, msg in per_rank[0].items():
        assert msg is not None, f"{name} was accepted"
        assert "\n" not in msg and EXPECT[name] in msg, (name, msg)


def _save_tiny(mode: str, tp: int, root: str):
    trainer = Trainer(TrainConfig(**TINY), cached_init(mode=mode, tp=tp))
    trainer.train_step()
    return str(trainer.save(root))


def _resume_error(mode: str, tp: int, root: str) -> str | None:
    try:
        Trainer(TrainConfig(**TINY), cached_init(mode=mode, tp=tp), resume=root)
    except LatticeConfigError as e:
        return str(e)
    return None


def test_a_damaged_chunk_read_by_one_rank_is_refused_on_every_rank(tmp_path):
    """Catches a checksum checked only by the rank that reads the chunk (the other rank would
    wait in DCP's collectives until the timeout): one bit of a chunk that only tp rank 1 of 1d
    reads is flipped, and both ranks must refuse with the same line naming that chunk."""
    path = Path(run_distributed(2, _save_tiny, "1d", 2, str(tmp_path))[0])
    index = sharded.read_index(path)
    target = next(i for i, info in index.storage_data.items()
                  if i.fqn == "model/blocks.0.mlp.fc.weight" and i.offset[-1] > 0)  # tp rank 1's columns
    info = index.storage_data[target]
    raw = bytearray((path / info.relative_path).read_bytes())
    raw[info.offset + info.length - 8] ^= 0x01  # in the tensor's bytes, near the end of the chunk
    (path / info.relative_path).write_bytes(bytes(raw))
    errors = run_distributed(2, _resume_error, "1d", 2, str(tmp_path))
    assert errors[0] == errors[1] and errors[0] is not None
    assert item_name(target) in errors[0] and "does not match its checksum" in errors[0]
    assert "\n" not in errors[0]


# ----------------------------------------------------------------------------- convert
def test_convert_sharded_to_single_and_back_is_exact(good_sharded, tmp_path, capsys):
    """Catches a conversion that drops or reorders a tensor, the AdamW moments or the step."""
    original = checkpoint.read(good_sharded)
    assert cli.main(["convert", str(good_sharded), str(tmp_path / "one.pt")]) == 0
    single = checkpoint.read(tmp_path / "one.pt")
    assert not checkpoint.is_sharded(single) and single["step"] == original["step"] == 1
    assert cli.main(["convert", str(tmp_path / "one.pt"), str(tmp_path / "back")]) == 0
    back = checkpoint.read(tmp_path / "back")
    assert checkpoint.is_sharded(back) and back["optimizer_step"] == 1
    keys = list(original["tensors"])
    a, b = sharded.load_full(original, keys), sharded.load_full(back, keys)
    assert all(torch.equal(a[k], b[k]) for k in keys)
    for name, t in single["model"].items():
        assert torch.equal(t, a[f"model/{name}"])
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(single["optimizer"][m][name], a[f"optimizer/{m}/{name}"])
    assert "wrote sharded checkpoint" in capsys.readouterr().out


def test_hf_export_loads_in_transformers_with_the_same_logits_and_import_resumes(good_sharded, tmp_path, capsys):
    """Catches an HF export transformers cannot load (missing config.json or safetensors, a
    tied head written twice or not at all, transposed weights) and an import that cannot be
    trained from: from_pretrained(DIR) must give lattice's logits to 1e-6, and `lattice train
    --resume` of the imported checkpoint must start from exactly those weights (its first loss
    equals transformers' loss on the same batch)."""
    transformers = pytest.importorskip("transformers")
    assert cli.main(["convert", str(good_sharded), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    ours = Trainer(TrainConfig(**TINY), lattice.init("serial"), resume=good_sharded)
    ours.model.eval()
    x, y = train_batch(ours.corpus, 0, ours.ctx, seed=0, batch_size=4, seq_len=ours.model_config.seq_len)
    with torch.no_grad():
        assert rel_diff(theirs(x).logits, ours.model(x)) < 1e-6

    assert cli.main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    run = tmp_path / "continued"
    args = ["train", "--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--steps", "2", "--lr", "3e-3",
            "--eval-batches", "1", "--no-progress", "--resume", str(tmp_path / "imported"), "--out-dir", str(run)]
    capsys.readouterr()
    assert cli.main(args) == 0
    first = float((run / "metrics.csv").read_text().splitlines()[1].split(",")[2])
    with torch.no_grad():
        logits = theirs(x).logits
        expect = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    assert first == pytest.approx(float(expect), rel=1e-5)
    assert checkpoint.read(run)["step"] == 2
