"""The cost model's mixture-of-experts layer (lattice.models.moe.SparseMoE), a part of
`lattice.cost.builder.CostBuilder`."""

from __future__ import annotations

import math

from lattice.parallel.context import MeshAxis

DP, CP = MeshAxis.DP, MeshAxis.CP


class MoETerms:
    """CostBuilder's `moe` operation (it uses the builder's state and helpers)."""

    def moe(self, experts: int, top_k: int, width: int, *, normalize: bool, shared: int = 0, z_loss: bool = False) -> None:
        """A mixture of experts on the residual stream (lattice.models.moe.SparseMoE): the mode's
        whole tokens (`Mode.cost_expert_tokens`, n here), the router (h -> E, softmax at float32 or
        above, top-k), the balancing statistics (2E + 2 numbers all-reduced over the replica and the
        replicas, in training), each of the n·k assignments through its expert's SwiGLU of `width`,
        the combine, and a shared SwiGLU expert of width `shared` beside them; with `z_loss` the
        router's logsumexp too (one more statistic)."""
        self._next()
        h, n = self.h, self.mode.cost_expert_tokens(self)
        a = n * top_k
        stat = max(self.c.itemsize, 4)  # the router's probabilities: at float32 or above
        wide = stat / self.c.itemsize
        groups = [axes for axes in (self.topo.tensor_axes, self.topo.canonical_axes((DP, CP)))
                  if math.prod(self.topo.size(x) for x in axes) > 1]
        for axes in groups:
            self.add("forward", "all_reduce", axes, 2 * experts + 2 + z_loss, 1, "moe", itemsize=stat, once=True)
        # saved: the tokens, the probabilities, the top-k weights (and their sum), the statistics'
        # mask; each assignment's token row, its gate and up features, act(gate), their product,
        # its expert's output and its weight; the shared expert's four hidden tensors, its gate and
        # output; the top-k indices and the assignments' order and tokens as int64
        layout = self.model.ctx.layout
        axes = layout.expert_axes if layout is not None else ()
        if axes:  # the counts per expert, the rows to their experts' ranks and back (balanced
            # routing: each rank receives as many rows as it sends); recomputation repeats all three
            for phase, elements in (("forward", experts), ("forward", a * h), ("forward", a * h),
                                    ("backward", a * h), ("backward", a * h)):
                self.add(phase, "all_to_all", axes, elements, 1, "moe",
                         itemsize=8 if elements == experts and phase == "forward" else None)
        self.save(n * h + wide * (n * experts + (a + n if normalize else 0) + n + (n * experts + n if z_loss else 0))
                  + a * (2 * h + 4 * width + 1) + (4 * n * shared + n + n * h if shared else 0))
        self.save_ints(8 * (n * top_k + 2 * a))
        # the products' outputs: the router's logits, each assignment's gate and up features and its
        # expert's output; the shared expert's gate, up, output and its one gate logit per token
        self.keep(n * experts + a * (2 * width + h) + (n * (2 * shared + h + 1) if shared else 0))
        self._work("flops", 2 * n * h * experts + 6 * a * h * width + (6 * n * h * shared + 2 * n * h if shared else 0))
        self._work("linear_calls", 1 + 2 * experts + (4 if shared else 0))
        self._work("ops", 2 * experts + (3 if shared else 0))
        self._elementwise("silu_gated", a * width + n * shared)
        self._elementwise("add", n * experts + a * h + (n * h if shared else 0))  # softmax; weighting and combine
        self.current, self.output_saved = self.residual, False
