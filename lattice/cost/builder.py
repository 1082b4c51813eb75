"""The builder of the cost model (lattice.cost.model.estimate): a family describes one step as
its operations in order (`Model.cost_layout(builder)`), the mode prices each (`Mode.cost_*`),
and the builder adds what the shard specs alone say (parameter memory, the in-replica gradient
sums, the data-parallel all-reduce) and sums the work, saves and terms into a `Cost`."""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

from lattice.cost.attention_terms import AttentionTerms
from lattice.cost.moe_terms import MoETerms
from lattice.cost.machine import Term
from lattice.cost.stages import pipeline_terms
from lattice.parallel.context import MeshAxis
from lattice.parallel.sharding import byte_buckets, grad_sum_buckets
from lattice.parallel.pipeline import microbatch_count
from lattice.parallel.zero_layout import (memory_per_rank, parts_freed, plan_buckets, sharers, weight_gathers,
                                          zero_split)

DP, CP = MeshAxis.DP, MeshAxis.CP
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default gradient bucket
# matrix-product FLOPs (attention's included), attention's products alone, elements through
# elementwise operators, attention score elements, linear layers' products (kernels), operations
# described (each a handful of framework calls: the per-operation overhead of Machine.op_overhead),
# and the weight elements those products read, summed over them (Machine.kernel_rows)
WORK_KINDS = ("flops", "attention_flops", "elementwise", "scores", "biased_scores", "linear_calls", "ops",
              "product_weights")
# the elementwise operators whose elements are counted apart (work kinds "elementwise:<operator>",
# Cost.elementwise_ops), each priced at its own rate where the machine has one (Machine.elementwise_rates),
# with how many elements per element of its output the count takes (its forward's passes)
ELEMENTWISE_OPERATORS = {
    "layer_norm": 1,  # one kernel
    "rms_norm": 3,  # x·x, x·rstd, weight (lattice.modes.kernels.layers.normalize_split_hidden)
    "add": 1,  # a bias or the residual
    "rotary": 4.5,  # on q and k: x·cos + rotate_half(x)·sin, rotate_half a negated half and a concatenation
    "loss": 2,  # the cross-entropy per logit
    "position_bias": 1,  # T5's bias per head and pair of positions: a table lookup, its gradient summed by bucket
    **{f"{act}{gated}": 2 if gated else 1 for act in ("gelu_tanh", "gelu", "relu", "silu") for gated in ("", "_gated")},
}


@functools.lru_cache(maxsize=256)
def _parameters(model) -> dict:
    """A model's parameters by name (read only): one walk of a meta model the planner prices in
    many setups (lattice.cost.model.meta_model keeps as many)."""
    return dict(model.named_parameters())


class CostBuilder(AttentionTerms, MoETerms):
    """Fills a Cost from the family's description of one step (`Model.cost_layout(builder)`,
    which calls the operations below in the order its forward runs them) and the mode's price of
    each operation. What follows from the shard specs alone the builder adds itself: parameter
    memory and tensor count, the in-replica gradient sums (`ShardSpec.grad_sum`, bucketed as
    `sync_grads` does) and the data-parallel gradient all-reduce (bucketed as DDP does).

    For the mode: B sequences of T tokens per replica (per rank of a cp group: its T/cp),
    `position_rows` of a position table they span, M = B·T, h, V, `vocab_padded`, p ranks
    per replica, `options`, `c.itemsize`, `residual` (this rank's residual elements) and
    `current` (the elements of the storage the last operation produced, which the next one may
    save). An encoder-decoder describes each stack inside `sequence(T)` (the target's length is
    `target_T`); every figure then uses that stack's T."""

    def __init__(self, cost, model):
        c, cfg = cost, cost.cfg
        self.c, self.cfg, self.topo, self.model, self.mode = c, cfg, c.topology, model, model.mode
        # the model's parameters by name, walked once: the step's parts each read them
        self.params = _parameters(model)
        # under context parallelism a rank runs its 1/cp of every sequence's tokens, attention
        # reads every key around the cp ring (`ring`)
        self.cp = c.topology.size(CP)
        layout = model.ctx.layout
        self.cp_attention = layout.cp_attention if layout is not None else "ring"
        self.B, self.T, self.h, self.L = c.batch, c.seq // self.cp, cfg.d_model, cfg.n_layers
        self.target_T = (c.target_seq or c.seq) // self.cp
        self.repeat, self.first, self.last = 1, True, True  # micro-batches; the stage holds the first / last part
        self.forced = False  # inside `on_this_stage`
        pcfg = c.pipeline
        if pcfg is None:
            self.blocks_here = range(len(model.pipeline_blocks()) if model.parts() else self.L)
            if c.parts is not None:
                self.first, self.last = c.parts
        else:  # one micro-batch through this rank's chunks, m times
            chunks = pcfg.chunks(len(model.pipeline_blocks()))
            mine = range(c.stage, len(chunks), pcfg.stages)
            self.B, self.repeat = c.batch // pcfg.m, pcfg.m
            self.blocks_here = sorted(i for k in mine for i in chunks[k])  # pipeline order (Model.pipeline_blocks)
            self.L = len(self.blocks_here)
            self.first, self.last = 0 in mine, len(chunks) - 1 in mine
        self.M = self.B * self.T
        self.V = cfg.vocab_size
        self.p = c.topology.tp_size
        self.options = c.options
        self.vocab_padded = self.mode.padded_vocab()
        self._set_length(self.T)
        self.current = self.previous = 0.0
        self.memory_tokens, self.memory_elements, self.memory_read = 0, 0.0, False  # an encoder's output (`memory`)
        self.share = {"split": 1 / self.p, **self.mode.cost_shares(self)}  # FLOP shares (see `work`)
        self.region = "embedding"  # embedding | layer | head: the site of terms outside layers
        self.layer_terms: list[tuple[Term, int, bool]] = []  # (term, operation index, after its saves)
        self.op = 0  # operations described so far (in the current layer)
        self.tail = (-1, 0.0)  # (operation, elements) of the layer's last OUT linear's adds
        self.saved = {"layer": 0.0, "other": 0.0, "ints": 0.0, "layer_ints": 0.0, "kept": 0.0}
        self.output_saved = False  # whether the last operation's output is saved already (by itself)
        self.work = {part: {k: 0.0 for k in WORK_KINDS}
                     for part in ("layer", "other", "layers")}  # layers: every layer block's, times its count
        self.layers_saved = {"elements": 0.0, "ints": 0.0, "checkpointed": 0.0, "kept": 0.0}  # likewise for the saves

    # ---- for the modes
    def add(self, phase, op, axes, elements, calls=1, site="", *, itemsize=None, after_saves=False, once=False,
            beside_backward=False):
        """One collective term at `site` ("linear", "bias", "norm", "branch" inside a layer, where
        it counts once per layer; "loss"; elsewhere the region's). `after_saves`: issued after
        every tensor its operation saves for backward, so that recomputation under activation
        checkpointing, which stops after the layer's last saved tensor, may not repeat it;
        `once`: never repeated by recomputation (an MoE layer's balancing statistics);
        `beside_backward`: Term.beside_backward."""
        in_layer = self.region == "layer"
        # (outside a layer, site "hidden": the region's term run beside the weight gradients' products)
        where = ("loss" if site == "loss" else f"layer.{site}" if in_layer else
                 f"{self.region}.hidden" if site == "hidden" else self.region)
        part = where.split(".")[0]
        if not self.forced and ((part == "embedding" and not self.first) or (part in ("head", "loss") and not self.last)):
            return  # a pipeline stage without that part
        if where != "grads":
            calls, elements = calls * self.repeat, elements * self.repeat
        t = Term(phase, op, tuple(axes), calls, elements, where, itemsize or self.c.itemsize,
                 beside_backward=beside_backward)
        if in_layer:
            self.layer_terms.append((t, self.op, "once" if once else after_saves))
        else:
            self.c.terms.append(t)

    def save(self, elements: float) -> None:
        """Elements (in the step's dtype) the current operation saves for backward."""
        self.saved["layer" if self.region == "layer" else "other"] += elements

    def keep(self, elements: float) -> None:
        """Elements a layer's product or fused attention returns, which selective checkpointing keeps."""
        if self.region == "layer":
            self.saved["kept"] += elements

    def save_ints(self, nbytes: float) -> None:
        """Bytes of token ids, indices and masks saved for backward."""
        self.saved["layer_ints" if self.region == "layer" else "ints"] += nbytes

    def _work(self, kind: str, amount: float) -> None:
        part = self.work["layer" if self.region == "layer" else "other"]
        part[kind] = part.get(kind, 0.0) + amount

    def _elementwise(self, operator: str, elements: float) -> None:
        """`elements` of `operator`'s output on this rank (forward), counted as ELEMENTWISE_OPERATORS says."""
        amount = ELEMENTWISE_OPERATORS[operator] * elements
        self._work("elementwise", amount)
        self._work(f"elementwise:{operator}", amount)

    def _products(self, block: str, flops: float, calls: int = 1, again: bool = False) -> None:
        """A linear layer's matrix products of `flops` in all on this rank (forward), over the rows
        each of its products has here (`Mode.cost_product_rows`): their weight elements follow.
        `again`: selective checkpointing runs them again in backward (work kinds "again:<kind>")."""
        rows = self.mode.cost_product_rows(self, block)
        # (no weight elements on a rank the layout leaves out of these products)
        for kind, amount in (("flops", flops), ("linear_calls", calls), ("product_weights", rows and flops / (2 * rows))):
            self._work(kind, amount)
            if again:
                self._work("again:" + kind, amount)

    @contextmanager
    def on_this_stage(self):
        """Operations of a part that a pipeline stage other than the first or the last holds (an
        encoder-decoder's modules between its stacks): their terms count here."""
        self.forced = True
        try:
            yield
        finally:
            self.forced = False

    # ---- for the families: the operations of one step, in order
    def embedding(self, *, positions: bool = True, types: int = 0) -> None:
        """The token table, with a position table (and a token-type table of `types` rows)."""
        self._work("ops", 1)
        self.region = "embedding"
        self.mode.cost_embedding(self, positions, types)
        self.current = self.residual

    @contextmanager
    def layer(self, count: int | None = None):
        """The operations of one layer, counted `count` times (default: the model's L layers, or
        the stage's under a pipeline)."""
        count = self.L if count is None else count
        self.region, self.op, self.tail = "layer", 0, (-1, 0.0)
        self.layer_terms = []
        yield
        # recomputation stops after the layer's last saved tensor (every operation saves some,
        # if only a view or an empty tensor): collectives its last operation issues after its
        # saves (a 1D row-parallel linear's all-reduce) are not repeated
        last = self.op
        if self.tail[0] == last:  # recomputation stops before a block's last add, whose sum its backward never reads
            self._work("unrepeated:elementwise", self.tail[1])
            self._work("unrepeated:elementwise:add", self.tail[1])
        for t, op, after in self.layer_terms:
            self.c.terms.append(Term(t.phase, t.op, t.axes, t.calls * count, t.elements * count, t.site, t.itemsize))
            if (self.c.checkpointing and t.phase == "forward" and after != "once"
                    and (op < last or (op == last and not after))):
                self.c.terms.append(Term("backward", t.op, t.axes, t.calls * count, t.elements * count, t.site,
                                         t.itemsize))
        for kind, amount in self.work["layer"].items():
            self.work["layers"][kind] = self.work["layers"].get(kind, 0.0) + count * amount
            self.work["layer"][kind] = 0.0
        self.layers_saved["elements"] += count * self.saved["layer"]
        self.layers_saved["ints"] += count * self.saved["layer_ints"]
        self.layers_saved["checkpointed"] += count * self.residual  # only each layer's input survives
        self.layers_saved["kept"] += count * self.saved["kept"]
        self.saved["layer"] = self.saved["layer_ints"] = self.saved["kept"] = 0.0
        self.region = "head"

    @contextmanager
    def sequence(self, length: int):
        """The operations inside run on sequences of `length` tokens (an encoder-decoder's
        stacks: the source's, the target's)."""
        before = self.T
        self._set_length(length)
        try:
            yield
        finally:
            self._set_length(before)

    def _set_length(self, length: int) -> None:
        self.T, self.M = length, self.B * length
        self.residual = math.prod(self.mode.residual_shape(self.B, length))
        # rows of a position table that this rank's tokens span: under cp, rank i's chunks i and
        # 2cp-1-i span T/cp · (cp - i) positions
        self.position_rows = length * (self.cp - self.topo.coords(self.c.rank).get(CP, 0))

    def _next(self):
        self._work("ops", 1)
        if self.region == "layer":
            self.op += 1

    def norm(self, kind: str = "layer", *, bias: bool) -> None:
        """LayerNorm (kind "layer") or RMSNorm ("rms") of the residual stream."""
        self._next()
        self.save(self.mode.cost_norm(self, kind, bias))
        self._elementwise("rms_norm" if kind == "rms" else "layer_norm",
                          self.M * self.h * self.share.get("replicated", self.share["split"]))
        self.current, self.output_saved = self.residual, False

    def linear(self, in_features: int, out_features: int, *, block: str, position: str, bias: bool,
               input_from_attention: bool = False, from_memory: bool = False) -> None:
        """`block` "attention" or "mlp", `position` "in" or "out"; out_features counts every
        stacked copy or segment. `input_from_attention`: the input is attention's output (which
        attention saves already where the layout feeds it on as a view). `from_memory`: an IN
        linear of the encoder's output (`memory`), over its tokens, whose storage every layer
        reading it shares: saved once, where the layout keeps the input as it is."""
        self._next()
        length = self.T
        if from_memory:
            self._set_length(self.memory_tokens)
            self.memory_read = self.memory_read or self.mode.cost_keeps_input(block, position)
        saved, out = self.mode.cost_linear(self, in_features, out_features, block=block, position=position, bias=bias,
                                           input_saved=(input_from_attention and self.output_saved) or from_memory)
        self.save(saved)
        kept = self.mode.cost_product_output(self, out_features, block=block, position=position, out=out)
        self.keep(kept or 0.0)
        share = self.share.get(block, self.share["split"])
        replicated = self.share.get("replicated", self.share["split"])
        self._products(block, 2 * self.M * in_features * out_features * share, again=kept is None)
        if position == "in":
            self._elementwise("add", self.M * out_features * (share if bias else 0))
        else:  # the bias and the residual add
            self.tail = (self.op, self.M * out_features * replicated * (2 if bias else 1))
            self._elementwise("add", self.tail[1])
        self._set_length(length)
        self.previous, self.current, self.output_saved = self.current, out, False

    def activation(self, width: int, *, kind: str = "gelu_tanh", gated: bool = False) -> None:
        """The MLP's elementwise activation (lattice.models.components.ACTIVATIONS) on `width`
        hidden features: GELU and SiLU save their input, ReLU its output (which the next linear
        saves anyway, where the layout keeps a linear's input as it is); gated (SwiGLU),
        act(gate) * up over the IN linear's two segments saves both (one storage) and act(gate)."""
        self._next()
        share = self.share.get("mlp", self.share["split"])
        out = self.M * width * share
        saves_input = kind != "relu"
        own_output = 0 if self.mode.cost_keeps_input("mlp", "out") else out
        self.save((self.current + out) if gated else (self.current if saves_input else own_output))
        self._elementwise(kind + ("_gated" if gated else ""), self.M * width * share)
        self.current, self.output_saved = out, False

    def dense(self, in_features: int, out_features: int, *, bias: bool, activation: str) -> None:
        """A linear from the residual layout back to it (`Mode.dense`) and its elementwise
        activation (BERT's MLM transform: dense, GELU; a norm follows)."""
        self._next()
        saved, out = self.mode.cost_dense(self, in_features, out_features, bias)
        share = self.share.get("dense", self.share["split"])
        self.save(saved + (out if activation != "relu" else 0))  # GELU saves its input
        self._products("dense", 2 * self.M * in_features * out_features * share)
        self._elementwise("add", self.M * out_features * share * (1 if bias else 0))
        self._elementwise(activation, self.M * out_features * share)
        self.current, self.output_saved = out, False

    def lm_head(self) -> None:
        """The LM head against the (tied) table and the cross-entropy."""
        self._work("ops", 1)
        self.region = "head"
        self.save(self.mode.cost_lm_head(self))
        if self.cp > 1 and self.c.pipeline is None:  # each rank's weighed mean loss summed over the cp group
            self.add("forward", "all_reduce", (CP,), 1, 1, "loss")
        share = self.share.get("head", self.share["split"])
        self._products("head", 2 * self.M * self.h * self.vocab_padded * share, calls=0)
        self._elementwise("loss", self.M * self.vocab_padded * share)

    def classifier(self, num_labels: int, *, pooler: bool = False) -> None:
        """A head over the first token of every sequence (`Mode.pool`), run replicated: with
        `pooler`, a linear h -> h and tanh (BERT's), then a linear to `num_labels` and the
        cross-entropy of the replica batch's class ids."""
        self._work("ops", 1)
        self.region = "head"
        pooled = self.B * self.h if pooler else 0  # tanh's output, which the classifier saves too
        self.save(self.mode.cost_pool(self) + pooled + self.B * num_labels + 1)  # inputs, log-softmax, total weight
        self.save_ints(8 * self.B)  # the class ids
        self._work("flops", 2 * self.B * self.h * (num_labels + (self.h if pooler else 0)))
        self._elementwise("loss", self.B * num_labels)

    # ---- the step
    def build(self):
        c = self.c
        self.model.cost_layout(self)
        c.residual_elements = self.residual
        layers, layer_ints = self.layers_saved["elements"], self.layers_saved["ints"]
        if c.checkpointing:  # each layer's input survives the forward, and under "selective" what its products return
            layers = self.layers_saved["checkpointed"] + (self.layers_saved["kept"] if c.checkpointing == "selective" else 0)
            layer_ints = 0
        if self.memory_read:  # the encoder's output, as the layout's cross-attention keeps it
            self.saved["other"] += self.memory_elements
        c.memory["activations"] = (c.itemsize * (layers + self.saved["other"]) + layer_ints + self.saved["ints"])
        params = list(self.params.values())
        c.memory = {"parameters": c.itemsize * sum(p.numel() for p in params), **c.memory}
        c.param_tensors = len(params)
        dp = self.topo.size(DP)
        mixed = c.precision == "bf16"  # bf16 weights: fp32 master rows, moments and gradient reduction
        # the Trainer's reduction over dp x cp sums over cp too (sync_grads does, under a pipeline or alone)
        reduces_cp = c.pipeline is None and (c.zero or mixed or dp > 1)
        self._gradient_sums(over_cp=not reduces_cp)
        if c.pipeline is not None:
            pipeline_terms(self)
        state = 4 if mixed else c.itemsize
        reduced = 2 if mixed and c.grad_reduce_dtype == "bf16" else state  # the gradient reduction's element
        ranks = dp * self.cp  # holding the same shards of other tokens
        coords = c.topology.coords(c.rank)
        kinds: dict[tuple, int] = {}  # an MoE's experts split over replica axes: the others' ranks share them
        for name, p in self.params.items():
            spec = self.model.specs[name]
            if spec.replica_splits and spec.trainable:
                kinds[spec.replica_splits] = kinds.get(spec.replica_splits, 0) + p.numel()
        frozen = sum(p.numel() for name, p in self.params.items() if not self.model.specs[name].trainable)
        m = microbatch_count(self.model.ctx)  # (ZeRO-3's blocks stay gathered over several)
        if c.zero or mixed:  # lattice.parallel.zero's buckets: a reduce-scatter in backward and an all-gather after the
            shards = ranks if c.zero else 1  # update, or (one shard) an all-reduce, over dp x cp
            gathers = (weight_gathers(self.model, self.params, m, c.reshard_after_forward, c.reshard_microbatches)
                       if c.zero == 3 else {})
            for _, names, segment, split in plan_buckets(self.model, shards, itemsize=reduced, cp_summed=not reduces_cp,
                                                         params=self.params, by_block=c.zero == 3):
                n, axes = zero_split(self.model.ctx, split, shards, 0)[0], sharers(split)
                size = math.prod(self.topo.size(a) for a in axes)
                if n > 1:
                    self.add("backward", "reduce_scatter", axes, n * segment, 1, "grads", itemsize=reduced,
                             beside_backward=c.overlap_grad_reduce)
                    if c.zero < 3:
                        self.add("optimizer", "all_gather", axes, n * segment, 1, "grads")
                    for phase, calls in gathers.get(names[0], {}).items():  # ZeRO-3's around the forward and backward
                        if calls:
                            c.terms.append(Term(phase, "all_gather", tuple(axes), calls, calls * n * segment, "weights",
                                                c.itemsize))
                elif size > 1:
                    self.add("backward", "all_reduce", axes, segment, 1, "grads", itemsize=reduced,
                             beside_backward=c.overlap_grad_reduce)
        elif dp > 1:  # data-parallel gradient averaging, bucketed as DDP does (over dp x cp; a pipeline's over dp)
            grads = c.memory["parameters"] / c.itemsize - sum(kinds.values()) - frozen  # (DDP's: no expert bias)
            c.reduced_grad_bytes = grads * c.itemsize  # read and written once into the buckets
            # (DDP's buckets start in backward; a pipeline's flat all-reduce, a stage's too, after it)
            self.add("backward", "all_reduce", (DP, CP) if c.pipeline is None else (DP,), grads,
                     max(1, math.ceil(grads * c.itemsize / DDP_BUCKET_BYTES)), "grads",
                     beside_backward=c.pipeline is None and c.parts is None)
            for split, numel in kinds.items():  # the Trainer's sum of the experts over the axes they are not split over
                axes = tuple(a for a in (DP, CP) if a not in split and (a == DP or c.pipeline is None))
                if math.prod(self.topo.size(a) for a in axes) > 1:
                    self.add("backward", "all_reduce", axes, numel, 1, "grads")
        shards, shard = (ranks, coords.get(DP, 0) * self.cp + coords.get(CP, 0))
        kept = not (c.reshard_microbatches if m > 1 else c.reshard_after_forward)
        held = memory_per_rank(self.model, shards, shard, c.zero, c.itemsize, 4 if mixed else None,
                               params=self.params, gathered_blocks=None if kept else 1 + c.overlap_param_gather,
                               parts_freed=parts_freed(self.model, m, c.reshard_after_forward))
        c.memory["gradients"] = held["gradients"]
        c.memory["optimizer"] = held["optimizer"]  # AdamW's moments (and fp32 master rows), this rank's rows under ZeRO
        if c.zero == 3:  # the weights kept between uses, and those gathered during the step
            c.memory["parameters"], c.memory["gathered"] = held["parameters"], held["gathered"]
        self._totals()

    def _gradient_sums(self, over_cp: bool = True):
        """sync_grads: one all-reduce per bucket of parameters whose specs share grad_sum axes;
        under cp, with `over_cp`, one per bucket of every gradient over cp."""
        self.region = "grads"
        params = self.params
        for axes, names in grad_sum_buckets(self.model, params=params):
            if self.c.group_size(axes) > 1:
                self.add("backward", "all_reduce", axes, sum(params[n].numel() for n in names), 1, "grads")
        if self.cp > 1 and over_cp:  # every gradient over the cp group (but experts split over it)
            held = [n for n in self.model.specs if n in params and CP not in self.model.specs[n].replica_splits]
            for names in byte_buckets(held, lambda n: params[n].numel() * params[n].element_size()):
                self.add("backward", "all_reduce", (CP,), sum(params[n].numel() for n in names), 1, "grads")

    def _totals(self):
        """Forward and backward work: backward is twice the forward, plus one forward of every
        layer under activation checkpointing (under selective checkpointing, of its work but its
        products, its fused attention and its last residual add: its elementwise operators, the
        operations around them, and attention the math kernel runs in products)."""
        layers, other = self.work["layers"], self.work["other"]
        by_operator = sorted({kind for kind in layers | other if kind.startswith("elementwise:")})
        recomputed = {kind: layers.get(kind, 0.0) for kind in WORK_KINDS + tuple(by_operator)}
        if self.c.checkpointing == "selective":
            recomputed.update({kind: layers.get("again:" + kind, 0.0) for kind in
                               ("flops", "attention_flops", "scores", "linear_calls", "product_weights")})
            recomputed["ops"] = layers.get("ops", 0.0) - layers.get("linear_calls", 0.0) + recomputed["linear_calls"]
            for kind in ("elementwise", "elementwise:add"):
                recomputed[kind] -= layers.get("unrepeated:" + kind, 0.0)
        elif not self.c.checkpointing:
            recomputed = dict.fromkeys(recomputed, 0.0)

        def phases(kind, layers_only=False):
            fwd = layers.get(kind, 0.0) + (0.0 if layers_only else other.get(kind, 0.0))
            return {"forward": fwd, "backward": 2 * fwd + recomputed[kind]}

        for kind in WORK_KINDS:  # Cost has a field of each kind's name
            setattr(self.c, kind, phases(kind))
        self.c.elementwise_ops = {kind.split(":", 1)[1]: phases(kind) for kind in by_operator}
        self.c.stem = {kind: phases(kind, layers_only=True) for kind in WORK_KINDS + tuple(by_operator)}
