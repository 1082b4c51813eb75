"""The built-in corpus, its tokenizer, and the per-rank batches.

The corpus is real English that ships with Python itself: the help topics of `pydoc_data.topics`
(about 0.5 MB), so training needs no download. The tokenizer is a byte-level BPE trained on it
with `tokenizers` (every byte is in the initial alphabet, so any text encodes); it and the token
ids are cached under `$LATTICE_CACHE` (default `~/.cache/lattice`), keyed by a hash of the
corpus and the vocabulary size.

Batches: the global batch of step t is a function of (seed, t) alone, so a resumed run sees the
same data as an uninterrupted one. Data-parallel replica r of `dp` takes rows
[r*B/dp, (r+1)*B/dp) of it; every rank of one tensor-parallel group gets that same replica batch.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lattice.checkpoint import atomic_write
from lattice.context import LatticeConfigError, MeshAxis, ParallelContext

DEFAULT_VOCAB = 2048
VAL_FRACTION = 0.1


def corpus_text() -> str:
    """The built-in corpus: pydoc's help topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"


def cache_dir() -> Path:
    return Path(os.environ.get("LATTICE_CACHE") or Path.home() / ".cache" / "lattice")


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy does not append ".npy" to the name
        np.save(f, array)


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text` (all 256 bytes in the initial alphabet)."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise LatticeConfigError(f"vocab_size = {vocab_size} is below the 256 byte symbols plus one merge; "
                                 f"use at least 257 (default {DEFAULT_VOCAB})")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return tok


@dataclass
class Corpus:
    """Token ids of the built-in corpus split into train and validation, plus the tokenizer."""

    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64
    vocab_size: int
    tokenizer: object
    key: str  # cache key: hash of the corpus text and vocabulary size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def data_files(spec: str) -> list[Path]:
    """The files of `--data`: one file, every file of a directory (recursively), or a glob."""
    import glob

    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise LatticeConfigError(f"--data {spec} names no file (a file, a directory of files or a glob); "
                                 f"check the path")
    return files


def read_data(spec: str, data_format: str = "text", text_key: str = "text") -> str:
    """The text of `--data`: files joined by blank lines; JSON lines contribute their `text_key`."""
    import json

    parts = []
    for path in data_files(spec):
        raw = path.read_text(encoding="utf-8", errors="replace")
        if data_format == "jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    parts.append(str(json.loads(line)[text_key]))
                except (ValueError, KeyError, TypeError):
                    raise LatticeConfigError(f"{path}:{n} is not a JSON object with a {text_key!r} field; fix it or "
                                             f"pass --text-key") from None
        else:
            parts.append(raw)
    return "\n\n".join(parts)


def data_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_corpus(vocab_size: int = DEFAULT_VOCAB, *, text: str | None = None, cache: Path | None = None,
                tokenizer_path: str | None = None) -> Corpus:
    """Tokenize the corpus (built-in unless `text` is given), from cache when possible, with a
    byte-level BPE trained on it or the tokenizer at `tokenizer_path` (a tokenizer.json, or a
    directory holding one, e.g. a local HF tokenizer or a lattice run directory).

    The last VAL_FRACTION of the tokens is the validation split (contiguous, so no validation
    window overlaps training text)."""
    from tokenizers import Tokenizer

    text = corpus_text() if text is None else text
    given = None
    if tokenizer_path:
        given = Path(tokenizer_path) / "tokenizer.json" if Path(tokenizer_path).is_dir() else Path(tokenizer_path)
        if not given.is_file():
            raise LatticeConfigError(f"--tokenizer {tokenizer_path} has no tokenizer.json; pass a tokenizer.json or a "
                                     f"directory holding one")
    salt = given.read_text() if given else ""
    key = hashlib.sha256(f"{vocab_size}\0{salt}\0{text}".encode()).hexdigest()[:16]
    root = (cache or cache_dir()) / f"bpe-{vocab_size}-{key}"
    tok_path, ids_path = root / "tokenizer.json", root / "ids.npy"
    if not (tok_path.exists() and ids_path.exists()):
        bpe = Tokenizer.from_file(str(given)) if given else train_tokenizer(text, vocab_size)
        if given and bpe.get_vocab_size() > vocab_size:
            raise LatticeConfigError(f"--tokenizer {tokenizer_path} has {bpe.get_vocab_size()} tokens but "
                                     f"--vocab-size is {vocab_size}; pass --vocab-size {bpe.get_vocab_size()}")
        atomic_write(tok_path, lambda tmp: bpe.save(tmp))
        ids = np.asarray(bpe.encode(text).ids, dtype=np.int32)
        atomic_write(ids_path, lambda tmp: _save_npy(tmp, ids))
    tokenizer = Tokenizer.from_file(str(tok_path))
    ids = np.load(ids_path)
    ids = torch.from_numpy(ids.astype(np.int64))
    split = len(ids) - int(len(ids) * VAL_FRACTION)
    return Corpus(train=ids[:split], val=ids[split:], vocab_size=vocab_size, tokenizer=tokenizer, key=key)


def unigram_baseline(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) of the validation tokens under the training split's unigram
    frequencies with add-one smoothing: what a model that ignores context can reach."""
    counts = torch.bincount(corpus.train, minlength=corpus.vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return float(-log_p[corpus.val].mean())


def check_batch_size(corpus: Corpus, batch_size: int, seq_len: int, dp: int) -> None:
    """Raise a one-line LatticeConfigError unless the batch splits over dp and fits both splits."""
    for tokens, split in ((corpus.train, "training"), (corpus.val, "validation")):
        _check_batch(batch_size, seq_len, dp, tokens, split)


def _check_batch(batch_size: int, seq_len: int, dp: int, tokens: torch.Tensor, split: str):
    if batch_size % dp:
        lower = batch_size - batch_size % dp
        raise LatticeConfigError(f"batch size {batch_size} is not divisible by dp = {dp}; use a multiple of "
                                 f"{dp} (for example {lower or dp} or {lower + dp})")
    if len(tokens) < seq_len + 1:
        raise LatticeConfigError(f"the {split} split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                                 f"{seq_len + 1}; use a shorter seq_len or a larger corpus")


def replica_rows(batch_size: int, ctx: ParallelContext) -> slice:
    """Rows of the global batch that this rank's data-parallel replica trains on."""
    per = batch_size // ctx.dp
    r = ctx.coord(MeshAxis.DP)
    return slice(r * per, (r + 1) * per)


def global_batch(tokens: torch.Tensor, step: int, *, seed: int, batch_size: int,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of `step`: `batch_size` random windows, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
    window = tokens[idx]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_batch(corpus: Corpus, step: int, ctx: ParallelContext, *, seed: int, batch_size: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's replica batch (B/dp, T) of step `step`, on ctx.device."""
    _check_batch(batch_size, seq_len, ctx.dp, corpus.train, "training")
    x, y = global_batch(corpus.train, step, seed=seed, batch_size=batch_size, seq_len=seq_len)
    rows = replica_rows(batch_size, ctx)
    return x[rows].to(ctx.device), y[rows].to(ctx.device)


def val_batches(corpus: Corpus, ctx: ParallelContext, *, batch_size: int, seq_len: int,
                num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches (windows evenly spread over the split), this replica's
    rows of each. The same for every run with the same sizes, so validation losses compare."""
    _check_batch(batch_size, seq_len, ctx.dp, corpus.val, "validation")
    n = batch_size * num_batches
    starts = torch.linspace(0, len(corpus.val) - seq_len - 1, n).long()
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (n, T+1)
    window = corpus.val[idx].view(num_batches, batch_size, seq_len + 1)
    rows = replica_rows(batch_size, ctx)
    return [(w[rows, :-1].contiguous().to(ctx.device), w[rows, 1:].contiguous().to(ctx.device))
            for w in window]

