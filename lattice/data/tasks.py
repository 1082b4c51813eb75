"""What a run trains its model to do (`--task`), each from the run's tokenized text:

| task       | families      | a replica's batch                                   | the baseline printed         |
|------------|---------------|-----------------------------------------------------|------------------------------|
| `lm`       | gpt2, llama   | windows and the next token of each position         | unigram cross-entropy        |
| `mlm`      | bert          | windows with 15% of positions masked, their labels  | unigram cross-entropy        |
| `classify` | bert          | [CLS] text [SEP] (or a pair), one class id each     | majority-class accuracy      |
| `seq2seq`  | t5            | a source and its target's labels (lattice.data.seq2seq)    | exact match of copying       |

Masked LM (Devlin et al. 2019, §3.1): every sequence predicts exactly round(0.15·T) positions
(as BERT's own data generator picks a fixed number per sequence), of which 80% read [MASK], 10%
a random token and 10% the token itself; the other positions' labels are -100. A fixed number
per sequence keeps the loss, the mean over the labelled positions, the same however the batch
is split over replicas and micro-batches.

Encoder tasks read four special tokens, [MASK], [CLS], [PAD] and [SEP]: the tokenizer's own
where it has them (a pretrained BERT's WordPiece: `TaskTokens`), else lattice's, added after the
tokenizer's vocabulary (ids V .. V + 3 of a model with V + 4 rows). Classification reads [CLS]
text [SEP], or for a sentence pair (`--pair-key`) [CLS] a [SEP] b [SEP] with b's tokens (and its
[SEP]) of token type 1, cut to T (the longer text of a pair first), padded with [PAD] to T and
masked there (`attention_mask`: no position attends to padding).

Classification data: JSON lines `{"text": ..., "label": ...}` (`--text-key`, `--pair-key`,
`--label-key`; labels are strings or integers, numbered in sorted order; every tenth example is
validation), or, without --data, the built-in task: which of three standard-library modules
(argparse, tarfile, inspect: their Python source, which ships with every Python) a window of
T - 2 tokens comes from, windows from the first 90% of each file for training and the rest for
validation, classes balanced.

Every batch is a function of (seed, step) alone, as data.global_batch's are, and a replica takes
its rows of the global batch, so resumed and re-laid-out runs see the same data.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cached_property

import torch

from lattice.data.batches import (Batch, check_batch_size, draw, global_batch, packed, replica_batch, train_batch,
                                  truncated, val_batches, val_draw, val_windows)
from lattice.data.corpus import VAL_FRACTION, Corpus, unigram_baseline
from lattice.data.text_files import json_lines
from lattice.data.seq2seq import Seq2Seq
from lattice.modes.kernels.loss import IGNORE_INDEX
from lattice.parallel.context import LatticeConfigError

TASKS = ("lm", "mlm", "classify", "seq2seq")
SPECIAL_TOKENS = ("[MASK]", "[CLS]", "[PAD]", "[SEP]")  # the encoder tasks'; seq2seq's: seq2seq.PAIR_TOKENS
# the roles of the special tokens each task reads, in the order lattice appends those a tokenizer lacks
TASK_ROLES = {"mlm": ("mask", "cls", "pad", "sep"), "classify": ("mask", "cls", "pad", "sep"), "seq2seq": ("pad", "eos")}
APPENDED = {"mask": "[MASK]", "cls": "[CLS]", "pad": "[PAD]", "sep": "[SEP]", "eos": "[EOS]"}
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


@dataclass(frozen=True)
class TaskTokens:
    """The special tokens a task reads, by role, and their ids: the tokenizer's own where it has
    a token for the role (a pretrained tokenizer's [CLS], <pad>, ...: `lattice.data.corpus.
    tokenizer_specials`), else lattice's own, appended after the tokenizer's vocabulary in the
    task's order of roles (its own BPE has none: [MASK], [CLS], [PAD], [SEP] at V .. V + 3)."""

    ids: dict
    appended: tuple[str, ...]  # the roles lattice appended, in id order
    tokenizer_vocab: int

    @classmethod
    def of(cls, task: str, tokenizer_vocab: int, specials: dict | None = None) -> "TaskTokens":
        specials = specials or {}
        roles = TASK_ROLES.get(task, ())
        appended = tuple(r for r in roles if r not in specials)
        ids = {r: specials[r] for r in roles if r in specials}
        ids.update({r: tokenizer_vocab + i for i, r in enumerate(appended)})
        return cls(ids, appended, tokenizer_vocab)

    @property
    def model_vocab(self) -> int:
        """Rows of the model's token table: the tokenizer's, plus the tokens lattice appended."""
        return self.tokenizer_vocab + len(self.appended)

    def model_fields(self) -> dict:
        """Config fields of the model the tokens fix beside the vocabulary: an encoder-decoder's
        pad, decoder start (its pad, as T5's) and end tokens."""
        if "eos" not in self.ids:
            return {}
        return {"pad_token_id": self.ids["pad"], "decoder_start_token_id": self.ids["pad"], "eos_token_id": self.ids["eos"]}

    def describe(self, tokenizer) -> str | None:
        """One line: which special token has which id, and whose it is; None for a task without."""
        if not self.ids:
            return None
        own = [f"{tokenizer.id_to_token(i)} {i}" for r, i in self.ids.items() if r not in self.appended]
        added = [f"{APPENDED[r]} {self.ids[r]}" for r in self.appended]
        parts = ([", ".join(own) + " (the tokenizer's)"] if own else []) + \
                ([", ".join(added) + " (appended by lattice after its vocabulary)"] if added else [])
        return "special tokens: " + "; ".join(parts)


def special_id(token: str, tokenizer_vocab: int) -> int:
    """The id lattice appends `token` ([MASK], [CLS], [PAD], [SEP]) at for an encoder task when
    the tokenizer has no such token."""
    return tokenizer_vocab + SPECIAL_TOKENS.index(token)


class NextToken:
    """`lm`: the corpus windows and their next tokens (lattice.data.corpus)."""

    num_labels = 0
    metric, loss_unit = None, "token"  # no score beyond the loss
    name = "lm"

    def __init__(self, corpus: Corpus, pack_documents: bool = False):
        self.corpus, self.pack_documents = corpus, pack_documents
        self.tokens = TaskTokens.of(self.name, corpus.vocab_size, corpus.specials)
        if pack_documents:
            check_documents(corpus)

    def check(self, batch_size: int, seq_len: int, dp: int) -> None:
        check_batch_size(self.corpus, batch_size, seq_len, dp)

    def train_batch(self, step: int, ctx, *, seed: int, batch_size: int, seq_len: int) -> Batch:
        if self.pack_documents:  # the global batch's rows, for its count of labelled targets
            self.check(batch_size, seq_len, ctx.dp)
            drawn = draw(self.corpus.train, step, seed=seed, batch_size=batch_size, length=seq_len + 1)
            return self._packed(ctx, drawn, self.corpus.train_documents)
        x, y = train_batch(self.corpus, step, ctx, seed=seed, batch_size=batch_size, seq_len=seq_len)
        return Batch(x, y, {}, batch_size * seq_len)

    def val_batches(self, ctx, *, batch_size: int, seq_len: int, num_batches: int) -> list[Batch]:
        if self.pack_documents:
            self.check(batch_size, seq_len, ctx.dp)
            drawn = val_draw(self.corpus, batch_size=batch_size, length=seq_len + 1, num_batches=num_batches)
            return [self._packed(ctx, batch, self.corpus.val_documents) for batch in zip(*drawn)]
        return [Batch(x, y, {}, batch_size * seq_len) for x, y in
                val_batches(self.corpus, ctx, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)]

    @staticmethod
    def _packed(ctx, drawn, documents) -> Batch:
        """The replica's rows of windows packed from whole documents (lattice.data.batches.packed)."""
        x, y, ids, positions = packed(*drawn, documents)
        return replica_batch(ctx, x, y, attention_mask=ids, position_ids=positions)

    def baseline(self) -> str:
        return f"unigram baseline: {unigram_baseline(self.corpus):.4f} nats/token"

    def truncation(self, seq_len: int) -> str | None:
        """What the batches cut off of the examples, in one line, or None (windows cut nothing)."""
        return None


class MaskedLM(NextToken):
    """`mlm`: corpus windows with BERT's masking."""

    name = "mlm"

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
        now = torch.where(roll < MASK_TOKEN, self.tokens.ids["mask"], now)
        now = torch.where((roll >= MASK_TOKEN) & (roll < MASK_TOKEN + RANDOM_TOKEN), random_tokens, now)
        return window.clone().scatter_(1, picked, now), labels

    def train_batch(self, step, ctx, *, seed, batch_size, seq_len):
        window, _ = global_batch(self.corpus.train, step, seed=seed, batch_size=batch_size, seq_len=seq_len)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)  # masks of the global batch, then our rows
        return replica_batch(ctx, *self.mask(window, gen))

    def val_batches(self, ctx, *, batch_size, seq_len, num_batches):
        self.check(batch_size, seq_len, ctx.dp)
        gen = torch.Generator().manual_seed(0)  # the same masks in every run
        return [replica_batch(ctx, *self.mask(window, gen))
                for window in val_windows(self.corpus, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches)]


class Classify:
    """`classify`: [CLS] text [SEP] (a sentence pair: [CLS] a [SEP] b [SEP], b of token type 1),
    padded with [PAD] and its attention mask -> a class id; JSON lines or the built-in task."""

    metric, loss_unit = "accuracy", "sequence"
    trivial_name = "majority-class baseline"

    def __init__(self, corpus: Corpus, *, data: str | None, text_key: str, label_key: str, pair_key: str | None = None):
        self.corpus, self.data, self.text_key, self.label_key = corpus, data, text_key, label_key
        self.pair_key = pair_key
        self.tokens = TaskTokens.of("classify", corpus.vocab_size, corpus.specials)

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
        rows = read_labelled(self.data, self.text_key, self.label_key, self.pair_key)
        names = sorted({row[-1] for row in rows}, key=lambda v: (isinstance(v, str), v))
        if len(names) < 2:
            raise LatticeConfigError(f"--data {self.data} has {len(names)} distinct label(s) under {self.label_key!r}; "
                                     f"classification needs at least 2")
        index = {name: i for i, name in enumerate(names)}
        # a text's ids, or a pair's (a, b)
        encoded = [(tuple(self.corpus.encode(t) for t in row[:-1]) if self.pair_key else self.corpus.encode(row[0]),
                    index[row[-1]]) for row in rows]
        val = encoded[VAL_EVERY - 1::VAL_EVERY]
        train = [e for i, e in enumerate(encoded) if i % VAL_EVERY != VAL_EVERY - 1]
        return train, val, [str(n) for n in names]

    @property
    def num_labels(self) -> int:
        return len(self.examples[2])

    @property
    def label_names(self) -> list[str]:
        """Each class id's label as the data spell it (recorded in the run's data.json)."""
        return self.examples[2]

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

    def _sequences(self, ids: list, seq_len: int) -> tuple[torch.Tensor, dict]:
        """(tokens, inputs) of texts (or pairs): [CLS] a [SEP] [b [SEP]] cut to seq_len (the
        longer of a pair first) and padded, their attention mask and, for pairs, token types."""
        t = self.tokens.ids
        out = torch.full((len(ids), seq_len), t["pad"], dtype=torch.int64)
        mask = torch.zeros(len(ids), seq_len, dtype=torch.int64)
        types = torch.zeros(len(ids), seq_len, dtype=torch.int64) if self.pair_key else None
        for row, item in enumerate(ids):
            a, b = fit_pair(*item, seq_len - 3) if self.pair_key else (list(item[:seq_len - 2]), None)
            first = [t["cls"], *a, t["sep"]]
            whole = first + ([*b, t["sep"]] if b is not None else [])
            out[row, :len(whole)] = torch.as_tensor(whole, dtype=torch.int64)
            mask[row, :len(whole)] = 1
            if types is not None:
                types[row, len(first):len(whole)] = 1
        return out, {"attention_mask": mask, "token_types": types}

    def _builtin(self, streams, labels: torch.Tensor, fractions: torch.Tensor, seq_len: int):
        """Windows of seq_len - 2 tokens of stream labels[i] at fraction fractions[i] of it."""
        ids = []
        for label, f in zip(labels.tolist(), fractions.tolist()):
            stream = streams[label]
            start = int(f * (len(stream) - seq_len + 2))
            ids.append(stream[start:start + seq_len - 2].tolist())
        return self._sequences(ids, seq_len)

    def train_batch(self, step, ctx, *, seed, batch_size, seq_len):
        train, _, _ = self.examples
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if self.data is None:
            labels = torch.randint(0, len(train), (batch_size,), generator=gen)
            x, inputs = self._builtin(train, labels, torch.rand(batch_size, generator=gen), seq_len)
        else:
            pick = torch.randint(0, len(train), (batch_size,), generator=gen)
            x, inputs = self._sequences([train[i][0] for i in pick.tolist()], seq_len)
            labels = torch.tensor([train[i][1] for i in pick.tolist()], dtype=torch.int64)
        return replica_batch(ctx, x, labels, **inputs)

    def val_batches(self, ctx, *, batch_size, seq_len, num_batches):
        _, val, names = self.examples
        if self.data is None:  # classes in turn, windows evenly spread over each validation split
            n = batch_size * num_batches
            labels = torch.arange(n) % len(names)
            x, inputs = self._builtin(val, labels, torch.linspace(0, 1, n), seq_len)
        else:
            n = min(num_batches, len(val) // batch_size) * batch_size
            x, inputs = self._sequences([ids for ids, _ in val[:n]], seq_len)
            labels = torch.tensor([label for _, label in val[:n]], dtype=torch.int64)
        self.val_labels = labels  # every replica's
        return [replica_batch(ctx, x[i:i + batch_size], labels[i:i + batch_size],
                              **{k: v[i:i + batch_size] for k, v in inputs.items() if v is not None})
                for i in range(0, n, batch_size)]

    def score(self, model, batches) -> torch.Tensor:
        return accuracy(model, batches)

    def truncation(self, seq_len: int) -> str | None:
        """How many texts of --data are longer than a sequence holds after [CLS] (and the longest),
        which the batches cut to their first seq_len - 1 tokens; None when none is."""
        if self.data is None:
            return None
        if self.pair_key:
            lengths = [len(a) + len(b) for split in self.examples[:2] for (a, b), _ in split]
            return truncated("pairs", lengths, seq_len - 3, "--seq-len", cut="to that, the longer of its texts first")
        lengths = [len(ids) for split in self.examples[:2] for ids, _ in split]
        return truncated("texts", lengths, seq_len - 2, "--seq-len")

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


def fit_pair(a: list, b: list, room: int) -> tuple[list, list]:
    """A sentence pair cut to `room` tokens in all, as transformers' longest-first truncation
    cuts it: the shorter text keeps up to half the room (rounded down), the longer (a on a tie)
    the rest."""
    a, b = list(a), list(b)
    if len(a) + len(b) <= room:
        return a, b
    a_longer = len(a) >= len(b)
    shorter = min(len(b if a_longer else a), room // 2)
    return (a[:room - shorter], b[:shorter]) if a_longer else (a[:shorter], b[:room - shorter])


def read_labelled(spec: str, text_key: str, label_key: str, pair_key: str | None = None) -> list[tuple]:
    """(text, label) of every JSON line of `--data` ((text, pair, label) with `pair_key`), or one
    line naming the first that is not one."""
    out = []
    keys = (text_key, pair_key, label_key) if pair_key else (text_key, label_key)
    for path, n, values in json_lines(spec, keys, "--text-key / --pair-key / --label-key"):
        label = values[-1]
        if not isinstance(label, (str, int)) or isinstance(label, bool):
            raise LatticeConfigError(f"{path}:{n}: the label {label!r} is neither a string nor an integer")
        out.append((*(str(v) for v in values[:-1]), label))
    if not out:
        raise LatticeConfigError(f"--data {spec} holds no JSON lines; give labelled examples")
    return out


def check_documents(corpus: Corpus) -> None:
    """Refuse to pack documents the data do not mark."""
    if corpus.train_documents is None:
        raise LatticeConfigError("--pack-documents needs the documents' boundaries, which a flat token file does not "
                                 "mark: pass --tokenizer (its end-of-text token ends each document) or use "
                                 "--data-format megatron, text, jsonl or hf")


def make_task(task: str, corpus: Corpus, *, data: str | None, text_key: str, label_key: str, source_key: str,
              target_key: str, target_len: int | None, pair_key: str | None = None, pack_documents: bool = False):
    if task == "classify":
        return Classify(corpus, data=data, text_key=text_key, label_key=label_key, pair_key=pair_key)
    if task == "seq2seq":
        return Seq2Seq(corpus, data=data, source_key=source_key, target_key=target_key, target_len=target_len,
                       tokens=TaskTokens.of(task, corpus.vocab_size, corpus.specials))
    return MaskedLM(corpus) if task == "mlm" else NextToken(corpus, pack_documents)


@torch.no_grad()
def accuracy(model, batches) -> torch.Tensor:
    """The fraction of `batches` (this replica's) whose class the model ranks first."""
    model.eval()
    hits = sum(float((model(b.tokens, **b.inputs).argmax(dim=-1) == b.targets).sum()) for b in batches)
    model.train()
    return torch.tensor(hits / sum(len(b.targets) for b in batches), dtype=torch.float64)
