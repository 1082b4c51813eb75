"""A job that heals itself: workers a launcher starts again resume their run's newest intact
checkpoint on their own (lattice.training.request.elastic_restart), skip and keep a broken one,
end a finished or diverged job instead of training it again, and leave a person's own second
run in a used directory refused as before."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lattice import checkpoint
from lattice.checkpoint import run_dir, sharded
from lattice.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
        "--dropout", "0.1"]
SHORT = ["--steps", "8", "--eval-interval", "4", "--checkpoint-interval", "4"]


def _restarted(monkeypatch, run_id: str = "job-1", count: int = 1, max_restarts: int = 3) -> None:
    """This process as workers torchrun's agent started again would see their environment."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))


def _first_attempt(out: Path, monkeypatch, capsys, run_id: str = "job-1", *extra: str) -> None:
    """A job's first attempt, whose record then says it is still running (as when a worker died
    after the attempt's last checkpoint)."""
    _restarted(monkeypatch, run_id, count=0)
    assert cli.main(["train", *TINY, *SHORT, *extra, "--out-dir", str(out)]) == 0
    capsys.readouterr()
    assert run_dir.read_job(out)["run_id"] == run_id
    run_dir.write_job(out, state="running")


def _weights(out: Path) -> dict:
    return checkpoint.full_model(checkpoint.read(out))


def _final_loss(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("final val loss"))


def test_a_restart_resumes_the_newest_checkpoint_and_ends_as_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """Catches a restarted worker that refuses its own run's directory or starts it afresh: the
    job's record names it, so the restart resumes step 8 and trains to 12 exactly as one run of 12."""
    assert cli.main(["train", *TINY, *SHORT, "--steps", "12", "--out-dir", str(tmp_path / "ref")]) == 0
    reference = _final_loss(capsys.readouterr().out)
    out = tmp_path / "job"
    _first_attempt(out, monkeypatch, capsys, "job-1", "--steps", "12", "--stop-at", "8")
    _restarted(monkeypatch, count=1)
    assert cli.main(["train", *TINY, *SHORT, "--steps", "12", "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "restart 1 of job job-1" in said and f"resuming from {out / 'checkpoints' / 'step-00000008'}" in said
    assert _final_loss(said) == reference
    ours, theirs = _weights(out), _weights(tmp_path / "ref")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert run_dir.read_job(out)["state"] == "finished"


@pytest.mark.parametrize("damage", ["flipped byte", "missing marker"])
def test_a_restart_passes_over_a_broken_checkpoint_keeps_it_and_continues_exactly(damage, tmp_path, monkeypatch,
                                                                                   capsys):
    """Catches a restart that dies on (or trusts) a broken newest checkpoint, or deletes it: step 8
    damaged, the restart says so, resumes step 4, sets step 8 aside with its reason, and trains
    to the same weights as an uninterrupted run."""
    assert cli.main(["train", *TINY, *SHORT, "--out-dir", str(tmp_path / "ref")]) == 0
    reference = _final_loss(capsys.readouterr().out)
    out = tmp_path / "job"
    _first_attempt(out, monkeypatch, capsys)
    newest = sharded.complete(out)[-1]
    assert newest.name == "step-00000008"
    if damage == "flipped byte":
        shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        shard.write_bytes(raw)
        why = "does not match its checksum"
    else:
        (newest / sharded.MARKER).unlink()
        why = f"no {sharded.MARKER}"
    evidence = sorted(p.name for p in newest.iterdir())
    _restarted(monkeypatch, count=1)
    assert cli.main(["train", *TINY, *SHORT, "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"set aside {newest} in {out / run_dir.SKIPPED_DIR}" in said and why in said, said
    assert f"resuming from {out / 'checkpoints' / 'step-00000004'}" in said
    kept = [p for p in (out / run_dir.SKIPPED_DIR).iterdir() if p.is_dir()]
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == evidence
    assert _final_loss(said) == reference
    ours, theirs = _weights(out), _weights(tmp_path / "ref")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_finished_job_restarted_ends_without_training(tmp_path, monkeypatch, capsys):
    """Catches a launcher's restart after the run finished training it again (or failing)."""
    out = tmp_path / "job"
    _first_attempt(out, monkeypatch, capsys)
    run_dir.write_job(out, state="finished", step=8)
    metrics = (out / run_dir.METRICS_FILE).read_text()
    _restarted(monkeypatch, count=2)
    assert cli.main(["train", *TINY, *SHORT, "--out-dir", str(out)]) == 0
    assert "the run of job job-1 has finished; nothing to run on restart 2" in capsys.readouterr().out
    assert (out / run_dir.METRICS_FILE).read_text() == metrics


def test_a_diverged_job_ends_instead_of_restarting_and_says_why(tmp_path, monkeypatch, capsys):
    """Catches NaN under --on-nan stop exiting non-zero under a launcher with restarts left (it
    would restart into the same NaN), and a later restart training again."""
    out = tmp_path / "job"
    _restarted(monkeypatch, count=0)
    nan = ["--steps", "30", "--lr", "1e3", "--warmup", "0", "--checkpoint-interval", "1", "--out-dir", str(out)]
    assert cli.main(["train", *TINY, *nan]) == 0
    said = capsys.readouterr().out
    assert "gradient norm is nan" in said and "not restarted: a restart would reach the same step" in said
    assert run_dir.read_job(out)["state"] == "stopped"
    _restarted(monkeypatch, count=1)
    assert cli.main(["train", *TINY, *nan]) == 0
    assert "stopped (step " in capsys.readouterr().out


@pytest.mark.parametrize("env", [{}, {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"},
                                 {"TORCHELASTIC_RUN_ID": "another-job", "TORCHELASTIC_RESTART_COUNT": "1"}])
def test_a_second_run_in_a_used_directory_is_still_refused(env, tmp_path, monkeypatch, capsys):
    """Catches the restart rule taking a person's second run (no launcher job, torchrun's default
    job id "none" at its first start, or another job) for a restart of the first."""
    out = tmp_path / "job"
    _first_attempt(out, monkeypatch, capsys, run_id="none")
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", *TINY, *SHORT, "--out-dir", str(out)]) == 2
    assert f"--out-dir {out} holds a run with checkpoints at steps 4, 8" in capsys.readouterr().err


def test_a_killed_worker_is_restarted_by_the_launcher_and_the_job_ends_as_the_uninterrupted_one(tmp_path):
    """Catches --max-restarts that does not reach torchrun's agent, workers that do not resume
    after it restarts them, and a restart that is not on course: kill -9 of one of two workers
    mid-run, the job ends by itself with exit 0, its loss and weights those of a run never killed."""
    common = [*TINY, "--nproc", "2", "--dp", "2", "--steps", "150", "--eval-interval", "75",
              "--checkpoint-interval", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    ref = subprocess.run([sys.executable, "-m", "lattice", "train", *common, "--out-dir", str(tmp_path / "ref")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "job"
    run = subprocess.Popen([sys.executable, "-m", "lattice", "train", *common, "--max-restarts", "2", "--out-dir",
                            str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # a worker killed between checkpoints
            beats = [(out / run_dir.HEARTBEAT_DIR / f"rank{r}") for r in range(2)]
            try:
                rows = [b.read_text().split() for b in beats]
                if all(len(r) == 4 for r in rows) and min(int(r[0]) for r in rows) >= 40:
                    os.kill(int(rows[1][1]), signal.SIGKILL)
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("the run did not reach step 40")
        said, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, err[-3000:]
    assert "restart 1 of job" in said and "resuming from" in said and "recovered: step" in said, said[-3000:]
    assert _final_loss(said) == _final_loss(ref.stdout)
    ours, theirs = _weights(out), _weights(tmp_path / "ref")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    record = json.loads((out / run_dir.JOB_FILE).read_text())
    assert record["state"] == "finished" and record["recoveries"][0]["seconds"] > 0


def test_a_restart_before_the_first_checkpoint_starts_as_the_command_asked(tmp_path, monkeypatch, capsys):
    """Catches a restart that forgets the command's own --resume when the run died before its first
    checkpoint: a job continuing run a into b, restarted with no checkpoint in b, resumes a again."""
    assert cli.main(["train", *TINY, *SHORT, "--out-dir", str(tmp_path / "a")]) == 0
    out = tmp_path / "b"
    out.mkdir()
    run_dir.write_job(out, run_id="job-1", state="running")  # the first attempt died before saving
    _restarted(monkeypatch, count=1)
    capsys.readouterr()
    assert cli.main(["train", *TINY, *SHORT, "--steps", "10", "--allow-config-change", "--resume",
                     str(tmp_path / "a"), "--out-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "no intact checkpoint in the run yet: starting as the command asks" in said
    assert f"resuming from {tmp_path / 'a' / 'checkpoints' / 'step-00000008'} at step 8" in said
    assert checkpoint.read(out)["step"] == 10


def test_a_persons_resume_starts_a_job_record_of_its_own(tmp_path, monkeypatch, capsys):
    """Catches a new job inheriting the record of the one before (its stop reason, its
    recoveries): a run whose job diverged, resumed by a person, ends with a record of its own."""
    out = tmp_path / "job"
    _first_attempt(out, monkeypatch, capsys)
    run_dir.write_job(out, state="stopped", reason="step 8: the gradient norm is nan", recoveries=[{"seconds": 1.0}])
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["train", *TINY, *SHORT, "--steps", "10", "--allow-config-change", "--resume", str(out)]) == 0
    record = run_dir.read_job(out)
    assert record["state"] == "finished" and record["step"] == 10
    assert "reason" not in record and "recoveries" not in record and record["run_id"] is None
