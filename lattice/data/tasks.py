"""What a run trains its model to do (`--task`), each from the run's tokenized text:

| task       | families      | a replica's batch                                   | the baseline printed         |
|------------|---------------|-----------------------------------------------------|------------------------------|
| `lm`       | gpt2, llama   | windows and the next token of each position         | unigram cross-entropy        |
| `mlm`      | bert          | windows with 15% of positions masked, their labels  | unigram cross-entropy        |
| `classify` | bert          | [CLS] + a text, one class id per sequence           | majority-class accuracy      |
| `seq2seq`  | t5            | a source and its target's labels (lattice.data.seq2seq)    | exact match of copying       |

Masked LM (Devlin et al. 2019, §3.1): every sequence predicts exactly round(0.15·T) positions
(as BERT's own data generator picks a fixed number per sequence), of which 80% read [MASK], 10%
a random token and 10% the token itself; the other positions' labels are -100. A fixed number
per sequence keeps the loss, the mean over the labelled positions, the same however the batch
is split over replicas and micro-batches.

Encoder tasks add three tokens after the tokenizer's vocabulary: [MASK], [CLS] and [PAD] (ids
V, V + 1, V + 2 of a model with V + 3 rows). Classification reads [CLS] + the text's first T - 1
tokens, padded with [PAD] to T; the padding is attended to (lattice has no attention mask).

Classification data: JSON lines `{"text": ..., "label": ...}` (`--text-key`, `--label-key`;
labels are strings or integers, numbered in sorted order; every tenth example is validation),
or, without --data, the built-in task: which of three standard-library modules (argparse,
tarfile, inspect: their Python source, which ships with every Python) a window of T - 1 tokens
comes from, windows from the first 90% of each file for training and the rest for validation,
classes balanced.

Every batch is a function of (seed, step) alone, as data.global_batch's are, and a replica takes
its rows of the global batch, so resumed and re-laid-out runs see the same data.
"""

from __future__ import annotations

import importlib.util
from functools import cached_property

import torch

from lattice.data.corpus import (VAL_FRACTION, Corpus, check_batch_size, global_batch, json_lines, on_device,
                                 replica_rows, train_batch, truncated, unigram_baseline, val_batches, val_windows)
from lattice.data.seq2seq import PAIR_TOKENS, Seq2Seq
from lattice.modes.kernels.loss import IGNORE_INDEX
from lattice.parallel.context import LatticeConfigError

TASKS = ("lm", "mlm", "classify", "seq2seq")
SPECIAL_TOKENS = ("[MASK]", "[CLS]", "[PAD]")  # the encoder tasks'; seq2seq's are lattice.data.seq2seq.PAIR_TOKENS
MASK_FRACTION, MASK_TOKEN, RANDOM_TOKEN = 0.15, 0.8, 0.1  # of the predicted positions: 80% [MASK], 10% random
BUILTIN_CLASSES = ("argparse", "tarfile", "inspect")
VAL_EVERY = 10  # every tenth JSON line is a validation example


def check_task(task: str, family) -> None:
    """One line unless `family` (a Model class) trains on `task`."""
    if task not in TASKS:
        raise LatticeConfigError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task not in family.tasks:
        raise LatticeConfigError(f"--arch {family.name} does not train on --task {task}; it trains on "
                                 f"{' or '.join(family.tasks)}")


def task_tokens(task: str) -> tuple[str, ...]:
    """The special tokens `task` appends to the tokenizer's vocabulary, in id order."""
    return {"lm": (), "seq2seq": PAIR_TOKENS}.get(task, SPECIAL_TOKENS)


def model_vocab(task: str, tokenizer_vocab: int) -> int:
    """Rows of the model's token table: the tokenizer's, plus the task's special tokens."""
    return tokenizer_vocab + len(task_tokens(task))


def task_model_fields(task: str, tokenizer_vocab: int) -> dict:
    """Config fields of the model a task fixes beside the vocabulary: an encoder-decoder's pad,
    decoder start and end tokens (the pair task's [PAD] and [EOS])."""
    if task != "seq2seq":
        return {}
    pad, eos = (tokenizer_vocab + PAIR_TOKENS.index(t) for t in PAIR_TOKENS)
    return {"pad_token_id": pad, "decoder_start_token_id": pad, "eos_token_id": eos}


def special_id(token: str, tokenizer_vocab: int) -> int:
    return tokenizer_vocab + SPECIAL_TOKENS.index(token)


class NextToken:
    """`lm`: the corpus windows and their next tokens (lattice.data.corpus)."""

    num_labels = 0
    metric, loss_unit = None, "token"  # no score beyond the loss

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def check(self, batch_size: int, seq_len: int, dp: int) -> None:
        check_batch_size(self.corpus, batch_size, seq_len, dp)

    def train_batch(self, step: int, ctx, *, seed: int, batch_size: int, seq_len: int):
        return train_batch(self.corpus, step, ctx, seed=seed, batch_size=batch_size, seq_len=seq_len)

    def val_batches(self, ctx, *, batch_size: int, seq_len: int, num_batches: int):
        return val_batches(self.corpus, ctx, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)

    def baseline(self) -> str:
        return f"unigram baseline: {unigram_baseline(self.corpus):.4f} nats/token"

    def truncation(self, seq_len: int) -> str | None:
        """What the batches cut off of the examples, in one line, or None (windows cut nothing)."""
        return None


class MaskedLM(NextToken):
    """`mlm`: corpus windows with BERT's masking."""

    def mask(self, window: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of token windows (n, T): round(0.15·T) positions per row predicted."""
        n, T = window.shape
        k = max(1, round(MASK_FRACTION * T))
        picked = torch.rand(n, T, generator=gen).argsort(dim=1)[:, :k]  # (n, k) distinct positions per row
        labels = torch.full_like(window, IGNORE_INDEX).scatter_(1, picked, window.gather(1, picked))
        roll = torch.rand(n, k, generator=gen)
        vocab = self.corpus.vocab_size
        random_tokens = torch.randint(0, vocab, (n, k), generator=gen)
        now = window.gather(1, picked)
        now = torch.where(roll < MASK_TOKEN, special_id("[MASK]", vocab), now)
        now = torch.where((roll >= MASK_TOKEN) & (roll < MASK_TOKEN + RANDOM_TOKEN), random_tokens, now)
        return window.clone().scatter_(1, picked, now), labels

    def train_batch(self, step, ctx, *, seed, batch_size, seq_len):
        window, _ = global_batch(self.corpus.train, step, seed=seed, batch_size=batch_size, seq_len=seq_len)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)  # masks of the global batch, then our rows
        x, y = self.mask(window, gen)
        rows = replica_rows(batch_size, ctx)
        return on_device(ctx, x[rows], y[rows])

    def val_batches(self, ctx, *, batch_size, seq_len, num_batches):
        self.check(batch_size, seq_len, ctx.dp)
        gen = torch.Generator().manual_seed(0)  # the same masks in every run
        rows = replica_rows(batch_size, ctx)
        return [on_device(ctx, *(t[rows] for t in self.mask(window, gen)))
                for window in val_windows(self.corpus, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)]


class Classify:
    """`classify`: [CLS] + text -> a class id; JSON lines or the built-in module task."""

    metric, loss_unit = "accuracy", "sequence"
    trivial_name = "majority-class baseline"

    def __init__(self, corpus: Corpus, *, data: str | None, text_key: str, label_key: str):
        self.corpus, self.data, self.text_key, self.label_key = corpus, data, text_key, label_key
        self.vocab = corpus.vocab_size

    @cached_property
    def examples(self) -> tuple[list, list, list[str]]:
        """(train, val, label names): lists of (token ids, class id) for JSON lines; for the
        built-in task, the modules' token streams split 90 / 10 and no examples."""
        if self.data is None:
            streams = {name: torch.tensor(self.corpus.encode(_module_source(name)), dtype=torch.int64)
                       for name in BUILTIN_CLASSES}
            split = {name: len(ids) - int(len(ids) * VAL_FRACTION) for name, ids in streams.items()}
            return ([streams[n][:split[n]] for n in BUILTIN_CLASSES], [streams[n][split[n]:] for n in BUILTIN_CLASSES],
                    list(BUILTIN_CLASSES))
        rows = read_labelled(self.data, self.text_key, self.label_key)
        names = sorted({label for _, label in rows}, key=lambda v: (isinstance(v, str), v))
        if len(names) < 2:
            raise LatticeConfigError(f"--data {self.data} has {len(names)} distinct label(s) under {self.label_key!r}; "
                                     f"classification needs at least 2")
        index = {name: i for i, name in enumerate(names)}
        encoded = [(self.corpus.encode(text), index[label]) for text, label in rows]
        val = encoded[VAL_EVERY - 1::VAL_EVERY]
        train = [e for i, e in enumerate(encoded) if i % VAL_EVERY != VAL_EVERY - 1]
        return train, val, [str(n) for n in names]

    @property
    def num_labels(self) -> int:
        return len(self.examples[2])

    def check(self, batch_size: int, seq_len: int, dp: int) -> None:
        if batch_size % dp:
            raise LatticeConfigError(f"batch size {batch_size} is not divisible by dp = {dp}; use a multiple of {dp}")
        train, val, _ = self.examples
        if self.data is None:
            short = min(min(len(t) for t in train), min(len(v) for v in val))
            if short < seq_len:
                raise LatticeConfigError(f"seq_len {seq_len} is longer than the built-in task's shortest split "
                                         f"({short} tokens); use a shorter --seq-len")
        elif len(val) < batch_size:
            raise LatticeConfigError(f"--data {self.data} has {len(val)} validation examples (every {VAL_EVERY}th "
                                     f"line), fewer than one batch of {batch_size}; give more examples or a smaller "
                                     f"--batch-size")

    def _sequences(self, ids: list, seq_len: int) -> torch.Tensor:
        cls, pad = special_id("[CLS]", self.vocab), special_id("[PAD]", self.vocab)
        out = torch.full((len(ids), seq_len), pad, dtype=torch.int64)
        out[:, 0] = cls
        for row, t in enumerate(ids):
            t = list(t[:seq_len - 1])
            out[row, 1:1 + len(t)] = torch.as_tensor(t, dtype=torch.int64)
        return out

    def _builtin(self, streams, labels: torch.Tensor, fractions: torch.Tensor, seq_len: int):
        """Windows of seq_len - 1 tokens of stream labels[i] at fraction fractions[i] of it."""
        ids = []
        for label, f in zip(labels.tolist(), fractions.tolist()):
            stream = streams[label]
            start = int(f * (len(stream) - seq_len + 1))
            ids.append(stream[start:start + seq_len - 1].tolist())
        return self._sequences(ids, seq_len)

    def train_batch(self, step, ctx, *, seed, batch_size, seq_len):
        train, _, _ = self.examples
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if self.data is None:
            labels = torch.randint(0, len(train), (batch_size,), generator=gen)
            x = self._builtin(train, labels, torch.rand(batch_size, generator=gen), seq_len)
        else:
            pick = torch.randint(0, len(train), (batch_size,), generator=gen)
            x = self._sequences([train[i][0] for i in pick.tolist()], seq_len)
            labels = torch.tensor([train[i][1] for i in pick.tolist()], dtype=torch.int64)
        rows = replica_rows(batch_size, ctx)
        return on_device(ctx, x[rows], labels[rows])

    def val_batches(self, ctx, *, batch_size, seq_len, num_batches):
        _, val, names = self.examples
        if self.data is None:  # classes in turn, windows evenly spread over each validation split
            n = batch_size * num_batches
            labels = torch.arange(n) % len(names)
            x = self._builtin(val, labels, torch.linspace(0, 1, n), seq_len)
        else:
            n = min(num_batches, len(val) // batch_size) * batch_size
            x = self._sequences([ids for ids, _ in val[:n]], seq_len)
            labels = torch.tensor([label for _, label in val[:n]], dtype=torch.int64)
        self.val_labels = labels  # every replica's
        rows = replica_rows(batch_size, ctx)
        return [on_device(ctx, x[i:i + batch_size][rows], labels[i:i + batch_size][rows]) for i in range(0, n, batch_size)]

    def score(self, model, batches) -> torch.Tensor:
        return accuracy(model, batches)

    def truncation(self, seq_len: int) -> str | None:
        """How many texts of --data are longer than a sequence holds after [CLS] (and the longest),
        which the batches cut to their first seq_len - 1 tokens; None when none is."""
        if self.data is None:
            return None
        lengths = [len(ids) for split in self.examples[:2] for ids, _ in split]
        return truncated("texts", lengths, seq_len - 1, "--seq-len")

    def trivial(self) -> float:
        """The accuracy of always answering the most frequent class of the validation batches."""
        return float(torch.bincount(self.val_labels).max()) / len(self.val_labels)

    def baseline(self) -> str:
        return f"majority-class baseline: accuracy {self.trivial():.3f}"


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise LatticeConfigError(f"the built-in classification task reads the standard library's {name}.py, which "
                                 f"this Python lacks; pass --data with JSON lines of text and label")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def read_labelled(spec: str, text_key: str, label_key: str) -> list[tuple[str, object]]:
    """(text, label) of every JSON line of `--data`, or one line naming the first that is not one."""
    out = []
    for path, n, (text, label) in json_lines(spec, (text_key, label_key), "--text-key / --label-key"):
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise LatticeConfigError(f"{path}:{n}: the label {label!r} is neither a string nor an integer")
        out.append((str(text), label))
    if not out:
        raise LatticeConfigError(f"--data {spec} holds no JSON lines; give labelled examples")
    return out


def make_task(task: str, corpus: Corpus, *, data: str | None, text_key: str, label_key: str, source_key: str,
              target_key: str, target_len: int | None):
    if task == "classify":
        return Classify(corpus, data=data, text_key=text_key, label_key=label_key)
    if task == "seq2seq":
        return Seq2Seq(corpus, data=data, source_key=source_key, target_key=target_key, target_len=target_len)
    return MaskedLM(corpus) if task == "mlm" else NextToken(corpus)


@torch.no_grad()
def accuracy(model, batches) -> torch.Tensor:
    """The fraction of `batches` (this replica's) whose class the model ranks first."""
    model.eval()
    hits = sum(float((model(x).argmax(dim=-1) == y).sum()) for x, y in batches)
    model.train()
    return torch.tensor(hits / sum(len(y) for _, y in batches), dtype=torch.float64)
