"""The command line's flags for a layout and a training run, and what they derive: the layout's
keyword arguments, the TrainConfig, the resolved config a run records and `--config` TOML files."""

from __future__ import annotations

import argparse

from lattice.context import LatticeConfigError
from lattice.layout import PIPELINE_OPTIONS, PLACEMENTS
from lattice.models import DEFAULT_ARCH, available_archs, get_arch
from lattice.modes import REFERENCE_MODE, available_modes
from lattice.options import add_mode_option_flags, given_mode_options
from lattice.pipeline import SCHEDULES


def add_layout_arguments(p: argparse.ArgumentParser, arch_from_run: bool = False) -> None:
    p.add_argument("--arch", default=None, choices=available_archs(),
                   help="model family (default: the run's)" if arch_from_run else
                        f"model family (default {DEFAULT_ARCH}; with --resume, the run's)")
    p.add_argument("--mode", default=REFERENCE_MODE, choices=available_modes(),
                   help=f"parallel layout (default {REFERENCE_MODE})")
    p.add_argument("--tp", type=int, default=1, help="ranks per model replica (tensor parallel degree)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (a model replica is tp x pp ranks)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step with --pp (default pp)")
    p.add_argument("--pp-schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--pp-virtual", type=int, default=None, help="virtual stages per rank, interleaved (default 2)")
    p.add_argument("--pp-layers", default=None, metavar="N,N,...",
                   help="blocks per (virtual) stage (default: an even split)")
    p.add_argument("--pp-scatter-gather", action=argparse.BooleanOptionalAction, default=None,
                   help="send 1/tp of a replicated residual between stages and all-gather it (default on)")
    add_mode_option_flags(p)
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node for placement")
    p.add_argument("--placement", choices=PLACEMENTS, default=PLACEMENTS[0])
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default, e.g. small for gpt2; " +
                        "; ".join(f"{a}: {', '.join(get_arch(a).config_class.presets)}" for a in available_archs()) + ")")
    for flag, what in (("--d-model", "width"), ("--n-layers", "transformer blocks"), ("--n-heads", "attention heads"),
                       ("--seq-len", "context length")):
        p.add_argument(flag, type=int, default=None, help=f"{what} (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary of the built-in corpus")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from lattice.train import CHECKPOINT_FORMATS, DATA_FORMATS, DTYPES, ON_NAN, TrainConfig

    d = TrainConfig()
    add_layout_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local processes through torch.distributed.run")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on your own text: a file, a directory of files or a glob (default: the built-in corpus)")
    p.add_argument("--data-format", choices=DATA_FORMATS, default=d.data_format)
    p.add_argument("--text-key", default=d.text_key, help="the field of each JSON line (--data-format jsonl)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json or a directory holding one (default: a byte-level BPE trained on the data)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", "--batch", type=int, default=d.batch_size, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--out-dir", "--checkpoint-dir", default="runs/latest",
                   help="where checkpoints and metrics.csv go (default runs/latest)")
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--checkpoint-format", choices=CHECKPOINT_FORMATS, default=d.checkpoint_format,
                   help="sharded (default): every rank writes its own shards into OUT/checkpoints/step-N "
                        "(torch.distributed.checkpoint); single: rank 0 writes OUT/ckpt.pt of full tensors")
    p.add_argument("--keep", type=int, default=d.keep, metavar="K",
                   help=f"keep the newest K sharded checkpoints (default {d.keep}; 0 keeps all)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write sharded checkpoints on a background thread while training goes on")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="weights and optimizer state (float64 for exact comparisons; --bf16 is autocast)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="a run directory (its newest complete checkpoint), a checkpoint directory or a ckpt.pt")
    p.add_argument("--on-nan", choices=ON_NAN, default=d.on_nan,
                   help="a non-finite loss or gradient norm stops the run (default) or skips the step")
    p.add_argument("--dist-timeout", type=float, default=d.dist_timeout,
                   help="seconds a collective waits for the other ranks before the run fails and names the stalled "
                        f"rank (default {d.dist_timeout:.0f})")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: allow a different --steps/--lr/--warmup/--batch-size/--seed")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device, for the model FLOP utilisation logged to TensorBoard")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--config", default=None, metavar="TOML",
                   help="a TOML file of train flags (e.g. steps = 500, mode = \"1d\"); flags given here override it")


def layout_kwargs(args) -> dict:
    kw = dict(tp=args.tp, dp=args.dp, placement=args.placement, **given_mode_options(args))
    kw.update(pp=args.pp, **{k: getattr(args, k) for k in PIPELINE_OPTIONS if getattr(args, k) is not None})
    if args.ranks_per_node:
        kw["ranks_per_node"] = args.ranks_per_node
    return kw


def train_config(args):
    from lattice.data import DEFAULT_VOCAB
    from lattice.train import TrainConfig

    return TrainConfig(data=args.data, data_format=args.data_format, text_key=args.text_key, tokenizer=args.tokenizer,
                       arch=args.arch or DEFAULT_ARCH, model=args.model, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       seq_len=args.seq_len, vocab_size=args.vocab_size or DEFAULT_VOCAB, dropout=args.dropout,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
                       eval_interval=args.eval_interval, eval_batches=args.eval_batches, bf16=args.bf16,
                       activation_checkpointing=args.activation_checkpointing, out_dir=args.out_dir,
                       checkpoint_interval=args.checkpoint_interval, checkpoint_format=args.checkpoint_format,
                       keep=args.keep, async_checkpoint=args.async_checkpoint, dtype=args.dtype,
                       progress=not args.no_progress,
                       on_nan=args.on_nan, dist_timeout=args.dist_timeout, peak_tflops=args.peak_tflops)


def resolved_config(args) -> dict:
    """Every train flag's value for this run (defaults, config file and command line resolved)."""
    skip = {"command", "config", "nproc"}
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip and v is not None and v != []}


def config_toml(args) -> str:
    """The resolved config as a TOML file that `--config` reads back (JSON scalars, strings and
    lists are valid TOML values)."""
    import json

    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in resolved_config(args).items())


def with_config_file(parser: argparse.ArgumentParser, argv: list[str], path: str) -> argparse.Namespace:
    """Parse again with a TOML file's keys (train flags without the dashes, `-` or `_` alike)
    as defaults, so that flags given on the command line override the file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise LatticeConfigError("--config needs Python 3.11 or newer (tomllib)") from None
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as e:
        raise LatticeConfigError(f"--config {path} cannot be read ({e.strerror}); pass a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise LatticeConfigError(f"--config {path} is not valid TOML ({e}); fix the file") from None
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(argv[0]))
    known = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}
    given = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise LatticeConfigError(f"--config {path} has unknown keys {unknown}; use the names of `lattice {argv[0]}` "
                                 f"flags, e.g. {', '.join(sorted(known)[:6])}")
    sub.set_defaults(**given)
    return parser.parse_args(argv)
