"""Training that survives faults, driven through `lattice train` as a user would: a stalled rank,
NaNs, a flipped byte, SIGTERM, a killed launcher, two runs in one out-dir, a crash between
checkpoints, a changed schedule on resume, and out-dirs that cannot hold a run."""

import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

import lattice
from lattice import checkpoint
from lattice.checkpoint import convert, run_dir
from lattice.cli import main as cli
from lattice.parallel.context import LatticeConfigError
from lattice.training import faults
from lattice.training.trainer import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1", "--no-progress"]
LONG = ["--steps", "100000", "--eval-interval", "1000000", "--checkpoint-interval", "0"]


def _lattice(args, out: Path, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lattice", "train", *TINY, *args, "--out-dir", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _beats(out: Path, world: int, min_step: int = 3, timeout: float = 120) -> list[int]:
    """Wait until every rank has beaten past `min_step`; their pids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rows = [(out / run_dir.HEARTBEAT_DIR / f"rank{r}").read_text().split() for r in range(world)]
            if all(len(row) == 4 and int(row[0]) >= min_step for row in rows):
                return [int(row[1]) for row in rows]
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"the run did not reach step {min_step} within {timeout} s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split()[2] != "Z"


def test_a_stalled_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """Catches the 30-minute default timeout (the job hangs), and a failure message that does not
    say which rank stalled or in which collective."""
    run = _lattice(["--nproc", "2", "--dp", "2", "--dist-timeout", "8", *LONG], tmp_path, start_new_session=True)
    _, stuck = _beats(tmp_path, 2, min_step=5)
    os.kill(stuck, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = run.communicate(timeout=90)
    finally:
        if _alive(stuck):
            os.kill(stuck, signal.SIGKILL)
    took = time.monotonic() - t0
    line = next(line for line in err.splitlines() if line.startswith("error: rank 0:"))
    assert run.returncode != 0 and took < 8 + 20, (run.returncode, took)
    assert f"stalled: rank 1 (pid {stuck} on " in line and "waited more than --dist-timeout 8 s" in line, line
    assert "all_reduce over 2 ranks" in line or "over 2 ranks" in line, line


def test_nan_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, capsys):
    """Catches a run that trains on through NaNs to exit 0 and saves them over a good checkpoint."""
    code = cli.main(["train", *TINY, "--steps", "30", "--lr", "1e3", "--warmup", "0", "--checkpoint-interval", "1",
                     "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.count("\n") == 0 and "gradient norm is nan" in err and "--on-nan skip" in err
    saved = checkpoint.read(tmp_path)  # loads: intact, checksums and finiteness verified
    assert 0 < saved["step"] < 30 and all(torch.isfinite(t).all() for t in checkpoint.full_model(saved).values())


def test_skipping_nan_steps_keeps_the_weights_finite(tmp_path):
    """Catches --on-nan skip applying a non-finite update (the weights would turn NaN)."""
    trainer = Trainer(TrainConfig(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False,
                                  steps=6, lr=1e3, warmup=0, on_nan="skip"), lattice.init("serial"))
    rows = [trainer.train_step() for _ in range(6)]
    assert any(r["skipped"] for r in rows) and trainer.skipped == sum(r["skipped"] for r in rows)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_flipped_byte_is_refused_naming_the_tensor(tmp_path):
    """Catches a checkpoint whose corrupted tensor loads silently (zip stores tensors unchecked)."""
    trainer = Trainer(TrainConfig(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False, steps=2),
                      lattice.init("serial"))
    trainer.train_step()
    path = convert.export_single(checkpoint.read(trainer.save(tmp_path)), tmp_path / "ckpt.pt")
    raw = bytearray(path.read_bytes())
    entry = next(i for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename and i.file_size > 1000)
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26:entry.header_offset + 30])
    start = entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2
    raw[start] ^= 0x01  # one bit of one float
    path.write_bytes(raw)
    with pytest.raises(LatticeConfigError, match=r"tensor (model|optimizer)/\S+ does not match its checksum") as e:
        checkpoint.read(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("nproc", [2])
def test_ctrl_c_under_nproc_saves_and_every_process_exits_at_once(nproc, tmp_path):
    """Catches the two ways one Ctrl-C went wrong under --nproc: the copy of SIGINT that torchrun's
    agent passes on, arriving during the save the first one started, interrupted it (nothing
    saved); and workers that saved, then waited for an agent that no longer read their result,
    until it SIGKILLed them after 30 s ("Unable to shutdown process"). SIGINT to the whole process
    group, as a terminal sends it, three times: a checkpoint of the step printed, exit status 130."""
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        run = _lattice(["--nproc", str(nproc), "--dp", str(nproc), *LONG], out, start_new_session=True)
        _beats(out, nproc)
        os.killpg(run.pid, signal.SIGINT)
        stdout, err = run.communicate(timeout=120)
        assert run.returncode == 128 + signal.SIGINT, err[-2000:]
        assert "Unable to shutdown process" not in err and "Traceback" not in err, err[-2000:]
        assert f"stopped by SIGINT at step {checkpoint.read(out)['step']}; checkpoint saved" in stdout


def test_a_launch_leaves_the_callers_signal_handlers_as_they_were(tmp_path, monkeypatch):
    """Catches `--nproc` called in-process (a test, a notebook) leaving torchrun's agent handler
    on SIGINT, so that the caller's next Ctrl-C raises the agent's SignalException."""
    monkeypatch.chdir(tmp_path)

    def callers_own(signum, frame):
        raise AssertionError("not reached: no signal is sent")

    before = {sig: signal.signal(sig, callers_own) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(["train", *TINY, "--steps", "1", "--nproc", "2", "--dp", "2", "--out-dir", "run"]) == 0
        assert all(signal.getsignal(sig) is callers_own for sig in before), [signal.getsignal(s) for s in before]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_repeated_signal_is_one_request_and_a_later_one_interrupts():
    """Catches a StopRequest that takes the agent's copy of a Ctrl-C (milliseconds after the
    terminal's) for a second Ctrl-C and interrupts the save, or one that swallows a real second
    Ctrl-C: within DUPLICATE_S the same signal changes nothing; after it, KeyboardInterrupt."""
    # (Python's own handler, whatever this process inherited: a background job ignores SIGINT)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.StopRequest() as stop:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert stop.signal == signal.SIGINT
            stop._first_at[signal.SIGINT] -= faults.StopRequest.DUPLICATE_S  # as if the first came that long ago
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_sigterm_saves_a_checkpoint_that_resumes_bit_exactly(tmp_path):
    """Catches SIGTERM ending in a traceback with nothing saved, and a signal checkpoint that
    resumes anything other than exactly where the run stopped."""
    run = _lattice(["--steps", "3000", "--eval-interval", "100000", "--checkpoint-interval", "0"], tmp_path / "a")
    _beats_serial(tmp_path / "a")
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]  # saved, and a shell's `&&` does not go on
    stopped = checkpoint.read(tmp_path / "a")["step"]
    assert f"stopped by SIGTERM at step {stopped}" in out and stopped < 3000
    until = stopped + 5
    # resume in-process for 5 more steps and compare with an uninterrupted run of the same length
    cfg = dict(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False, steps=3000,
               eval_interval=100000, checkpoint_interval=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stopped run had (OMP_NUM_THREADS=1): the same kernels, bit for bit
    try:
        again = Trainer(TrainConfig(**cfg, stop_at=until), lattice.init("serial"), resume=tmp_path / "a")
        again.fit()
        straight = Trainer(TrainConfig(**cfg, stop_at=until), lattice.init("serial"))
        straight.fit()
    finally:
        torch.set_num_threads(threads)
    a, b = again.model.full_state_dict(), straight.model.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _beats_serial(out: Path, min_step: int = 20, timeout: float = 60):
    """Serial runs do not beat (no collectives): wait for their metrics instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len((out / "metrics.csv").read_text().splitlines()) > min_step:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the run did not start")


def test_killing_the_launcher_leaves_no_worker_running(tmp_path):
    """Catches orphaned workers that keep training (and holding the out-dir) after kill -9 of
    `lattice train --nproc`."""
    run = _lattice(["--nproc", "2", "--dp", "2", *LONG], tmp_path)
    workers = _beats(tmp_path, 2)
    run.kill()
    run.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)


def test_a_second_run_in_the_same_out_dir_is_refused(tmp_path, capsys):
    """Catches two runs that both report success while overwriting each other's files."""
    holder = faults.RunLock(tmp_path).acquire()  # stands for a run in progress
    try:
        assert cli.main(["train", *TINY, "--steps", "2", "--out-dir", str(tmp_path)]) == 2
        assert cli.main(["train", *TINY, "--steps", "2", "--nproc", "2", "--dp", "2", "--out-dir", str(tmp_path)]) == 2
    finally:
        holder.release()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(f"another lattice run (pid {os.getpid()}) is using" in line for line in lines)


def test_metrics_after_a_resume_have_no_duplicate_steps(tmp_path):
    """Catches metrics.csv holding the steps between the last checkpoint and a crash twice."""
    cfg = dict(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False, steps=8,
               eval_interval=100, checkpoint_interval=4, out_dir=str(tmp_path))
    Trainer(TrainConfig(**cfg, stop_at=6), lattice.init("serial")).fit()  # checkpoint at 4 and at the stop (6)
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000006")  # as if it crashed after step 6, before saving
    Trainer(TrainConfig(**cfg), lattice.init("serial"), resume=tmp_path).fit()
    steps = [int(line.split(",")[0]) for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == list(range(1, 9))


def test_a_changed_schedule_on_resume_is_refused_or_announced(tmp_path, capsys):
    """Catches a resume that silently changes --steps / --lr (the cosine schedule would jump), and
    an allowed change whose learning-rate jump goes unsaid: the first lines name the change and
    the rate at the resumed step under the saved and the new schedule."""
    assert cli.main(["train", *TINY, "--steps", "2", "--warmup", "1", "--out-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    args = ["train", *TINY, "--steps", "4", "--warmup", "1", "--lr", "0.01", "--resume", str(tmp_path),
            "--out-dir", str(tmp_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "steps 2 -> 4" in err and "lr 0.002 -> 0.01" in err and "--allow-config-change" in err
    assert cli.main(args + ["--allow-config-change"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resuming at step 2"))
    # saved: the cosine from 0.002 ended at step 2 (0.1 x 0.002); new: 1 of 3 decay steps done from 0.01 to 0.001
    new = 0.001 + 0.5 * (1 + math.cos(math.pi / 3)) * 0.009
    assert "steps 2 -> 4; lr 0.002 -> 0.01" in line and line.endswith(f"is {new:.3g} (the saved schedule's was 0.0002)")


@pytest.mark.parametrize("problem", ["file", "checkpoint_dir", "proc"])
def test_out_dirs_that_cannot_hold_a_run_are_refused_before_any_process(tmp_path, capsys, problem):
    """Catches an out-dir problem that surfaces as a multi-rank traceback after the processes
    started (or, for a `ckpt.pt` directory, only at the next --resume)."""
    out = {"file": tmp_path / "a_file", "checkpoint_dir": tmp_path / "run", "proc": Path("/proc/lattice_out")}[problem]
    if problem == "file":
        out.write_text("x")
    if problem == "checkpoint_dir":
        (out / "ckpt.pt").mkdir(parents=True)
    assert cli.main(["train", *TINY, "--steps", "2", "--nproc", "2", "--dp", "2", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(out) in err, err
