"""The settings of a mode's options that `lattice train` runs with where the person gives none:
the planner's fastest for the run's model, batch, precision and machine among those that fit the
device's memory. A mode's declared defaults are the settings measured fastest
(benchmarks/results/peer_blocks.txt); some cost memory (2d's and 3d's keep_gathered keeps q times
the blocks of every product's operands until backward) or win only at some shapes, which is what
pricing each setting on the run's own sizes settles.

    choice = choose_options(cfg, layout, given={}, batch=8, machine=machine_named("h100-node"),
                            memory_limit=0.9 * 80 * 2**30)
"""

from __future__ import annotations

from dataclasses import dataclass

from lattice.cost.machine import Machine
from lattice.modes import get_mode
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError
from lattice.planner.pricing import Choice, Priced, price
from lattice.planner.search import option_settings


@dataclass(frozen=True)
class OptionChoice:
    """The options a run takes (`options`: every option of the mode, those given as given), which
    of them were chosen here (`chosen`), and the price that chose them on `machine`."""

    options: dict
    chosen: tuple[str, ...]
    machine: str
    priced: Priced
    fits: bool  # False: no setting fits the memory limit, and this is the smallest

    def describe(self) -> str:
        """One line for the run's log: what was chosen, on which rates, and how to choose otherwise."""
        picked = ", ".join(f"{k}={self.options[k]}" for k in self.chosen)
        why = ("the fastest setting that fits the memory" if self.fits else
               "no setting fits the memory; the smallest")
        flags = ", ".join("--" + k.replace("_", "-") for k in self.chosen)
        return (f"{self.priced.choice.layout.mode} options: {picked} ({why}, priced for this model and batch on "
                f"{self.machine}: {self.priced.step_s * 1e3:.1f} ms a step, "
                f"{self.priced.memory['total'] / 2 ** 30:.2f} GiB on the fullest rank; {flags} to choose)")


def choose_options(cfg, layout: Layout, *, given: dict, batch: int, machine: Machine, memory_limit: float | None,
                   zero: int = 0, precision: str = "fp32", checkpointing: bool = False,
                   selective: bool = False) -> OptionChoice | None:
    """The planner's setting of the options of `layout`'s mode not in `given`, for `cfg` on a
    global batch of `batch` sequences: the fastest whose fullest rank fits `memory_limit` bytes
    (None: no limit), ties to the declared defaults; where none fits, the smallest. None where
    every option is given or no setting can be priced (the run's own checks then say why)."""
    mode = get_mode(layout.mode)
    free = tuple(k for k in mode.options if k not in given)
    if not free:
        return None
    if precision != machine.precision and not machine.other_precision_flop_rate:
        precision = machine.precision  # (a CPU preset has no bf16 rate: the settings are ranked at its own)
    priced, seen = [], set()
    for setting in option_settings(layout.mode, layout.tp):
        options = {**setting, **given}
        key = tuple(sorted(options.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            lay = layout.replace(options=options)
            if mode.size_problem(cfg, lay.context()) is not None:
                continue
            priced.append(price(cfg, Choice(lay, zero=zero, precision=precision, checkpointing=checkpointing,
                                            selective=selective), batch=batch, machine=machine))
        except LatticeConfigError:  # a setting this layout refuses (e.g. keep_gathered with summa=broadcast)
            continue
    if not priced:
        return None

    def off_default(p: Priced) -> int:
        return sum(p.choice.layout.options[k] != mode.options[k].default for k in free)

    fitting = [p for p in priced if memory_limit is None or p.memory["total"] <= memory_limit]
    best = (min(fitting, key=lambda p: (p.step_s, off_default(p))) if fitting else
            min(priced, key=lambda p: (p.memory["total"], p.step_s)))
    options = {k: best.choice.layout.options[k] for k in mode.options}
    return OptionChoice(options, free, machine.name, best, bool(fitting))
