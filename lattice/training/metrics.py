"""What a training run reports, on rank 0: metrics.csv (one row per step; a resumed run appends
after its checkpoint's step), TensorBoard scalars when the optional package is installed, and the
progress bar with the evaluation lines."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from lattice.checkpoint.run_dir import METRICS_FILE
from lattice.training import faults

METRIC_COLUMNS = ("step", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "elapsed_s")


def step_flops(model_config, ctx, *, batch_size: int, activation_checkpointing: bool,
               selective_checkpointing: bool = False, lengths: tuple[int, int | None] = (None, None)) -> float:
    """Matrix-product FLOPs of one training step on this rank (its stages with pp > 1) of the
    global batch `batch_size` (of `lengths`: sequence and target; default the model's), from
    the cost model."""
    from lattice.cost import estimate

    c = estimate(model_config, ctx.layout, batch=batch_size // ctx.dp, rank=ctx.rank, seq=lengths[0],
                 target_seq=lengths[1], activation_checkpointing=activation_checkpointing,
                 selective_checkpointing=selective_checkpointing)
    # a pipeline stage's work is one micro-batch's through its chunks, and the step runs m of them
    return (c.flops["forward"] + c.flops["backward"]) * (ctx.pipeline.m if ctx.pipeline is not None else 1)


class Metrics:
    """One run's reports from `step` to `until`; `out` None (other ranks, or no out-dir) writes no
    files. `flops`: a callable giving one step's FLOPs on this rank (asked once, for TensorBoard);
    `peak_tflops` adds the model FLOP utilisation; `columns`, the family's own after METRIC_COLUMNS
    (`Model.step_metric_names`: an MoE model's balancing loss and expert loads)."""

    def __init__(self, out: Path | None, *, step: int, until: int, show: bool, tokens_per_step: int,
                 flops, peak_tflops: float | None, device: torch.device, columns: tuple[str, ...] = ()):
        from tqdm.auto import tqdm

        self.tokens_per_step, self.flops, self.peak_tflops, self.device = tokens_per_step, flops, peak_tflops, device
        # a bar where a person watches (tqdm draws on stderr); where the output goes to a file, a
        # plain line at the first step and then about twenty over the run, not carriage returns
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=until, initial=step, disable=not (show and terminal), unit="step", dynamic_ncols=True)
        self.lines_every = max(1, (until - step) // 20) if show and not terminal else 0
        self.first, self.until = step + 1, until
        self.csv_file = self.csv = self.board = None
        self.columns = METRIC_COLUMNS + tuple(columns)
        if out is not None:
            self.csv_file = _open_csv(out, step, self.columns)
            self.csv = csv.DictWriter(self.csv_file, fieldnames=self.columns)
            self.board = _tensorboard(out)
        self._flops_per_step = None

    def say(self, text: str) -> None:
        """A line above the bar (printed even where the bar is disabled)."""
        self.bar.write(text)
        sys.stdout.flush()

    def log(self, row: dict) -> None:
        if self.csv:
            self.csv.writerow({k: ("" if row.get(k) is None else row[k]) for k in self.columns})
        if self.board:
            self._log_scalars(row)
        self.bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        self.bar.update(1)
        step = row["step"]
        if self.lines_every and (step == self.first or step % self.lines_every == 0 or step == self.until):
            self.say(f"step {step}/{self.until}: train loss {row['train_loss']:.4f}, lr {row['lr']:.3g}, "
                     f"{row['tokens_per_s']:.0f} tokens/s, {row['elapsed_s']:.0f} s")

    def close(self) -> None:
        self.bar.close()
        if self.board:
            self.board.close()
        if self.csv_file:
            self.csv_file.close()

    def _log_scalars(self, row: dict) -> None:
        """TensorBoard: loss, validation loss, learning rate, gradient norm, tokens/s, the FLOP
        rate per rank (the cost model's FLOPs of one step over its time; with peak_tflops, the
        model FLOP utilisation) and this rank's peak memory."""
        board, step = self.board, row["step"]
        for key in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
            if row.get(key) is not None:
                board.add_scalar(f"train/{key}", row[key], step)
        for key in self.columns[len(METRIC_COLUMNS):]:
            if row.get(key) is not None:
                board.add_scalar(f"moe/{key}", row[key], step)
        if self._flops_per_step is None:
            self._flops_per_step = self.flops()
        seconds = self.tokens_per_step / row["tokens_per_s"]
        board.add_scalar("perf/tflops_per_rank", self._flops_per_step / seconds / 1e12, step)
        if self.peak_tflops:
            board.add_scalar("perf/mfu", self._flops_per_step / seconds / (self.peak_tflops * 1e12), step)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        board.add_scalar("perf/peak_memory_mib", peak / 2 ** 20, step)


def _open_csv(out: Path, step: int, columns: tuple[str, ...]):
    """metrics.csv, line-buffered; a resumed run (step > 0) appends to the rows written before."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / METRICS_FILE
    append = step > 0 and path.exists()
    if append:  # rows after the checkpoint belong to a run that did not reach its next save
        faults.truncate_metrics(path, step)
    f = open(path, "a" if append else "w", newline="", buffering=1)
    if not append:
        f.write(",".join(columns) + "\n")
    return f


def _tensorboard(out: Path):
    """A TensorBoard writer in OUT/tensorboard when the optional `tensorboard` package is
    installed (pip install 'lattice[tb]'); None otherwise (metrics.csv has the same numbers)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(out / "tensorboard"))
