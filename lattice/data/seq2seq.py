"""`--task seq2seq`: pairs of token sequences for an encoder-decoder (T5): a source the encoder
reads and a target the decoder learns to produce, from JSON lines of translation-style pairs or
the built-in pair task.

| data                 | a source                                          | its target            |
|----------------------|---------------------------------------------------|-----------------------|
| `--data pairs.jsonl` | the `--source-key` field of a line, tokenized     | its `--target-key`    |
| built-in (no --data) | a window of seq_len tokens of the built-in corpus | the window reversed   |

One tokenizer reads both sides (trained on both fields of the JSON lines, or the built-in
corpus's). It gives the pad token (which pads a short source, and is the decoder's start token,
as T5 starts from its pad token) and the end token (which ends every target) where it has them
(a pretrained T5's <pad> and </s>); else two tokens follow its vocabulary: [PAD] (id V) and [EOS]
(V + 1). The model's config takes their ids. A source is cut to seq_len tokens and padded to
seq_len, its attention mask 0 at the padding; a target is cut to target_len - 1 tokens, the end
token appended, and its labels padded with -100 (ignored) to target_len, so that every batch has
the lengths the layout was checked for. Validation: every tenth pair of the JSON lines; the
built-in task's windows come from the corpus's validation split, evenly spread.

Exact match (every validation while training, and `lattice eval`): the share of validation
sources whose greedy output up to [EOS] (at most target_len tokens) equals the target. The
trivial baseline printed beside it answers every source with itself (copying), which reversal
defeats (a palindrome excepted) and translation pairs rarely allow.

Every batch is a function of (seed, step) alone, and a replica takes its rows of the global batch.
"""

from __future__ import annotations

from functools import cached_property

import torch

from lattice.data.batches import global_batch, replica_batch, truncated, val_windows
from lattice.data.corpus import Corpus
from lattice.data.text_files import json_lines
from lattice.modes.kernels.loss import IGNORE_INDEX
from lattice.parallel.context import LatticeConfigError

PAIR_TOKENS = ("[PAD]", "[EOS]")  # lattice's, appended where the tokenizer has no pad or end token
VAL_EVERY = 10  # every tenth JSON line is a validation pair


def read_pairs(spec: str, source_key: str, target_key: str) -> list[tuple[str, str]]:
    """(source, target) of every JSON line of `--data`, or one line naming the first that is not one."""
    out = [(str(s), str(t)) for _, _, (s, t) in json_lines(spec, (source_key, target_key), "--source-key / --target-key")]
    if not out:
        raise LatticeConfigError(f"--data {spec} holds no JSON lines; give source/target pairs")
    return out


class Seq2Seq:
    """`seq2seq`: (source, labels) batches of (B, seq_len) and (B, target_len)."""

    metric, loss_unit = "exact match", "token"
    scored_by_generation = True  # the score decodes greedily, which runs with pp = 1 and cp = 1
    trivial_name = "copying the source"

    def __init__(self, corpus: Corpus, *, data: str | None, source_key: str, target_key: str, target_len: int,
                 tokens):
        self.corpus, self.data, self.source_key, self.target_key = corpus, data, source_key, target_key
        self.target_len, self.tokens = target_len, tokens  # tokens: the task's TaskTokens
        self.pad, self.eos = tokens.ids["pad"], tokens.ids["eos"]

    @cached_property
    def pairs(self) -> tuple[list, list]:
        """(train, val) lists of (source ids, target ids) of the JSON lines."""
        encoded = [(self.corpus.encode(s), self.corpus.encode(t))
                   for s, t in read_pairs(self.data, self.source_key, self.target_key)]
        return ([e for i, e in enumerate(encoded) if i % VAL_EVERY != VAL_EVERY - 1],
                encoded[VAL_EVERY - 1::VAL_EVERY])

    @staticmethod
    def check_lengths(data: str | None, seq_len: int, target_len: int) -> None:
        """The lengths against the data, from the config alone (the launcher checks them too)."""
        if data is None and target_len < seq_len + 1:
            raise LatticeConfigError(f"the built-in pair task reverses windows of seq_len = {seq_len} tokens and ends "
                                     f"them with [EOS]: target_len = {target_len} is too short; pass --target-len "
                                     f"{seq_len + 1} or more (or a shorter --seq-len)")

    def check(self, batch_size: int, seq_len: int, dp: int) -> None:
        if batch_size % dp:
            raise LatticeConfigError(f"batch size {batch_size} is not divisible by dp = {dp}; use a multiple of {dp}")
        self.check_lengths(self.data, seq_len, self.target_len)
        if self.data is None:
            for split, tokens in (("training", self.corpus.train), ("validation", self.corpus.val)):
                if len(tokens) < seq_len + 1:
                    raise LatticeConfigError(f"the {split} split has {len(tokens)} tokens, fewer than a window of "
                                             f"seq_len = {seq_len}; use a shorter --seq-len")
        elif len(self.pairs[1]) < batch_size:
            raise LatticeConfigError(f"--data {self.data} has {len(self.pairs[1])} validation pairs (every "
                                     f"{VAL_EVERY}th line), fewer than one batch of {batch_size}; give more pairs or "
                                     f"a smaller --batch-size")

    def truncation(self, seq_len: int) -> str | None:
        """How many sources of --data are longer than seq_len, and targets than target_len - 1
        (with [EOS]), which the batches cut; None when none is."""
        if self.data is None:
            return None
        train, val = self.pairs
        notes = [truncated("sources", [len(s) for s, _ in train + val], seq_len, "--seq-len"),
                 truncated("targets", [len(t) for _, t in train + val], self.target_len - 1, "--target-len")]
        return "; ".join(filter(None, notes)) or None

    def _batch(self, sources: list, targets: list, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sources, labels, the sources' attention mask)."""
        x = torch.full((len(sources), seq_len), self.pad, dtype=torch.int64)
        mask = torch.zeros(len(sources), seq_len, dtype=torch.int64)
        y = torch.full((len(targets), self.target_len), IGNORE_INDEX, dtype=torch.int64)
        for row, (s, t) in enumerate(zip(sources, targets)):
            s, t = list(s[:seq_len]), list(t[:self.target_len - 1]) + [self.eos]
            x[row, :len(s)] = torch.as_tensor(s, dtype=torch.int64)
            mask[row, :len(s)] = 1
            y[row, :len(t)] = torch.as_tensor(t, dtype=torch.int64)
        return x, y, mask

    def _reversals(self, windows: torch.Tensor, seq_len: int):
        return self._batch(windows.tolist(), windows.flip(1).tolist(), seq_len)

    def train_batch(self, step, ctx, *, seed, batch_size, seq_len):
        if self.data is None:
            windows, _ = global_batch(self.corpus.train, step, seed=seed, batch_size=batch_size, seq_len=seq_len)
            x, y, mask = self._reversals(windows, seq_len)
        else:
            train, _ = self.pairs
            pick = torch.randint(0, len(train), (batch_size,), generator=torch.Generator().manual_seed(
                seed * 1_000_003 + step)).tolist()
            x, y, mask = self._batch([train[i][0] for i in pick], [train[i][1] for i in pick], seq_len)
        return replica_batch(ctx, x, y, attention_mask=mask)

    def val_batches(self, ctx, *, batch_size, seq_len, num_batches):
        self.check(batch_size, seq_len, ctx.dp)
        if self.data is None:
            windows = val_windows(self.corpus, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)
            batches = [self._reversals(w, seq_len) for w in windows]
        else:
            _, val = self.pairs
            n = min(num_batches, len(val) // batch_size) * batch_size
            batches = [self._batch([s for s, _ in val[i:i + batch_size]], [t for _, t in val[i:i + batch_size]],
                                   seq_len) for i in range(0, n, batch_size)]
        self.val_pairs = batches  # every replica's
        return [replica_batch(ctx, x, y, attention_mask=mask) for x, y, mask in batches]

    def score(self, model, batches) -> torch.Tensor:
        """Exact match of greedy outputs over `batches` (this replica's)."""
        hits = total = 0
        for x, y, inputs, _ in batches:
            out = model.generate(x, min(y.shape[1], model.cfg.target_len), **inputs)[:, 1:]
            for row in range(y.shape[0]):
                hits += _answer(out[row].tolist(), self.eos) == _labelled(y[row])
                total += 1
        return torch.tensor(hits / total, dtype=torch.float64)

    def trivial(self) -> float:
        """Exact match of copying: the source (without padding), then [EOS], as the answer."""
        pairs = [(x[r][mask[r].bool()], y[r]) for x, y, mask in self.val_pairs for r in range(x.shape[0])]
        copies = [x.tolist() + [self.eos] for x, _ in pairs]
        return sum(c == _labelled(y) for c, (_, y) in zip(copies, pairs)) / len(pairs)

    def baseline(self) -> str:
        return f"{self.trivial_name}: exact match {self.trivial():.3f}"


def _labelled(labels: torch.Tensor) -> list[int]:
    return labels[labels != IGNORE_INDEX].tolist()


def _answer(tokens: list[int], eos: int) -> list[int]:
    """Generated tokens up to and including the first [EOS]."""
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
