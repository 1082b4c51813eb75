"""The mode interface: the building blocks a layout supplies to the one GPT definition.

A mode decides how every activation and parameter is split over the ranks. `lattice.GPT` asks
its mode for an embedding, layer norms, linear layers (by block and position) and an LM head
with loss; it never looks at the layout itself. Adding a mode is one module in this package
plus `register`, and everything else reads the mode's declarations:

| declaration        | read by                                                            |
|--------------------|--------------------------------------------------------------------|
| `options`          | lattice.init (validation), the CLI (one flag per option), bench    |
| `mesh_axes`        | Topology (axes may be MeshAxis members or the mode's own Enum)     |
| `groups`           | lattice.init creates these multi-axis process groups once          |
| `rank_grid`        | placement="topology"                                               |
| shard specs        | loading, gathering, checkpoints, HF, gradient sync (`grad_sum`),   |
|                    | parameter memory and vocabulary padding in the cost model          |
| `cost_terms`       | lattice.cost (communication terms, FLOP shares, saved activations) |
| `test_layouts`     | the conformance suite (tests/test_conformance.py)                  |

Activations between blocks ("the residual layout") are always 3-d local tensors
(B_local, T_local, H_local); what the local sizes are is the mode's business.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn

from lattice.context import LatticeConfigError, MeshAxis, ParallelContext


class Block(str, enum.Enum):
    """Which sub-block a linear layer belongs to (sub-graph parallelism splits only attention)."""

    ATTENTION = "attention"
    MLP = "mlp"


class Position(str, enum.Enum):
    """First linear of a block (qkv, fc: expands) or second (proj: contracts back to d_model)."""

    IN = "in"
    OUT = "out"


@dataclass(frozen=True)
class Option:
    """A keyword option of lattice.init for one mode; the CLI derives `--name-with-dashes` from it
    (a bool becomes a switch, `choices` a choice list)."""

    default: Any
    help: str
    choices: tuple | None = None

    @property
    def type(self) -> type:
        return type(self.default)

    def check(self, mode: str, name: str, value: Any) -> None:
        if self.choices is not None and value not in self.choices:
            raise LatticeConfigError(f"mode {mode!r} option {name} must be one of {list(self.choices)}, got {value!r}")
        if self.type is bool and not isinstance(value, bool):
            raise LatticeConfigError(f"mode {mode!r} option {name} must be True or False, got {value!r}")
        if self.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise LatticeConfigError(f"mode {mode!r} option {name} must be an integer, got {value!r}")


class Mode:
    """Base class of every layout. Subclasses set `name`, `options`, `test_layouts` and override
    the factories and `cost_terms`."""

    name: ClassVar[str]
    #: keyword options of lattice.init that this mode accepts
    options: ClassVar[Mapping[str, Option]] = {}
    #: small layouts the conformance suite runs this mode in: lattice.init keyword arguments
    #: (tp, dp and options), each needing at most 8 processes. A mode without any fails the suite.
    test_layouts: ClassVar[Sequence[Mapping[str, Any]]] = ()
    #: an outside implementation of this same layout that `lattice bench` runs beside it
    #: ("dtensor": PyTorch's own tensor parallelism), or None
    peer: ClassVar[str | None] = None
    #: True when the residual stream is identical on every rank of a model replica (dropout on
    #: it then uses the replicated RNG stream); False when each rank holds a different piece
    residual_replicated: ClassVar[bool] = True

    def __init__(self, cfg, ctx: ParallelContext):
        self.cfg = cfg
        self.ctx = ctx
        self.check_config(cfg)

    # ---- topology (class level: no model needed)
    @classmethod
    def resolve_options(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(cls.options))
        if unknown:
            valid = ", ".join(cls.options) or "none"
            raise LatticeConfigError(
                f"mode {cls.name!r} does not take option(s) {unknown}; its options are: {valid}")
        for key, value in given.items():
            cls.options[key].check(cls.name, key, value)
        return {**{k: o.default for k, o in cls.options.items()}, **given}

    @classmethod
    def mesh_axes(cls, tp: int, options: Mapping[str, Any]) -> tuple[tuple[MeshAxis, int], ...]:
        """The model-parallel mesh axes (DP is added outside), for `tp` ranks per replica."""
        raise NotImplementedError

    @classmethod
    def fit_options(cls, cfg, tp: int) -> dict[str, Any]:
        """Options that make this layout fit a model on tp ranks when the user gives none (the
        benchmark's sweeps use them); the defaults unless a mode knows better."""
        return {}

    @classmethod
    def groups(cls, topology) -> tuple[tuple[Any, ...], ...]:
        """Process groups over SEVERAL mesh axes this mode communicates in (e.g. a plane of the
        cube). Single-axis groups and the whole model replica's group always exist."""
        return ()

    @classmethod
    def rank_grid(cls, axes, ranks_per_node: int, placement: str, options) -> tuple[int, ...]:
        """Global rank at each mesh position for placement="topology"; natural by default."""
        import math
        return tuple(range(math.prod(s for _, s in axes)))

    # ---- validation (every rank, before any collective)
    def check_config(self, cfg) -> None:
        """Raise LatticeConfigError when the model's sizes do not fit this layout."""

    def check_batch(self, tokens: torch.Tensor) -> None:
        """Raise LatticeConfigError when a batch's shape does not fit this layout."""

    # ---- building blocks
    def embedding(self) -> nn.Module:
        """tokens (B, T) int64, identical across the replica -> x in the residual layout."""
        raise NotImplementedError

    def layer_norm(self) -> nn.Module:
        """LayerNorm over d_model, residual layout in and out."""
        raise NotImplementedError

    def linear(self, in_features: int, out_features: int, *, block: Block, position: Position,
               stack: int | None = None) -> nn.Module:
        """y = x W + b with full W of shape (in, out), or (in, stack, out) when stacked.

        Position.IN takes the residual layout and returns this rank's part of the features,
        (B_l, T_l, [stack,] out_l); for attention out_l must be whole heads. Position.OUT takes
        that and returns the residual layout.
        """
        raise NotImplementedError

    def lm_head(self, embedding: nn.Module) -> nn.Module:
        """Module with loss(x, targets) -> mean cross-entropy over the replica batch (identical on
        every rank of the replica) and logits(x) -> full (B, T, V) logits."""
        raise NotImplementedError

    # ---- analysis
    @classmethod
    def optimus_table1_row(cls, b: int, s: int, h: int, p: int) -> dict[str, float] | None:
        """This layout's row of Optimus Table 1 (papers/000) as printed, if it has one: one layer
        with activation checkpointing, "forward"/"backward" scalars moved per rank and
        "forward_mults"/"backward_mults" scalar multiplications per rank."""
        return None

    def cost_terms(self, b) -> None:
        """Describe one training step of this layout to a `lattice.cost.CostBuilder`: its
        collectives (`b.add`), FLOP shares (`b.share`) and activations saved for backward
        (`b.activations`). Parameter memory, vocabulary padding, gradient sync and DP come from
        the shard specs and are added by the builder itself."""
        raise NotImplementedError(f"mode {self.name!r} has no cost terms")


def nearby_multiples(size: int, by: int) -> str:
    """The multiples of `by` next to `size`, for a hint: "8 or 12", or "4" below the first."""
    lower = size - size % by
    return " or ".join(str(n) for n in sorted({lower or by, lower + by}))


def divisible(what: str, size: int, by: int, by_what: str, fix: str = "") -> None:
    """Raise a one-line LatticeConfigError unless `size % by == 0`."""
    if size % by:
        hint = fix or f"use a multiple of {by} (for example {nearby_multiples(size, by)})"
        raise LatticeConfigError(f"{what} = {size} is not divisible by {by_what} = {by}; {hint}")
