"""Batches of a corpus (lattice.data.corpus), the same in every layout: the global batch of step t
is a function of (seed, t) alone, so a resumed run sees the same data as an uninterrupted one.
Data-parallel replica r of `dp` takes rows [r*B/dp, (r+1)*B/dp) of it; every rank of one
tensor-parallel group gets that same replica batch. The validation windows are fixed; the checks
say when a batch does not fit the data."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from lattice.data.blend import Blend
from lattice.data.corpus import Corpus
from lattice.data.token_files import windows
from lattice.modes.kernels.loss import IGNORE_INDEX
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext


def truncated(what: str, lengths: list[int], room: int, flag: str, cut: str | None = None) -> str | None:
    """One line on the `lengths` (in tokens) over `room`, or None when none is; `cut`: how one is
    cut (default: to its first `room` tokens)."""
    over = [n for n in lengths if n > room]
    if not over:
        return None
    return (f"{len(over)} of {len(lengths)} {what} are longer than the {room} tokens a batch holds (the longest "
            f"{max(over)}): each is cut {cut or f'to its first {room}'}; a longer {flag} keeps more")


def check_batch_size(corpus: Corpus, batch_size: int, seq_len: int, dp: int) -> None:
    """Raise a one-line LatticeConfigError unless the batch splits over dp and fits both splits."""
    for tokens, split in ((corpus.train, "training"), (corpus.val, "validation")):
        _check_batch(batch_size, seq_len, dp, tokens, split)


def _check_batch(batch_size: int, seq_len: int, dp: int, tokens: torch.Tensor, split: str):
    if batch_size % dp:
        lower = batch_size - batch_size % dp
        raise LatticeConfigError(f"batch size {batch_size} is not divisible by dp = {dp}; use a multiple of "
                                 f"{dp} (for example {lower or dp} or {lower + dp})")
    shortest = min(((len(p), n) for p, n in zip(tokens.parts, tokens.names)), default=(0, "")) \
        if isinstance(tokens, Blend) else (len(tokens), None)
    if shortest[0] < seq_len + 1:
        source = f" of {shortest[1]}" if shortest[1] else ""
        raise LatticeConfigError(f"the {split} split{source} has {shortest[0]} tokens, fewer than seq_len + 1 = "
                                 f"{seq_len + 1}; use a shorter seq_len or a larger corpus")


class Batch(NamedTuple):
    """A replica's batch: its tokens and targets, what the model takes beside them (`inputs`:
    attention_mask, token_types) and how many targets of the whole global batch are labelled
    (`labelled`), by which the replicas' mean losses are weighed into the global mean."""

    tokens: torch.Tensor
    targets: torch.Tensor
    inputs: dict
    labelled: int


def replica_batch(ctx: ParallelContext, tokens: torch.Tensor, targets: torch.Tensor, **inputs) -> Batch:
    """This replica's rows of a global batch (tokens, targets and the `inputs` given, None
    dropped) on ctx.device. The tasks mark every target they do not score -100 (a padded
    target too), so the labelled count is theirs."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    labelled = targets != IGNORE_INDEX
    rows = replica_rows(tokens.shape[0], ctx)
    tokens, targets = on_device(ctx, tokens[rows], targets[rows])
    return Batch(tokens, targets, {k: v[rows].to(ctx.device) for k, v in inputs.items()}, int(labelled.sum()))


def on_device(ctx: ParallelContext, *tensors) -> tuple:
    return tuple(t.to(ctx.device) for t in tensors)


def replica_rows(batch_size: int, ctx: ParallelContext) -> slice:
    """Rows of the global batch that this rank's data-parallel replica trains on."""
    per = batch_size // ctx.dp
    r = ctx.coord(MeshAxis.DP)
    return slice(r * per, (r + 1) * per)


def draw(tokens, step: int, *, seed: int, batch_size: int, length: int,
         rows: slice = slice(None)) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(windows (rows, length), the source each is from, its first token there) of rows `rows` of
    the batch of `step`: `batch_size` random windows, a function of (seed, step) only; only the
    windows of those rows are read. A Blend draws each row from one of its sources."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if isinstance(tokens, Blend):
        return tokens.step_windows(step, gen, seed=seed, batch_size=batch_size, length=length, rows=rows)
    starts = torch.randint(0, len(tokens) - length + 1, (batch_size,), generator=gen)[rows]
    return windows(tokens, starts, length), np.zeros(len(starts), dtype=np.int64), starts.numpy()


def global_batch(tokens, step: int, *, seed: int, batch_size: int, seq_len: int,
                 rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of the batch of `step` (`draw`): tokens and next tokens, (rows, T) each."""
    window, _, _ = draw(tokens, step, seed=seed, batch_size=batch_size, length=seq_len + 1, rows=rows)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def packed(window: torch.Tensor, which: np.ndarray, starts: np.ndarray, documents: list) -> tuple:
    """(tokens, targets, document ids, positions) of windows (n, T+1) of whole token streams, each
    from source `which` at token `starts` (`documents`: each source's document starts): the
    documents in a row numbered from 1 (the first may begin before the window), positions counted
    from each document's first token in the row, and the target after a document's last token
    ignored (-100), so that nothing is predicted or attended across a boundary."""
    length = window.shape[1]
    ids = np.stack([np.searchsorted(documents[k], s + np.arange(length), side="right") for k, s in zip(which, starts)])
    ids = torch.from_numpy(ids - ids[:, :1] + 1) if len(ids) else torch.ones(0, length, dtype=torch.int64)
    x, y = window[:, :-1], window[:, 1:].masked_fill(ids[:, 1:] != ids[:, :-1], IGNORE_INDEX)
    place = torch.arange(length - 1).expand(len(window), -1)
    first = torch.cat([torch.ones(len(window), 1, dtype=torch.bool), ids[:, 1:-1] != ids[:, :-2]], dim=1)
    positions = place - torch.cummax(torch.where(first, place, 0), dim=1).values
    return x.contiguous(), y.contiguous(), ids[:, :-1].contiguous(), positions.contiguous()


def train_batch(corpus: Corpus, step: int, ctx: ParallelContext, *, seed: int, batch_size: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's replica batch (B/dp, T) of step `step`, on ctx.device."""
    _check_batch(batch_size, seq_len, ctx.dp, corpus.train, "training")
    x, y = global_batch(corpus.train, step, seed=seed, batch_size=batch_size, seq_len=seq_len,
                        rows=replica_rows(batch_size, ctx))
    return x.to(ctx.device), y.to(ctx.device)


def val_windows(corpus: Corpus, *, batch_size: int, seq_len: int, num_batches: int) -> torch.Tensor:
    """(num_batches, batch_size, seq_len) windows evenly spread over the validation split: the
    global batches every validation of every run with these sizes reads."""
    return val_draw(corpus, batch_size=batch_size, length=seq_len, num_batches=num_batches)[0]


def val_draw(corpus: Corpus, *, batch_size: int, length: int, num_batches: int) -> tuple:
    """`val_windows`, with the source of each window and its first token there, (num_batches,
    batch_size) each."""
    n = batch_size * num_batches
    if isinstance(corpus.val, Blend):
        window, which, starts = corpus.val.spread(n, length)
    else:
        starts = torch.linspace(0, len(corpus.val) - length, n).long()
        window, which, starts = windows(corpus.val, starts, length), np.zeros(n, dtype=np.int64), starts.numpy()
    return (window.view(num_batches, batch_size, length), which.reshape(num_batches, batch_size),
            starts.reshape(num_batches, batch_size))


def val_batches(corpus: Corpus, ctx: ParallelContext, *, batch_size: int, seq_len: int,
                num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches (windows evenly spread over the split), this replica's
    rows of each. The same for every run with the same sizes, so validation losses compare."""
    _check_batch(batch_size, seq_len, ctx.dp, corpus.val, "validation")
    window = val_windows(corpus, batch_size=batch_size, seq_len=seq_len + 1, num_batches=num_batches)
    rows = replica_rows(batch_size, ctx)
    return [(w[rows, :-1].contiguous().to(ctx.device), w[rows, 1:].contiguous().to(ctx.device))
            for w in window]

