"""A training run's configuration: `TrainConfig`, everything about a run but its layout (which is
the ParallelContext's). Each field with `flag` metadata is a `lattice train` flag
(lattice.cli.arguments derives them; `--config` TOML keys and the checkpoint's recorded train_config
use the same names); from it come the training text, the task and the model's config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from lattice import checkpoint
from lattice.data.corpus import DATA_FORMATS, DEFAULT_VOCAB, Corpus, load_corpus, load_data_corpus
from lattice.data.tasks import APPENDED, BUILTIN_CLASSES, TASKS, TaskTokens, check_task, make_task, read_labelled
from lattice.models import DEFAULT_ARCH, available_archs, family_sizes, get_arch
from lattice.models.recompute import recompute_kind
from lattice.modes.layout import Layout
from lattice.modes.options import flag, flag_fields
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.zero import ZERO_STAGES

DTYPES = ("float32", "float64")  # of the weights and optimizer state; bf16 is autocast (--bf16)
PRECISIONS = ("fp32", "bf16")  # bf16: bf16 weights with fp32 master rows in the optimizer (lattice.parallel.zero)
REDUCE_DTYPES = ("fp32", "bf16")  # of the data-parallel gradient reduction under --precision bf16
ON_NAN = ("stop", "skip")  # what a non-finite gradient norm does: stop the run, or skip the step
#: the schedule's defaults, where the family declares none of its own (`Model.train_defaults`)
RUN_DEFAULTS = {"steps": 300, "batch_size": 16, "warmup": 30}


@dataclass
class TrainConfig:
    """Everything about a run except the layout (which is the ParallelContext's)."""

    arch: str = flag(DEFAULT_ARCH, "model family (default gpt2; with --resume, the run's)", choices=available_archs,
                     group="model")
    model: str | None = flag(None, "size preset of the family (default its default, e.g. small for gpt2)",
                             metavar="PRESET", group="model")
    d_model: int | None = flag(None, "width (default: the preset's)", group="model")
    n_layers: int | None = flag(None, "transformer blocks (default: the preset's)", group="model")
    n_heads: int | None = flag(None, "attention heads (default: the preset's)", group="model")
    seq_len: int | None = flag(None, "context length; an encoder-decoder's longest source (default: the preset's)",
                               group="model")
    target_len: int | None = flag(None, "an encoder-decoder's longest target (t5; default: the preset's)",
                                  group="model")
    vocab_size: int = flag(DEFAULT_VOCAB, "vocabulary of the byte-level BPE trained on the data (the built-in corpus "
                                          "or --data)", group="model")
    data: str | None = flag(None, "train on your own data: a file, a directory of files or a glob, or a blend of "
                                  "weighted sources \"0.7 A 0.3 B\" (default: the built-in corpus)", metavar="PATH",
                            group="data")
    data_format: str = flag(DATA_FORMATS[0], "format of --data: text files (each a document), jsonl (a document per "
                                             "line), tokens (a flat uint16/uint32 token file, nanoGPT's .bin), "
                                             "megatron (an indexed .bin/.idx prefix), hf (parquet, arrow, JSON or CSV "
                                             "through HF datasets)", choices=lambda: DATA_FORMATS, group="data")
    pack_documents: bool = flag(False, "pack whole documents into each sequence, attention and positions restarting "
                                       "at every document and nothing predicted across one (--task lm)",
                                group="data")
    val_data: str | None = flag(None, "validate on these data (the format of --data) instead of the last 10%% of "
                                      "--data's documents", metavar="PATH", group="data")
    text_key: str = flag("text", "the field of each JSON line (--data-format jsonl)", group="data")
    task: str | None = flag(None, "what to train: lm (the next token), mlm (BERT's masked LM) or classify (a class per "
                                  "sequence: --data JSON lines with --label-key, or the built-in task), seq2seq (a "
                                  "target per source: --data JSON lines with --source-key and --target-key, or the "
                                  "built-in reversal task); default: the family's first (gpt2, llama: lm; bert: mlm; "
                                  "t5: seq2seq)", choices=lambda: TASKS, group="data")
    label_key: str = flag("label", "the class field of each JSON line (--task classify)", group="data")
    pair_key: str | None = flag(None, "the second text of a sentence pair in each JSON line (--task classify: [CLS] "
                                      "text [SEP] pair [SEP], the pair of token type 1)", group="data")
    source_key: str = flag("src", "the source field of each JSON line (--task seq2seq)", group="data")
    target_key: str = flag("tgt", "the target field of each JSON line (--task seq2seq)", group="data")
    tokenizer: str | None = flag(None, "a tokenizer.json or a directory holding one (default: a byte-level BPE "
                                       "trained on the data)", metavar="PATH", group="data")
    data_hash: str | None = None  # identity of the text trained on (set by the trainer)
    #: the family-specific sizes given as flags (--n-kv-heads, --sliding-window, ...: those of
    #: lattice.models.family_sizes that are not fields here), replacing the preset's
    model_sizes: dict = field(default_factory=dict)
    #: the model a resumed run continues (its checkpoint's config; `lattice train --resume` sets
    #: it): the shape flags given replace its fields, the preset is not consulted
    model_from: dict | None = None
    dropout: float = flag(0.0, "dropout probability", group="model")
    init_from: str | None = flag(None, "start from the weights of a lattice checkpoint or run directory (lattice "
                                       "convert --from hf writes one); what it lacks for this task (a new classifier) "
                                       "starts fresh, and its tokenizer.json is the run's unless --tokenizer",
                                 metavar="CKPT", group="checkpoints")
    steps: int | None = flag(None, "optimizer steps (default 300; t5: 2000)", group="training")
    stop_at: int | None = flag(None, "stop after this step with a checkpoint, to go on later with --resume (the "
                                     "schedule still runs to --steps), as for a job in a time-limited slot",
                                    group="training")
    batch_size: int | None = flag(None, "global batch: sequences per optimizer step, split over --dp replicas (default "
                                        "16; t5: 32)", alias="--batch", group="training")
    lr: float = flag(2e-3, "peak learning rate", group="training")
    min_lr_ratio: float = flag(0.1, "the cosine decays to lr x this", group="training")
    warmup: int | None = flag(None, "linear warmup steps (default 30; t5: 100)", group="training")
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices and embeddings)", group="training")
    beta1: float = flag(0.9, "AdamW beta1", group="training")
    beta2: float = flag(0.95, "AdamW beta2", group="training")
    grad_clip: float = flag(1.0, "max global gradient norm; 0 turns clipping off", group="training")
    seed: int = flag(0, "seed of the weights, data order and dropout", group="training")
    eval_interval: int = flag(100, "steps between validations", group="logging")
    eval_batches: int = flag(8, "validation batches", group="logging")
    bf16: bool = flag(False, "bf16 autocast", group="training")
    activation_checkpointing: bool = flag(False, "recompute each block in backward", group="training")
    selective_checkpointing: bool = flag(False, "recompute each block's element-wise work in backward, keeping what "
                                                "its matrix products and fused attention return (torch's selective "
                                                "activation checkpointing): memory between none and "
                                                "--activation-checkpointing, for a fraction of the latter's time",
                                         group="training")
    zero: int = flag(0, "distributed optimizer over the --dp replicas: 1 splits the AdamW moments (ZeRO-1, Megatron's "
                        "distributed optimizer), 2 also the gradients, 3 also the weights (fully sharded data "
                        "parallelism: each block's gathered around its forward and backward); 0 keeps everything on "
                        "every replica (DDP)", choices=lambda: ZERO_STAGES, group="training")
    reshard_after_forward: bool = flag(True, "with --zero 3: free each block's gathered weights after its forward and "
                                             "gather them again for its backward; off keeps them from the forward to "
                                             "the gradient reduction (one gather a step, a model's weights in memory)",
                                       group="training")
    reshard_microbatches: bool = flag(False, "with --zero 3 and several micro-batches a step (a pipeline, gradient "
                                             "accumulation): gather and free each block's weights around every "
                                             "micro-batch's forward and backward, rather than once a step",
                                      group="training")
    overlap_grad_reduce: bool | None = flag(None, "with the distributed optimizer (--zero, --precision bf16): each "
                                                  "bucket's reduction starts in backward once its gradients are "
                                                  "complete (under a pipeline, in the last micro-batch's), rather than "
                                                  "after backward (Megatron-LM's --overlap-grad-reduce; default: on; "
                                                  "on 2 CPU cores within 4%% of off)", group="training")
    overlap_param_gather: bool | None = flag(None, "with --zero 1 or 2: each bucket's all-gather of updated weights "
                                                   "runs beside the next forward, awaited before the first layer reading "
                                                   "it (Megatron-LM's --overlap-param-gather); with --zero 3: the next "
                                                   "block's gather starts as a block starts (default: on with --zero)",
                                             group="training")
    out_dir: str | None = flag(None, "where checkpoints and metrics.csv go; lattice train without it: a new runs/run-N "
                               "(runs/latest links to the newest), or with --resume the resumed run's directory",
                               alias="--checkpoint-dir", group="checkpoints")
    checkpoint_interval: int = flag(100, "steps between checkpoints (0: only at the end)", group="checkpoints")
    keep: int = flag(3, "keep K checkpoints: the one just written and the newest others (0 keeps all)", metavar="K", group="checkpoints")
    async_checkpoint: bool = flag(False, "write sharded checkpoints on a background thread while training goes on",
                                  group="checkpoints")
    dtype: str = flag(DTYPES[0], "weights and optimizer state (float64 for exact comparisons; --bf16 is autocast)",
                      choices=lambda: DTYPES, group="training")
    precision: str = flag(PRECISIONS[0], "bf16: bf16 weights, activations and gradients, fp32 master weights and AdamW "
                                         "moments in the optimizer, fp32 gradient reduction, loss and softmax statistics "
                                         "in fp32 (as Megatron-LM); fp32: --dtype throughout (--bf16 is autocast over fp32 "
                                         "weights instead)", choices=lambda: PRECISIONS, group="training")
    grad_reduce_dtype: str = flag(REDUCE_DTYPES[0], "dtype of the data-parallel gradient reduction with --precision bf16",
                                  choices=lambda: REDUCE_DTYPES, group="training")
    progress: bool = flag(True, "progress: a bar on a terminal, plain lines otherwise", group="logging")
    on_nan: str = flag(ON_NAN[0], "a non-finite loss or gradient norm stops the run or skips the step",
                       choices=lambda: ON_NAN, group="faults")
    dist_timeout: float = flag(300.0, "seconds a collective waits for the other ranks before the run fails and "
                                      "names the stalled rank", group="faults")
    peak_tflops: float | None = flag(None, "peak TFLOP/s of one device, for the model FLOP utilisation logged to "
                                           "TensorBoard", group="logging")

    def __post_init__(self):
        for name, default in RUN_DEFAULTS.items():  # the family's schedule where none is given
            if getattr(self, name) is None:
                setattr(self, name, get_arch(self.arch).train_defaults.get(name, default))
        recompute_kind(self.activation_checkpointing, self.selective_checkpointing)  # one of them at most
        for name in ("steps", "batch_size", "eval_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise LatticeConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise LatticeConfigError(f"stop_at must be a step of the run, 1 to steps = {self.steps}; got {self.stop_at}")
        for name in ("warmup", "checkpoint_interval", "keep"):
            if getattr(self, name) < 0:
                raise LatticeConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        # (NaN fails every comparison: each range is stated so that NaN falls outside it)
        for name, low, high, closed_low, closed_high in (
                ("lr", 0.0, math.inf, False, False), ("min_lr_ratio", 0.0, 1.0, True, True),
                ("weight_decay", 0.0, math.inf, True, False), ("beta1", 0.0, 1.0, True, False),
                ("beta2", 0.0, 1.0, True, False), ("grad_clip", 0.0, math.inf, True, False),
                ("dist_timeout", 0.0, math.inf, False, False), ("peak_tflops", 0.0, math.inf, False, False)):
            value = getattr(self, name)
            if value is None and name == "peak_tflops":
                continue
            inside = (low <= value if closed_low else low < value) and (value <= high if closed_high else value < high)
            if not inside:
                interval = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
                raise LatticeConfigError(f"--{name.replace('_', '-')} {value} is out of range: it must be a finite "
                                         f"number in {interval}")
        if self.data_format not in DATA_FORMATS:
            raise LatticeConfigError(f"data_format must be one of {DATA_FORMATS}, got {self.data_format!r}")
        if self.on_nan not in ON_NAN:
            raise LatticeConfigError(f"on_nan must be one of {ON_NAN}, got {self.on_nan!r}")
        if self.precision not in PRECISIONS or self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise LatticeConfigError(f"precision must be one of {PRECISIONS} and grad_reduce_dtype one of "
                                     f"{REDUCE_DTYPES}; got {self.precision!r}, {self.grad_reduce_dtype!r}")
        if self.precision == "bf16" and (self.bf16 or self.dtype != "float32"):
            raise LatticeConfigError(f"--precision bf16 keeps bf16 weights with fp32 master weights; it does not combine "
                                     f"with {'--bf16 (autocast over fp32 weights)' if self.bf16 else '--dtype ' + self.dtype}:"
                                     f" pass one of them")
        if self.grad_reduce_dtype != "fp32" and self.precision != "bf16":
            raise LatticeConfigError("--grad-reduce-dtype bf16 reduces bf16 gradients; it needs --precision bf16")
        if self.zero not in ZERO_STAGES:
            raise LatticeConfigError(f"zero must be one of {ZERO_STAGES} (1: optimizer state split over dp, 2: and the "
                                     f"gradients, 3: and the weights), got {self.zero!r}")
        if self.overlap_grad_reduce is not None and not self.distributed_optimizer:
            raise LatticeConfigError("--overlap-grad-reduce times the distributed optimizer's reductions (--zero 1 or 2, "
                                     "or --precision bf16); without it DDP always overlaps its all-reduce with backward")
        if self.overlap_param_gather and self.zero == 0:
            raise LatticeConfigError("--overlap-param-gather overlaps the distributed optimizer's all-gather of updated "
                                     "weights with the next forward; it needs --zero 1, 2 or 3")
        if self.zero != 3 and (not self.reshard_after_forward or self.reshard_microbatches):
            given = "--no-reshard-after-forward" if not self.reshard_after_forward else "--reshard-microbatches"
            raise LatticeConfigError(f"{given} chooses when ZeRO-3 frees the weights it gathered; it needs --zero 3 "
                                     f"(this run has --zero {self.zero})")
        if self.dtype not in DTYPES:
            raise LatticeConfigError(f"dtype must be one of {DTYPES} (bf16 is --bf16 autocast), got {self.dtype!r}")
        check_task(self.task_name, get_arch(self.arch))
        if self.pack_documents and self.task_name != "lm":
            raise LatticeConfigError(f"--pack-documents packs the documents of next-token training (--task lm); --task "
                                     f"{self.task_name} reads its examples one by one")
        if self.task_name == "classify" and self.data is not None and self.data_format != "jsonl":
            raise LatticeConfigError("--task classify reads labelled JSON lines: pass --data-format jsonl (with "
                                     "--text-key and --label-key)")
        if self.task_name == "seq2seq" and self.data is not None and self.data_format != "jsonl":
            raise LatticeConfigError("--task seq2seq reads source/target pairs from JSON lines: pass --data-format "
                                     "jsonl (with --source-key and --target-key)")
        config_class = get_arch(self.arch).config_class
        declared = {f.name for f in fields(config_class)}
        if set(self.model_sizes) - declared:
            flags = ", ".join("--" + n.replace("_", "-") for n in sorted(set(self.model_sizes) - declared))
            raise LatticeConfigError(f"--arch {self.arch} has no {flags} (its sizes: "
                                     f"{', '.join(sorted(declared & set(family_sizes())))}); drop it")
        if self.target_len is not None and "target_len" not in declared:
            raise LatticeConfigError(f"--target-len is an encoder-decoder's (t5); --arch {self.arch} reads one "
                                     f"sequence of --seq-len tokens")
        if self.init_from and self.tokenizer is None and Path(self.init_from).exists():
            # the text is read as the weights were trained to read it
            run_tokenizer = checkpoint.run_of(self.init_from) / "tokenizer.json"
            if run_tokenizer.is_file():
                self.tokenizer = str(run_tokenizer)

    @property
    def recompute(self) -> dict:
        """The recomputation flags, as build_model and the cost model take them."""
        return dict(activation_checkpointing=self.activation_checkpointing,
                    selective_checkpointing=self.selective_checkpointing)

    @property
    def param_dtype(self):
        """The weights' dtype: bf16 under --precision bf16, else --dtype."""
        import torch

        return torch.bfloat16 if self.precision == "bf16" else getattr(torch, self.dtype)

    @property
    def distributed_optimizer(self) -> bool:
        """Whether lattice.parallel.zero's optimizer steps this run (ZeRO, or master weights of bf16 ones)."""
        return bool(self.zero) or self.precision == "bf16"

    @property
    def task_name(self) -> str:
        return self.task or get_arch(self.arch).tasks[0]

    def make_task(self, corpus: Corpus, model_config):
        return make_task(self.task_name, corpus, data=self.data, text_key=self.text_key, label_key=self.label_key,
                         source_key=self.source_key, target_key=self.target_key,
                         target_len=self.batch_lengths(model_config)[1], pair_key=self.pair_key,
                         pack_documents=self.pack_documents)

    def num_labels(self) -> int:
        """The classes of a classification run (read from --data), 0 for other tasks."""
        if self.task_name != "classify":
            return 0
        if self.data is None:
            return len(BUILTIN_CLASSES)
        labels = {row[-1] for row in read_labelled(self.data, self.text_key, self.label_key, self.pair_key)}
        if len(labels) < 2:
            raise LatticeConfigError(f"--data {self.data} has {len(labels)} distinct label(s) under "
                                     f"{self.label_key!r}; classification needs at least 2")
        return len(labels)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def corpus(self) -> Corpus:
        """The training text (own data or the built-in corpus), tokenized; records its hash."""
        if self.data is None:
            return load_corpus(self.vocab_size, tokenizer_path=self.tokenizer)
        # one tokenizer for both sides of pairs
        corpus = load_data_corpus(self.data, self.vocab_size, data_format=self.data_format, text_key=self.data_keys(),
                                  tokenizer_path=self.tokenizer, val_data=self.val_data)
        self.data_hash = corpus.content_hash  # hashed once, while finding the token cache
        return corpus

    def batch_lengths(self, model_config) -> tuple[int, int | None]:
        """(sequence length, an encoder-decoder's target length or None) of the run's batches: the
        model's, or for a model adopted from a checkpoint (`model_from`, which keeps its maximum)
        the --seq-len and --target-len given."""
        target = getattr(model_config, "target_len", None)
        if self.model_from is None:
            return model_config.seq_len, target
        return self.seq_len or model_config.seq_len, (self.target_len or target) if target is not None else None

    def data_keys(self) -> str | tuple[str, ...]:
        """The fields of --data's JSON lines the tokenizer reads (both sides of a pair)."""
        if self.task_name == "seq2seq":
            return self.source_key, self.target_key
        return (self.text_key, self.pair_key) if self.pair_key else self.text_key

    def model_config(self, vocab_size: int | None = None, specials: dict | None = None):
        """The model this run trains: the family's preset (or `model_from`, a resumed run's
        model) with the shape overrides, its token table the tokenizer's `vocab_size` plus the
        special tokens lattice appends for the task (those of roles the tokenizer's `specials`
        lack; an encoder-decoder's config takes their ids; a resumed model keeps its own)."""
        config_class = get_arch(self.arch).config_class
        shape = {k: getattr(self, k) for k in ("d_model", "n_layers", "n_heads", "seq_len", "target_len")
                 if getattr(self, k)}
        if self.task_name == "classify":
            shape["num_labels"] = self.num_labels()
        tokens = TaskTokens.of(self.task_name, vocab_size or self.vocab_size, specials)
        if self.model_from is not None:
            # the checkpoint's lengths are its maximum (a position table, rotary's range): the
            # run's batches may be shorter (`batch_lengths`), never longer
            for name in ("seq_len", "target_len"):
                given, most = shape.pop(name, None), self.model_from.get(name)
                if given is not None and most is not None and given > most:
                    raise LatticeConfigError(f"--{name.replace('_', '-')} {given} exceeds the checkpoint model's "
                                             f"{name} = {most} (the longest sequence it takes); pass at most {most}")
            cfg = config_class.from_dict({**self.model_from, "dropout": self.dropout, **self.model_sizes, **shape})
            if tokens.appended and cfg.vocab_size < tokens.model_vocab:
                missing = ", ".join(APPENDED[r] for r in tokens.appended)
                raise LatticeConfigError(f"the checkpoint's model has {cfg.vocab_size} token rows, and --task "
                                         f"{self.task_name} needs {tokens.model_vocab}: the tokenizer has no {missing}; "
                                         f"pass the tokenizer the checkpoint was trained with (--tokenizer DIR)")
            return cfg
        return config_class.preset(self.model or config_class.default_preset, dropout=self.dropout,
                                   vocab_size=tokens.model_vocab, **tokens.model_fields(), **self.model_sizes, **shape)


#: what a resumed run keeps unless its flag is given: the model (family, preset, sizes, the
#: tokenizer's vocabulary), the task it was trained on and how its data are read, its schedule
#: and optimizer, its precision, validation and checkpoints: a bare --resume continues as it was
RESUMED_FIELDS = ("arch", "model", "d_model", "n_layers", "n_heads", "seq_len", "target_len", "vocab_size", "task",
                  "dropout", "data_format", "val_data", "pack_documents", "text_key", "label_key", "pair_key",
                  "source_key", "target_key",
                  "steps", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay", "beta1", "beta2", "grad_clip", "seed",
                  "eval_interval", "eval_batches", "activation_checkpointing", "selective_checkpointing", "zero", "checkpoint_interval", "keep",
                  "dtype", "precision", "grad_reduce_dtype")


def flag_defaults() -> dict:
    """Every TrainConfig flag's default, by field name."""
    return {f.name: f.default for f in flag_fields(TrainConfig)}


def run_config(layout: Layout, tcfg) -> dict:
    """A run's settings by flag name, from the fields of its Layout (with its mode's options)
    and its TrainConfig: what `lattice train` prints, writes to config.toml and reads back with
    `--config`."""
    out = {f.name: getattr(layout, f.name) for f in flag_fields(Layout)}
    out.update(layout.options)
    out.update({f.name: getattr(tcfg, f.name) for f in flag_fields(TrainConfig)})
    out.update(tcfg.model_sizes)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(out.items()) if v is not None}


def config_toml(config: dict) -> str:
    """A run_config as a TOML file that `--config` reads back (JSON scalars, strings and lists
    are valid TOML values)."""
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items())
