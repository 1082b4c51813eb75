"""The mode interface: the building blocks a layout supplies to every model family.

A mode decides how every activation and parameter is split over the ranks. A family
(lattice/models/) asks its mode for an embedding (with or without a position table), norms
(LayerNorm or RMSNorm), linear layers (by block and position; the first may be stacked or cut
into segments of different widths), parameters split like the attention heads, an LM head with
loss and the pooling of one position for other heads; it never looks at the layout itself.
Adding a mode is one module in this package plus `register`, and everything else reads the
mode's declarations:

| declaration        | read by                                                            |
|--------------------|--------------------------------------------------------------------|
| `options`          | lattice.init (validation), the CLI (one flag per option), bench    |
| `mesh_axes`        | Topology (axes may be MeshAxis members or the mode's own Enum)     |
| `groups`           | lattice.init creates these multi-axis process groups once          |
| `rank_grid`        | placement="topology"                                               |
| shard specs        | loading, gathering, checkpoints, HF, gradient sync (`grad_sum`),   |
|                    | parameter memory and vocabulary padding in the cost model          |
| `cost_*`           | lattice.cost (each operation's collectives, saved activations and  |
|                    | share of the work)                                                 |
| `test_layouts`     | the conformance suite (tests/test_conformance.py)                  |

Activations between blocks ("the residual layout") are always 3-d local tensors
(B_local, T_local, H_local); what the local sizes are is the mode's business.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn

from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, nearest_working
from lattice.parallel.sharding import ShardSpec, register_sharded


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


class PerHeadTable(nn.Module):
    """`weight`, a table whose rows are read by index (`Mode.per_head`): called, so that what
    hooks modules (ZeRO-3's gathers) sees it read."""

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight[index]


class Mode:
    """Base class of every layout. Subclasses set `name`, `options`, `test_layouts` and override
    the factories and the `cost_*` methods."""

    name: ClassVar[str]
    #: keyword options of lattice.init that this mode accepts
    options: ClassVar[Mapping[str, Option]] = {}
    #: small layouts the conformance suite runs this mode in: lattice.init keyword arguments
    #: (tp, dp and options), each needing at most 8 processes. A mode without any fails the suite.
    test_layouts: ClassVar[Sequence[Mapping[str, Any]]] = ()
    #: the option settings of the algorithm as its paper states it, where the defaults (the settings
    #: measured fastest) differ: the papers' tables are reproduced at these
    paper_options: ClassVar[Mapping[str, Any]] = {}
    #: an outside implementation of this same layout that `lattice bench` runs beside it
    #: ("dtensor": PyTorch's own tensor parallelism), or None
    peer: ClassVar[str | None] = None
    #: True when the residual stream is identical on every rank of a model replica (dropout on
    #: it then uses the replicated RNG stream); False when each rank holds a different piece
    residual_replicated: ClassVar[bool] = True

    def __init__(self, cfg, ctx: ParallelContext):
        self.cfg = cfg
        self.ctx = ctx
        self.check_model(cfg, ctx)

    @classmethod
    def check_model(cls, cfg, ctx: ParallelContext) -> None:
        """Refuse, in one line, a model whose sizes this layout on `ctx` cannot split, naming the
        values that work (every rank, before any collective; nothing is built)."""
        problem = cls.size_problem(cfg, ctx)
        if problem is not None:
            # the problem, and values found by trying each one: a hint that fixes one
            # constraint and breaks another (d_model fitting tp but not n_heads) is worse than none
            raise LatticeConfigError(f"{problem}; {working_values(cls, cfg, ctx)}")

    @classmethod
    def size_problem(cls, cfg, ctx: ParallelContext) -> str | None:
        """Why this layout on `ctx` refuses the model's sizes (the first check that fails, without
        its hint), or None when it takes them; nothing is built."""
        try:
            cls.check_config(cfg, ctx)
            for name, count in cfg.head_counts().items():
                cls.check_heads(ctx, name, count)
        except LatticeConfigError as e:
            return str(e).split("; ")[0]
        return None

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

    #: the mesh axis of a replica an MoE layer's experts may split over (`expert_axes`): one whose
    #: ranks hold other tokens after `expert_tokens` and send each token to its experts' rank; None: none
    expert_split_axis: ClassVar[Any] = None

    @classmethod
    def usable_expert_axis(cls, options: Mapping[str, Any]):
        """`expert_split_axis` where these options let the experts split over it, else None."""
        return cls.expert_split_axis

    @classmethod
    def expert_axes(cls, ep: int, tp: int, dp: int, options: Mapping[str, Any], cp: int = 1) -> tuple:
        """The mesh axes `ep` expert-parallel ranks span (() for ep = 1), or a one-line refusal: the
        mode's expert axis, the context-parallel ranks, the data-parallel replicas, or several of
        them (in mesh order, the replicas major; where sizes coincide, the fewest and innermost)."""
        if ep == 1:
            return ()
        axis = cls.usable_expert_axis(options)
        size = dict(cls.mesh_axes(tp, options)).get(axis, 1) if axis is not None else 1
        sizes = {axis: size, MeshAxis.CP: cp, MeshAxis.DP: dp}
        choices = {}  # ep -> axes
        for axes in ((axis,), (MeshAxis.CP,), (MeshAxis.DP,), (MeshAxis.CP, axis), (MeshAxis.DP, axis),
                     (MeshAxis.DP, MeshAxis.CP), (MeshAxis.DP, MeshAxis.CP, axis)):
            if all(a is not None and sizes[a] > 1 for a in axes):
                choices.setdefault(math.prod(sizes[a] for a in axes), axes)
        if ep not in choices:
            parts = ([f"its {axis.value} axis ({size} ranks)"] if size > 1 else []) + \
                    ([f"the context-parallel ranks ({cp})"] if cp > 1 else []) + [f"the data-parallel replicas ({dp})"]
            where = ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1] + \
                (", or several of them" if len(parts) > 1 and sum(n > 1 for n in sizes.values()) > 1 else "")
            raise LatticeConfigError(f"ep = {ep} does not fit mode {cls.name!r} with tp = {tp}, dp = {dp}"
                                     + (f", cp = {cp}" if cp > 1 else "") + f": its experts split over {where}; use "
                                     f"ep in {[1] + sorted(choices)}")
        return choices[ep]

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
        return tuple(range(math.prod(s for _, s in axes)))

    # ---- validation (every rank, before any collective; class level: the sizes and the layout)
    @classmethod
    def check_config(cls, cfg, ctx: ParallelContext) -> None:
        """Raise LatticeConfigError when the model's sizes (other than head counts) do not fit
        this layout on `ctx`."""

    @classmethod
    def check_heads(cls, ctx: ParallelContext, name: str, count: int) -> None:
        """Raise LatticeConfigError when `count` heads (n_heads, n_kv_heads, ...: the family's
        `head_counts()`) cannot be split into whole heads per rank by this layout on `ctx`."""

    @classmethod
    def check_batch(cls, ctx: ParallelContext, tokens: torch.Tensor) -> None:
        """Raise LatticeConfigError when a batch's shape does not fit this layout on `ctx`. A
        check only: it changes nothing (launcher, planner and every rank call it alike)."""

    def begin_batch(self, model: nn.Module, batch: int, seq: int) -> None:
        """What a (batch, seq) replica batch (a micro-batch under pipelining) sets up before
        `model` (the module about to run, made of the pieces this mode built; building them
        changes nothing in the mode) runs it, after `check_batch` passed: none by default."""

    # ---- building blocks
    #: mesh axes the attention heads are split over (each rank holding whole heads), and the
    #: axes over which ranks with the same heads hold different sequences; parameters split like
    #: the heads (`per_head`) sum their gradients over the latter
    head_axes: tuple = ()
    attention_batch_axes: tuple = ()

    def embedding(self, *, positions: bool = True, types: int = 0) -> nn.Module:
        """tokens (B, T) int64, identical across the replica -> x in the residual layout. With
        `positions`, a learned position table `wpe` of seq_len rows is added (GPT-2, BERT);
        without it the table does not exist (rotary or relative positions live in attention).
        With `types` > 0 (and positions), a token-type table `wtype` (types, d_model) split like
        `wpe`, whose row 0 is added to every token (BERT's segment embedding, single-segment
        inputs)."""
        raise NotImplementedError

    def norm(self, kind: str = "layer", *, eps: float, bias: bool) -> nn.Module:
        """LayerNorm (kind "layer": mean and variance, weight and optional bias) or RMSNorm
        ("rms": root mean square, weight only) over d_model, residual layout in and out."""
        raise NotImplementedError

    def linear(self, in_features: int, out_features: int, *, block: Block, position: Position,
               stack: int | None = None, segments: tuple[tuple[str, int], ...] | None = None,
               bias: bool) -> nn.Module:
        """y = x W + b with full W of shape (in, out), or (in, stack, out) when stacked; b (the
        shape of the output) only with `bias`.

        Position.IN takes the residual layout and returns this rank's part of the features,
        (B_l, T_l, [stack,] out_l); for attention out_l must be whole heads. Position.OUT takes
        that and returns the residual layout. `segments` ((name, width), ...; Position.IN only)
        cuts the output into tensors of different widths summing to out_features (q, k, v with
        n_heads, n_kv_heads, n_kv_heads heads): each segment has its own parameters, named
        `<name>.weight` / `<name>.bias`, split so that every rank holds whole heads of every
        segment, and the forward returns one tensor per segment.
        """
        raise NotImplementedError

    def dense(self, in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
        """y = x W + b from the residual layout back to it (in = out = d_model; BERT's MLM
        transform). By default the mode's first linear of an MLP, which returns the residual
        layout when it is d_model wide (serial, 2d, subgraph); a mode where it does not (1d: the
        features split over the ranks; 3d: the roles of two axes swapped) overrides this."""
        return self.linear(in_features, out_features, block=Block.MLP, position=Position.IN, bias=bias)

    def lm_head(self, embedding: nn.Module, *, bias: bool = False) -> nn.Module:
        """Module with loss(x, targets) -> mean cross-entropy over the replica batch's labelled
        targets (those not -100; identical on every rank of the replica) and logits(x) -> full
        (B, T, V) logits. With `bias`, a parameter `bias` (V,) is added to the logits (BERT)."""
        raise NotImplementedError

    def per_head(self, shape: tuple[int, ...], heads_dim: int) -> nn.Module:
        """A module holding `weight`, a parameter whose dim `heads_dim` runs over the attention
        heads (T5's relative position bias, (buckets, n_heads)), split like the heads: each rank
        holds the heads its attention computes, in the same order. Its gradient is summed over
        the ranks that hold the same heads for other sequences (`attention_batch_axes`)."""
        module = PerHeadTable()
        splits = ((heads_dim, tuple(self.head_axes)),) if self.head_axes else ()
        register_sharded(module, "weight", ShardSpec(tuple(shape), splits=splits,
                                                     grad_sum=tuple(self.attention_batch_axes)), self.ctx)
        return module

    def residual_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """This rank's piece of the residual stream (batch, seq, d_model) of a replica batch."""
        raise NotImplementedError

    def attention_rows(self, batch: int) -> slice:
        """The sequences of a replica batch of `batch` whose heads this rank's attention computes
        (the rows of a padding mask that attention reads)."""
        raise NotImplementedError

    def pool(self, x: torch.Tensor, index: int, batch: int) -> torch.Tensor:
        """The residual stream at position `index` of every sequence of the replica batch, (batch,
        d_model), identical on every rank of the replica (for a head over pooled tokens, run
        replicated). Its backward is the identity: every rank holds the same loss."""
        raise NotImplementedError

    # ---- whole tokens (a mixture of experts; lattice.modes.kernels.tokens)
    def token_spec(self) -> dict:
        """ShardSpec keywords of a parameter that every rank holding it holds whole and applies to
        its own tokens of `expert_tokens` (a router, an expert): its gradient is summed over the
        replica's ranks that hold other tokens."""
        return {}

    def residual_rows(self, batch: int) -> slice:
        """The sequences of a replica batch of `batch` whose tokens this rank's residual holds."""
        return self.attention_rows(batch)

    def expert_tokens(self, x: torch.Tensor, mask: torch.Tensor | None):
        """(this rank's whole tokens (n, d_model), held by no other rank of the replica; their
        padding mask (n,), True at a token, or None; back) from x in the residual layout and
        `mask` (its `residual_rows` of the replica's padding mask, (rows, T), or None); back maps
        (n, d_model) to the residual layout. By default the residual holds such tokens already."""
        shape = x.shape
        flat = None if mask is None else mask.reshape(-1)
        return x.reshape(-1, shape[-1]), flat, lambda y: y.reshape(shape)

    # ---- analysis
    @classmethod
    def optimus_table1_row(cls, b: int, s: int, h: int, p: int) -> dict[str, float] | None:
        """This layout's row of Optimus Table 1 (docs/references.md#optimus) as printed, if it has one: one layer
        with activation checkpointing, "forward"/"backward" scalars moved per rank and
        "forward_mults"/"backward_mults" scalar multiplications per rank."""
        return None

    # The price of each operation a family describes (lattice.cost.builder.CostBuilder): every
    # method adds the operation's collectives (`b.add`, in CommMeter's units) and returns the
    # elements it saves for backward (with what the next operation sees where asked).
    def padded_vocab(self) -> int:
        """Rows of the token table as this layout stores it (padded so that it divides)."""
        return self.cfg.vocab_size

    def cost_shares(self, b) -> dict[str, float]:
        """This rank's fraction of each kind of work ("attention", "mlp", "head", "replicated":
        elementwise work on the residual stream; "split": the default), where not 1/p."""
        return {}

    def cost_product_rows(self, b, block: str) -> float:
        """Rows of each matrix product a linear layer of `block` ("attention", "mlp", "dense",
        "head") runs on this rank (its weight piece is read once per product, whatever the rows)."""
        return b.M

    def cost_embedding(self, b, positions: bool, types: int) -> None:
        """The embedding (and position table, with a token-type table of `types` rows, which move
        together): collectives and the index bytes saved."""
        raise NotImplementedError(f"mode {self.name!r} has no cost model")

    def cost_norm(self, b, kind: str, bias: bool) -> float:
        """A norm of the residual stream: collectives; returns the elements saved."""
        raise NotImplementedError(f"mode {self.name!r} has no cost model")

    def cost_linear(self, b, in_features: int, out_features: int, *, block: str, position: str, bias: bool,
                    input_saved: bool) -> tuple[float, float]:
        """A linear layer: collectives; returns (elements saved, elements of the output storage).
        `input_saved`: the input's storage is saved for backward already (attention's output, an
        encoder's output every decoder layer reads): count only a copy the layout makes of it."""
        raise NotImplementedError(f"mode {self.name!r} has no cost model")

    def cost_product_output(self, b, out_features: int, *, block: str, position: str, out: float) -> float | None:
        """Elements a linear's products return on this rank (`out`: its output's), which selective
        checkpointing keeps (lattice.models.recompute); None where they sum in place (run again)."""
        return out

    def cost_keeps_input(self, block: str, position: str) -> bool:
        """Whether a linear at (block, position) saves its input's own storage for backward
        (True), or only a copy the layout makes of it (a gathered input)."""
        return True

    def cost_dense(self, b, in_features: int, out_features: int, bias: bool) -> tuple[float, float]:
        """`dense`: collectives; returns (elements saved, elements of the output storage)."""
        return self.cost_linear(b, in_features, out_features, block="mlp", position="in", bias=bias,
                                input_saved=False)

    def cost_lm_head(self, b) -> float:
        """The LM head and its cross-entropy: collectives and index bytes; returns the elements saved."""
        raise NotImplementedError(f"mode {self.name!r} has no cost model")

    def cost_expert_tokens(self, b) -> float:
        """The whole tokens this rank routes at an MoE layer (`expert_tokens`), with the terms of
        the collectives that bring them and take the outputs back (site "moe")."""
        return b.residual / b.h

    def cost_pool(self, b) -> float:
        """`pool` of one position of the replica batch: its collectives; returns the elements of
        the storage the pooled tensor keeps alive (a view of the residual, or its own)."""
        raise NotImplementedError(f"mode {self.name!r} has no cost model")


def working_values(mode_cls, cfg, ctx) -> str:
    """A hint for a model the layout refuses: for the tensor-parallel degree and each size of
    the model (d_model and the family's head counts), the nearest values that work when only
    that one changes, each found by building the config and the mode with it."""
    import dataclasses

    def with_size(name):
        def works(value):
            try:
                changed = dataclasses.replace(cfg, **{name: value})
            except (LatticeConfigError, ValueError):
                return False
            return mode_cls.size_problem(changed, ctx) is None
        return works

    def with_tp(tp):
        try:
            layout = ctx.layout.replace(tp=tp)
        except LatticeConfigError:
            return False
        return mode_cls.size_problem(cfg, layout.context()) is None

    found = {}
    if ctx.layout is not None:
        found["tp"] = nearest_working(ctx.layout.tp, with_tp, 4 * ctx.layout.tp + 64)
    for name in ("d_model", *cfg.head_counts()):
        current = getattr(cfg, name)
        found[name] = nearest_working(current, with_size(name), 4 * current + 64)
    offers = [f"{name} {' or '.join(map(str, values))}" for name, values in found.items() if values]
    if not offers:
        return "no single change of tp, d_model or the head counts fits; change several"
    return "values that work with everything else as given: " + "; ".join(offers)


def nearby_multiples(size: int, by: int) -> str:
    """The multiples of `by` next to `size`, for a hint: "8 or 12", or "4" below the first."""
    lower = size - size % by
    return " or ".join(str(n) for n in sorted({lower or by, lower + by}))


def divisible(what: str, size: int, by: int, by_what: str, fix: str = "") -> None:
    """Raise a one-line LatticeConfigError unless `size % by == 0`."""
    if size % by:
        hint = fix or f"use a multiple of {by} (for example {nearby_multiples(size, by)})"
        raise LatticeConfigError(f"{what} = {size} is not divisible by {by_what} = {by}; {hint}")
