"""What every model family shares (the registry of families is lattice.models.registry).

A family is one module in this package (gpt2.py, ...) defining a `Model` subclass (a
`DecoderLM` when it is laid out as GPT-2 and Llama are), registered with `lattice.models.register`, that
declares, as class attributes:

| declaration     | what it is                                                   | read by                 |
|-----------------|--------------------------------------------------------------|-------------------------|
| `name`          | the `--arch` name                                            | registry, CLI, run dirs |
| `config_class`  | its config dataclass (a `ModelConfig`), with `presets`       | CLI, trainer, checkpoints |
| `test_shapes`   | small configs the conformance suite runs in every mode       | tests/test_conformance.py |
| `hf`            | its HuggingFace mapping (`lattice.models.hf.HFMapping`) or None     | lattice.models.hf, `convert`   |
| `tasks`         | what it trains on (`lattice.data.tasks`: lm, mlm, classify, seq2seq) | trainer, CLI         |
| `train_defaults`| its schedule where the command line gives none (steps, ...)  | lattice.training.config    |
| `parts()`       | its modules in order: first part, blocks, last part          | the pipeline builder    |
| `cost_layout()` | the operations of one step, in order, for the cost model     | lattice.cost            |

and builds its layers in `build()` from the mode's blocks (`self.mode`: embedding, norms,
linears, LM head, per-head parameters, pooling) and the shared components
(lattice.models.components). The model holds only this rank's shards; everything else here --
initialisation, loading and gathering full tensors, gradient sums, the training step,
generation, HuggingFace import/export -- is written once for every family (the full tensors and
HF in lattice.models.weights, generation in lattice.models.generation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn

from lattice.models.components import DropoutSeeds
from lattice.models.generation import Generation
from lattice.models.inputs import check_ids, check_padding
from lattice.models.recompute import recompute_kind, recomputed
from lattice.models.weights import FullWeights
from lattice.modes import get_mode
from lattice.modes.kernels.loss import IGNORE_INDEX, labelled_count
from lattice.parallel.context import LatticeConfigError, ParallelContext
from lattice.parallel.context_parallel import (check_context_batch, context_positions, gather_context, take_context_chunks,
                                               whole_loss)
from lattice.parallel.sharding import ShardSpec, collect_specs, sum_replica_grads


# ----------------------------------------------------------------------------- configs
class ModelConfig:
    """Mixin of every family's config dataclass. Every family config declares the fields of
    SHARED_FIELDS (the sizes the trainer, data and CLI set, and what the modes' embeddings and
    heads read; `register` refuses a family whose config lacks one), and `presets`."""

    SHARED_FIELDS: ClassVar[tuple[str, ...]] = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers",
                                                "tie_embeddings", "dropout")

    #: size presets by name (the CLI's --model); each a dict of config fields
    presets: ClassVar[dict[str, dict]] = {}
    #: the preset `lattice train --arch NAME` uses without --model
    default_preset: ClassVar[str] = "small"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in cls.presets:
            raise LatticeConfigError(f"unknown model preset {name!r}; choose one of {', '.join(cls.presets)}")
        return cls(**{**cls.presets[name], **overrides})

    def head_counts(self) -> dict[str, int]:
        """Every count of attention heads a layout must split into whole heads per rank."""
        return {"n_heads": self.n_heads}

    def check_positive(self, *names: str) -> None:
        for f in names:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LatticeConfigError(f"{type(self).__name__}.{f} must be a positive integer, got {value!r}")


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Parts:
    """A model's modules in the order its forward runs them, for splitting it into pipeline
    stages: `first` (tokens -> the residual stream, on the first stage), the blocks (the
    nn.ModuleList named `blocks`, cut between stages), `last` (after the blocks: final norm and
    head, on the last stage). `shared` names parameters of the first part that the last part
    uses too (a tied token table), which the last stage keeps a copy of.

    An encoder-decoder names its decoder's blocks too (`decoder`), which follow the encoder's
    (`blocks`) in the stage split; `middle` are the modules between the stacks (the encoder's
    final norm, the decoder's embedding), on the stage of the encoder's last block; `everywhere`
    names parameters that stages of several parts read (the token table, each stack's position
    bias), of which every stage keeps a copy, their gradients summed over the pipeline."""

    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]
    shared: tuple[str, ...] = ()
    decoder: str | None = None
    middle: tuple[str, ...] = ()
    everywhere: tuple[str, ...] = ()


class Model(FullWeights, Generation, nn.Module):
    """Base of every family's model: this rank's shards of the full model under ctx's layout.
    Parameter names are the serial model's."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    #: config keyword sets the conformance suite builds this family with (each small enough for
    #: every declared layout); a family without any fails the suite
    test_shapes: ClassVar[Sequence[Mapping[str, Any]]] = ()
    #: the HuggingFace mapping (lattice.models.hf.HFMapping), or None
    hf: ClassVar[Any] = None
    #: what `lattice train --task` can train it on (lattice.data.tasks), its default first
    tasks: ClassVar[tuple[str, ...]] = ("lm",)
    #: the schedule `lattice train` uses for it where the command line gives none (steps,
    #: batch_size, warmup; lattice.training.config.RUN_DEFAULTS otherwise)
    train_defaults: ClassVar[Mapping[str, int]] = {}

    def __init__(self, cfg, ctx: ParallelContext, *, dtype: torch.dtype = torch.float32,
                 activation_checkpointing: bool = False, selective_checkpointing: bool = False):
        """Allocates only this rank's shards and fills them with the serial model's initial
        values. Under `with torch.device("meta")` nothing is allocated (for planning). Each block's
        activations are recomputed in backward, whole or but its products (lattice.models.recompute)."""
        super().__init__()
        if not isinstance(cfg, self.config_class):
            raise LatticeConfigError(f"{type(self).__name__} takes a {self.config_class.__name__}, got "
                                     f"{type(cfg).__name__}")
        if ctx.pipeline is not None:
            raise LatticeConfigError(f"this layout has pp = {ctx.pp} pipeline stages: build the model with "
                                     f"lattice.build_model(cfg, ctx), which splits it into stages")
        self.cfg, self.ctx = cfg, ctx
        problem = self.layout_problem(cfg, ctx.layout)
        if problem:
            raise LatticeConfigError(problem)
        self.mode = get_mode(ctx.mode)(cfg, ctx)  # validates sizes on every rank, no collectives
        self.recompute = recompute_kind(activation_checkpointing, selective_checkpointing)
        self.seeds = DropoutSeeds(ctx)
        planning = torch.empty(()).is_meta  # the caller's default device is meta
        with torch.device("meta"):  # declare shards without memory; allocated once below
            self.build()
        self.specs: dict[str, ShardSpec] = collect_specs(self)
        self._grads_pending = False
        self._built_dtype = dtype
        if not planning:
            self.materialize()

    def materialize(self) -> None:
        """Allocate this rank's shards on its device in the built dtype, with serial's initial
        values (after a meta build)."""
        self.to_empty(device=self.ctx.device)
        self.to(dtype=self._built_dtype)
        self.reset_parameters()

    @property
    def family(self) -> type["Model"]:
        """The family class (the same for a pipelined model: lattice.parallel.pipeline.PipelineModel)."""
        return type(self)

    # ---- what a family defines
    def build(self) -> None:
        """Create the layers (on the meta device; the base allocates them)."""
        raise NotImplementedError

    def embed_tokens(self, tokens: torch.Tensor, start: int = 0, token_types: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The first part: tokens (B, T) at positions start.. (of segments `token_types`, in a
        family that has them) -> the residual stream."""
        raise NotImplementedError

    def type_count(self) -> int:
        """How many token types (segments) the family's inputs can have; 0: none."""
        return 0

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The last part before the head (a final norm)."""
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of the replica batch from the finished residual stream."""
        raise NotImplementedError

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full logits from the finished residual stream (inference)."""
        raise NotImplementedError

    @classmethod
    def layout_problem(cls, cfg, layout) -> str | None:
        """Why this family cannot train `cfg` in `layout` (a Layout), or None (the planner skips what
        this refuses; building the model raises it)."""
        if layout is not None and layout.ep > 1:
            return f"ep = {layout.ep} splits a mixture of experts, which {cls.name} is not; use ep = 1, or an MoE family"
        return None

    def parts(self) -> Parts | None:
        """The modules in order for pipeline stages; None: this family cannot be pipelined."""
        return None

    def cost_layout(self, b) -> None:
        """Describe one training step, operation by operation, to a lattice.cost.CostBuilder."""
        raise NotImplementedError(f"family {self.name!r} describes no cost layout")

    # ---- pipeline stages (lattice.parallel.pipeline)
    def pipeline_blocks(self) -> list[nn.Module]:
        """The blocks a pipeline splits into stages, in the order they run (an encoder-decoder's
        encoder blocks, then its decoder's)."""
        parts = self.parts()
        return list(getattr(self, parts.blocks)) + (list(getattr(self, parts.decoder)) if parts.decoder else [])

    def boundary_shapes(self, after: int, batch: int, seq: int, target_seq: int) -> tuple[tuple[int, ...], ...]:
        """This rank's pieces of what a stage ending with block `after` (pipeline order) sends the
        next for a micro-batch of `batch` sequences: the residual stream."""
        return (tuple(self.mode.residual_shape(batch, seq)),)

    def boundary_dtypes(self, after: int) -> tuple[torch.dtype | None, ...]:
        """The dtype of each of `boundary_shapes`' tensors (None: the model's)."""
        return (None,) * len(self.boundary_shapes(after, 1, 1, 1))

    def boundary_scattered(self, after: int) -> tuple[bool, ...]:
        """Which of `boundary_shapes`' tensors scatter/gather may cut over the tensor ranks: all."""
        return (True,) * len(self.boundary_shapes(after, 1, 1, 1))

    def microbatch_inputs(self, tokens: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor | None,
                          token_types: torch.Tensor | None, position_ids: torch.Tensor | None = None) -> dict:
        """What every stage takes beside the activation it receives, for one micro-batch (its
        rows of the replica's tokens, targets, mask, token types and positions, whole sequences;
        every rank holds them): under cp, its chunks' token types and positions."""
        positions = position_ids
        if self.ctx.cp > 1:
            if positions is None:
                positions = context_positions(self.ctx, tokens.shape[1], tokens.device).expand(tokens.shape[0], -1)
            else:
                (positions,) = take_context_chunks(self.ctx, positions)
            (token_types,) = take_context_chunks(self.ctx, token_types)
        return {"padding": self.block_inputs(attention_mask, positions), "token_types": token_types,
                "positions": positions}

    def run_stage(self, values: tuple, block_ids: range, first: bool, last: bool, inputs: dict) -> tuple:
        """One pipeline stage of a micro-batch: `values` its received tensors (the first stage's:
        the tokens), the blocks `block_ids`, with the first part on the first stage and the last
        part but the head on the last; returns what it sends on (the last: the finished stream)."""
        x = values[0]
        if first:
            x = self.embed_input(x, 0, inputs.get("token_types"), inputs.get("positions"))  # (B_mb, T) -> residual
        blocks = self.pipeline_blocks()
        x = self.run_blocks(x, [blocks[i] for i in block_ids], **inputs.get("padding", {}))
        return (self.finish(x),) if last else (x,)

    def init_std(self, name: str) -> float:
        """Standard deviation of a random initial matrix (GPT-2's: 0.02, output projections
        scaled by 1/sqrt(2 n_layers))."""
        return 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith("proj.weight") else 0.02

    # ---- forward
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, token_types: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: list[dict] | None = None, start: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """The mean loss over this replica's labelled targets, or full logits without targets
        (of the last position alone with last_only). `attention_mask` (B, start + T), as in
        transformers: 1 where a position holds a token, 0 where it holds padding, which no query
        attends to and whose targets count as ignored (-100). `token_types` (B, T): each token's
        segment, in a family that has them (BERT's sentence A = 0, B = 1). `position_ids` (B, T):
        each token's own position (a left-padded batch's), else start.. in every sequence.
        Inference: `cache` holds one dict per block (see generate) and `start` is the position of
        tokens[:, 0]."""
        check_context_batch(self.ctx, tokens, targets, start=start, cached=cache is not None or last_only,
                            logits=targets is None)
        self.check_inputs(tokens, targets, start)
        self.check_padding(tokens, start, attention_mask, token_types, position_ids)
        share = None  # under cp: this rank's share of the batch's labelled targets
        if self.ctx.cp > 1:  # this rank's chunks of every sequence; attention reads the whole mask
            whole_targets = None if targets is None else self.unpadded_targets(targets, attention_mask)
            if position_ids is None:
                position_ids = context_positions(self.ctx, tokens.shape[1], tokens.device).expand(tokens.shape[0], -1)
            else:
                (position_ids,) = take_context_chunks(self.ctx, position_ids)
            tokens, targets, token_types = take_context_chunks(self.ctx, tokens, whole_targets, token_types)
            if targets is not None:
                share = labelled_count(targets, clamp=False).double() / labelled_count(whole_targets)
        self.mode.begin_batch(self, *tokens.shape)
        if self.training:
            self.seeds.forward_count += 1
        if torch.is_grad_enabled():
            self._grads_pending = True  # a backward may follow: sync_grads has work again
        padding = self.block_inputs(attention_mask, position_ids)
        x = self.embed_input(tokens, start, token_types, position_ids)  # residual layout, e.g. (B, T, h) in serial
        if cache is not None:
            for i, block in enumerate(self.blocks):
                x = block(x, cache=cache[i], start=start, **padding)
        else:
            x = self.run_blocks(x, self.blocks, **padding)
        x = self.finish(x)
        if targets is None:
            logits = self.head_logits(x[:, -1:] if last_only else x)
            return logits if self.ctx.cp == 1 else gather_context(logits, self.ctx)
        if share is not None:
            return self.with_auxiliary_loss(whole_loss(self.head_loss(x, targets), share, self.ctx))
        return self.with_auxiliary_loss(self.head_loss(x, self.unpadded_targets(targets, attention_mask)))

    def with_auxiliary_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The replica's loss and what the family adds to it over the whole batch after the head's
        (a mixture of experts' balancing loss), after context parallelism's sum: as it is by default."""
        return loss

    @staticmethod
    def unpadded_targets(targets: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Targets with those at padding (attention_mask 0) ignored (-100); targets of another
        shape than the mask (one class per sequence) as they are."""
        if attention_mask is None or targets.shape != attention_mask.shape:
            return targets
        return targets.masked_fill(~attention_mask.bool(), IGNORE_INDEX)

    labelled_count = staticmethod(labelled_count)

    def embed_input(self, tokens, start: int = 0, token_types=None, positions=None) -> torch.Tensor:
        """`embed_tokens`, given token types and per-sequence positions only where there are some
        (a family without them may define embed_tokens(tokens, start))."""
        given = {k: v for k, v in (("token_types", token_types), ("positions", positions)) if v is not None}
        return self.embed_tokens(tokens, start, **given)

    #: whether the blocks take each token's position (rotary angles, in attention); else the
    #: embedding adds a position's row, if any
    rotary_positions: ClassVar[bool] = False
    #: whether attention_mask may number packed documents (1, 2, ..), attention staying within
    #: each: every family whose attention is self-attention alone
    packs_documents: ClassVar[bool] = True

    def block_inputs(self, attention_mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> dict:
        """What a block takes beside x: this rank's rows of the padding mask (`keep`) and, in a
        family with rotary positions, of each token's position (`positions`); nothing for a
        batch without either (a family's blocks need not take them until given such batches)."""
        out = {} if attention_mask is None else {"keep": self.attention_keep(attention_mask)}
        if positions is not None and self.rotary_positions:
            out["positions"] = positions[self.mode.attention_rows(positions.shape[0])]
        return out

    def attention_keep(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of a replica's padding mask that this rank's attention reads, as bool; or,
        where it numbers packed documents (a value above 1), their ids as int64 (`attend`)."""
        if attention_mask is None:
            return None
        mine = attention_mask[self.mode.attention_rows(attention_mask.shape[0])]
        return mine.bool() if mine.dtype == torch.bool or not bool((attention_mask > 1).any()) else mine.long()

    def run_blocks(self, x: torch.Tensor, blocks, **inputs) -> torch.Tensor:
        """x through `blocks` (residual layout in and out; `inputs`: what every block takes
        beside it, an encoder's output or a position bias), recomputed in backward when asked. A
        recomputed block draws its dropout masks at the forward count of its first pass (under a
        pipeline schedule other micro-batches run in between)."""
        count = self.seeds.forward_count
        for block in blocks:
            if self.recompute and self.training:
                x = recomputed(self.recompute, self._block_at_count, block, x, count, **inputs)
            else:
                x = block(x, **inputs)
        return x

    def _block_at_count(self, block, x, count: int, **inputs):
        now, self.seeds.forward_count = self.seeds.forward_count, count
        try:
            return block(x, **inputs)
        finally:
            self.seeds.forward_count = now

    def check_inputs(self, tokens, targets, start=0):
        """Refuse tokens, targets or a start position this model and layout cannot take (every
        rank, before any collective)."""
        self.check_tokens(tokens, targets, start)
        self.mode.check_batch(self.ctx, tokens[:, :tokens.shape[1] // self.ctx.cp])  # each rank's chunks under cp

    def check_padding(self, tokens, start: int, attention_mask, token_types, position_ids=None) -> None:
        """One line unless the padding mask, token types and positions fit the tokens (every
        rank, before any collective; lattice.models.inputs)."""
        check_padding(self, tokens, start, attention_mask, token_types, position_ids)

    def check_tokens(self, tokens, targets, start=0):
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise LatticeConfigError(f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        if start + tokens.shape[1] > self.cfg.seq_len:
            raise LatticeConfigError(f"sequence length {tokens.shape[1]} exceeds {type(self.cfg).__name__}.seq_len = "
                                     f"{self.cfg.seq_len}; shorten the batch or raise seq_len")
        check_ids("tokens", tokens, self.cfg.vocab_size)
        if targets is not None:
            self.check_targets(tokens, targets)

    @classmethod
    def random_targets(cls, cfg, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Random targets of the kind `model(tokens, targets)` takes for `tokens` (for tests and
        benchmarks): token ids (B, T), or class ids (B,) for a config with num_labels."""
        if getattr(cfg, "num_labels", 0):
            return torch.randint(0, cfg.num_labels, tuple(tokens.shape[:1]), generator=generator)
        return torch.randint(0, cfg.vocab_size, tuple(tokens.shape), generator=generator)

    def check_targets(self, tokens, targets):
        if targets.shape != tokens.shape:
            raise LatticeConfigError(f"targets shape {tuple(targets.shape)} differs from tokens {tuple(tokens.shape)}")

    @torch.no_grad()
    # ---- one training step
    def sync_grads(self, over_cp: bool = True) -> None:
        """Sum the partial gradients that the shard specs declare (`ShardSpec.grad_sum`) over
        their axes inside the model replica, in bucketed, metered all-reduces, and under context
        parallelism every gradient over cp unless `over_cp` is off (the Trainer's reduction over
        dp x cp sums them). Every rank of a replica must call it after backward; a second call
        before the next forward does nothing. (Data-parallel averaging across replicas is DDP's
        or ZeRO's, in the Trainer.)"""
        if self._grads_pending:
            sum_replica_grads(self, over_cp)
            self._grads_pending = False

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, **inputs) -> float:
        """Forward and backward of this replica's batch (`inputs`: attention_mask, token_types,
        as `forward` takes them), with the in-replica gradient sums; the replica's mean loss as
        a float, identical on every rank of the replica."""
        loss = self(tokens, targets, **inputs)
        loss.backward()
        self.sync_grads()
        return float(loss.detach())


class DecoderLM(Model):
    """A decoder language model laid out as GPT-2's and Llama's are: `embed` (the token table,
    with or without positions), `drop` (dropout on the embedded tokens), the `blocks`, a final
    norm `ln_f` and the LM head `head` (tied to `embed.wte` when cfg.tie_embeddings). A family of
    this shape builds those modules in `build()` and inherits the forward pieces and its parts."""

    def embed_tokens(self, tokens, start=0, token_types=None, positions=None):
        return self.drop(self.embed(tokens, start, positions=positions))

    def finish(self, x):
        return self.ln_f(x)

    def head_loss(self, x, targets):
        return self.head.loss(x, targets)

    def head_logits(self, x):
        return self.head.logits(x)

    def parts(self):
        return Parts(first=("embed", "drop"), blocks="blocks", last=("ln_f", "head"),
                     shared=("embed.wte",) if self.cfg.tie_embeddings else ())
