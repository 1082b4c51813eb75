"""The command line's flags for a layout and a training run, and what they derive: the layout's
keyword arguments, the TrainConfig, the resolved config a run records and `--config` TOML files."""

from __future__ import annotations

import argparse
import os

from lattice.models import DEFAULT_ARCH, available_archs, family_sizes, get_arch
from lattice.modes.layout import Layout
from lattice.modes.options import add_mode_option_flags, flag_fields, given_mode_options
from lattice.parallel.context import LatticeConfigError

HELP_GROUPS = ("layout", "model", "data", "training", "checkpoints", "logging", "faults")


def group(p: argparse.ArgumentParser, title: str):
    """The parser's argument group of this title (created the first time), so that `--help`
    lists the flags as users scan them: layout, model, data, training, checkpoints, logging,
    faults."""
    for existing in p._action_groups:
        if existing.title == title:
            return existing
    return p.add_argument_group(title)


def add_flags(p: argparse.ArgumentParser, config_class, **defaults) -> None:
    """One flag per field of `config_class` that declares one (`lattice.modes.options.flag`):
    `--pp-schedule` for pp_schedule, with its help, choices and alias, in the help group the
    field names; `defaults` replaces a field's default. A bool is a --name / --no-name switch."""
    for f in flag_fields(config_class):
        meta, default = f.metadata, defaults.get(f.name, f.default)
        names = ["--" + f.name.replace("_", "-")] + ([meta["alias"]] if "alias" in meta else [])
        kind = f.type.split(" |")[0]
        # the field's own default, though a replaced one (None: "not given") is argparse's
        shown = "" if "default" in meta["flag"] else f" (default {f.default})" if f.default is not None else " (default: none)"
        where = group(p, meta.get("group", "layout"))
        if kind == "bool":
            where.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=meta["flag"] + shown)
        else:
            where.add_argument(*names, dest=f.name, type={"int": int, "float": float}.get(kind, str), default=default,
                               choices=meta["choices"]() if "choices" in meta else None, metavar=meta.get("metavar"),
                               help=meta["flag"] + shown)


def add_layout_flags(p: argparse.ArgumentParser, **defaults) -> None:
    """The flags of a `Layout` and the modes' option flags."""
    add_flags(p, Layout, **defaults)
    add_mode_option_flags(group(p, "layout"))
    if "dp" in defaults and defaults["dp"] is None:
        for action in p._actions:
            if action.dest == "dp":
                action.help = "data-parallel replicas (default: the processes over tp x pp x cp)"


def layout_from_args(args, **changes) -> Layout:
    """The Layout that the flags of `add_layout_flags` ask for, with `changes` to its fields. A
    command that starts processes leaves --dp to them (`add_layout_flags(p, dp=None)`): without it,
    the processes (--nproc, or torchrun's) over a replica's tp x pp x cp ranks where they divide,
    as Megatron-LM derives its data-parallel size, else 1."""
    given = {f.name: getattr(args, f.name) for f in flag_fields(Layout)}
    if given["dp"] is None:
        procs = getattr(args, "nproc", None) or int(os.environ.get("WORLD_SIZE", "1"))
        replica = given["tp"] * given["pp"] * given["cp"]
        given["dp"] = procs // replica if procs % replica == 0 else 1
    return Layout(**{**given, **changes}, options=given_mode_options(args))


def add_model_flags(p: argparse.ArgumentParser, arch_from_run: bool = False) -> None:
    """The family, its size preset and the preset's shape overrides."""
    p.add_argument("--arch", default=None, choices=available_archs(),
                   help="model family (default: the run's)" if arch_from_run else
                        f"model family (default {DEFAULT_ARCH}; with --resume, the run's)")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default, e.g. small for gpt2; " +
                        "; ".join(f"{a}: {', '.join(get_arch(a).config_class.presets)}" for a in available_archs()) + ")")
    if arch_from_run:  # the run's model: its sizes are the run's
        for flag, what in (("--d-model", "width"), ("--n-layers", "transformer blocks"),
                           ("--n-heads", "attention heads"), ("--seq-len", "context length")):
            p.add_argument(flag, type=int, default=None, help=f"{what} (default: the preset's)")
    else:
        add_size_flags(p)
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary of the built-in corpus")


def add_size_flags(p: argparse.ArgumentParser, skip=()) -> None:
    """One flag per size field of the families' configs (lattice.models.family_sizes: --d-model,
    --n-kv-heads, --sliding-window, ...; a bool is a --name / --no-name switch) but those in
    `skip`, each defaulting to the preset's, in the "model" help group."""
    where, every = group(p, "model"), len(available_archs())
    for name, (kind, families) in family_sizes().items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        owners = "" if len(families) == every else f" ({', '.join(families)})"
        text = f"the model config's {name}{owners} (default: the preset's)"
        if kind is bool:
            where.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            where.add_argument(flag, dest=name, type=kind, default=None, help=text)


def given_sizes(args, skip=()) -> dict:
    """The size flags of `add_size_flags` given on the command line (or in --config)."""
    return {name: getattr(args, name) for name in family_sizes()
            if name not in skip and getattr(args, name, None) is not None}


def add_layout_arguments(p: argparse.ArgumentParser, arch_from_run: bool = False, **defaults) -> None:
    add_layout_flags(p, **defaults)
    add_model_flags(p, arch_from_run)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """`lattice train`'s flags: the Layout's, the TrainConfig's and the launch's."""
    from lattice.training.config import RESUMED_FIELDS, TrainConfig

    for title in HELP_GROUPS:  # in the order users scan them
        group(p, title)
    add_layout_flags(p, dp=None)  # (the processes' own, without --dp)
    # the model defaults to a resumed run's (RESUMED_FIELDS); the run directory is chosen by
    # lattice.checkpoint.run_dir
    add_flags(p, TrainConfig, **dict.fromkeys(RESUMED_FIELDS))
    add_size_flags(p, skip={f.name for f in flag_fields(TrainConfig)})  # the family-specific sizes
    group(p, "layout").add_argument("--nproc", type=int, default=None,
                                    help="start this many local processes through torch.distributed.run (default: "
                                         "none, one process or those torchrun started)")
    group(p, "faults").add_argument("--max-restarts", type=int, default=0, metavar="N",
                                    help="start the workers again after one fails, up to N times; each restart "
                                         "resumes the run's newest intact checkpoint (default 0: a failure ends the "
                                         "run; under torchrun pass torchrun's own --max-restarts)")
    checkpoints = group(p, "checkpoints")
    checkpoints.add_argument("--resume", default=None, metavar="CKPT",
                             help="a run directory (its newest complete checkpoint), a checkpoint directory or a "
                                  "single file (converted first) (default: none, start fresh)")
    checkpoints.add_argument("--overwrite", action="store_true",
                             help="delete the run that --out-dir holds (with --resume: its checkpoints after the "
                                  "resumed step) instead of refusing (default: refused)")
    checkpoints.add_argument("--allow-config-change", action="store_true",
                             help="with --resume: allow a different --steps/--lr/--warmup/--batch-size/--seed "
                                  "(default: refused)")
    p.add_argument("--config", default=None, metavar="TOML",
                   help="a TOML file of train flags (e.g. steps = 500, mode = \"1d\"), as the config.toml a run "
                        "writes; flags given here override it (default: none)")


def train_request(args):
    """The `lattice train` request the flags make (lattice.training.request.TrainRequest): the
    layout, every TrainConfig flag as given, the family's size flags given, and the checkpoint
    and run-directory choices. Nothing is read or decided here."""
    from lattice.training.config import TrainConfig
    from lattice.training.request import TrainRequest

    given = {f.name: getattr(args, f.name) for f in flag_fields(TrainConfig)}
    return TrainRequest(layout_from_args(args), given, given_sizes(args, skip=set(given)), resume=args.resume,
                        overwrite=args.overwrite, allow_config_change=args.allow_config_change,
                        given_options=given_mode_options(args))


def with_config_file(argv: list[str], path: str) -> argparse.Namespace:
    """`lattice train`'s arguments with a TOML file's keys (train flags without the dashes, `-`
    or `_` alike) as defaults, so that flags given on the command line override the file."""
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
    parser = argparse.ArgumentParser(prog="lattice train")
    add_train_arguments(parser)
    known = set(vars(parser.parse_args([]))) - {"config"}
    given = {k.replace("-", "_"): v for k, v in values.items()}
    # config.toml of runs before the flags were derived from TrainConfig and training wrote only
    # sharded checkpoints
    if "no_progress" in given:
        given["progress"] = not given.pop("no_progress")
    if given.pop("checkpoint_format", "sharded") != "sharded":
        raise LatticeConfigError(f"--config {path} asks for checkpoint_format = \"single\"; training writes sharded "
                                 f"checkpoints only: drop the key, and export one file with `lattice convert RUN RUN.pt`")
    unknown = sorted(set(given) - known)
    if unknown:
        raise LatticeConfigError(f"--config {path} has unknown keys {unknown}; use the names of `lattice train` "
                                 f"flags, e.g. {', '.join(sorted(known)[:6])}")
    parser.set_defaults(**given)
    return parser.parse_args(argv[argv.index("train") + 1:])
