"""Command-line flags derived from the modes' declared options (`Mode.options`), shared by
`lattice train`, `info`, `plan` and `bench`: one `--name-with-dashes` flag per option name, a
switch for a bool, a choice list where the option has choices; plus `-o KEY=VALUE`."""

from __future__ import annotations

import argparse
import ast
from dataclasses import field, fields

from lattice.modes import available_modes, get_mode
from lattice.parallel.context import LatticeConfigError


def declared_options() -> dict[str, tuple]:
    """{option name: (Option, [modes declaring it])} over every registered mode."""
    out: dict[str, tuple] = {}
    for mode in available_modes():
        for key, option in get_mode(mode).options.items():
            out.setdefault(key, (option, []))[1].append(mode)
    return out


def add_mode_option_flags(parser: argparse.ArgumentParser) -> None:
    for key, (option, modes) in declared_options().items():
        flag = "--" + key.replace("_", "-")
        help_text = f"{', '.join(modes)}: {option.help} (default {option.default})"
        if option.type is bool:
            # --name / --no-name: a switch that is on by default must be possible to turn off
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=key, type=option.type, choices=option.choices, default=None,
                                help=help_text)
    parser.add_argument("--mode-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the mode by its keyword name (repeatable), e.g. -o sequence_parallel=True "
                             "(default: none)")


def given_mode_options(args) -> dict:
    """The options given on the command line (flags left at None are not given); lattice.init
    refuses those the chosen mode does not take, naming its options."""
    opts = {key: getattr(args, key) for key in declared_options() if getattr(args, key, None) is not None}
    for item in getattr(args, "mode_option", []):
        key, sep, value = item.partition("=")
        if not sep:
            raise LatticeConfigError(f"--mode-option {item!r} is not KEY=VALUE; write e.g. -o sequence_parallel=True")
        try:
            opts[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            opts[key] = value
    return opts


def flag(default, help: str, **meta):
    """A dataclass field that is also a command-line flag (see lattice.cli.arguments.add_flags):
    `help` its help, and optionally `choices` (a callable giving them), `metavar`, `alias`."""
    return field(default=default, metadata={"flag": help, **meta})


def flag_fields(config_class) -> list:
    """The fields of a dataclass that are command-line flags (declared with `flag`)."""
    return [f for f in fields(config_class) if "flag" in f.metadata]
