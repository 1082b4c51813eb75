"""The distributed optimizer's all-gather of updated weights overlapped with the next forward
(Megatron-LM's --overlap-param-gather): after the update every bucket's all-gather starts at
once, and each is awaited just before the first module that reads the bucket runs, so that
the gathers of later layers travel while earlier layers compute.

Which module reads which bucket first is learned from the first forward (before any update,
when nothing is pending): the forward pre-hook of every module holding parameters records
its buckets in the order they run. Buckets no module's forward recorded (a weight read by a
method other than forward, such as a loss head's, or a pipeline stage's mirror of a table
another stage's module holds) are issued first and awaited before the first module runs.
Anything else that reads the weights between the update and the next forward (a checkpoint,
`full_state_dict`) must call `ZeroOptimizer.finish_param_gathers()` first; the Trainer does.
"""

from __future__ import annotations

import functools
from typing import Callable

from torch import nn


class ParamGatherOverlap:
    """Pending all-gathers by bucket, awaited by forward pre-hooks on the modules of `root`
    (`bucket_of`: id(parameter) -> its bucket's index, of `buckets` buckets)."""

    def __init__(self, root: nn.Module, bucket_of: dict[int, int], buckets: int):
        self.buckets = buckets
        self.seen: list[int] = []  # buckets in the order the first forward's modules read them
        self.order: list[int] | None = None  # the issue order, fixed at the first update
        self.position: dict[int, int] = {}
        self.pending: dict[int, Callable[[], None]] = {}  # bucket -> its finish, in issue order
        for module in root.modules():
            params = list(module.parameters(recurse=False))
            # a segmented linear reads its segments' parameters, which child modules that never run
            # hold (lattice.modes.kernels.layers.register_linear): its own hook awaits them
            for name in getattr(module, "segment_names", None) or ():
                params += getattr(module, name).parameters(recurse=False)
            own = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})
            if own:
                module.register_forward_pre_hook(functools.partial(self._before_forward, own))

    def issue_order(self) -> list[int]:
        """The buckets no forward recorded, then those it did, in the order it read them."""
        if self.order is None:
            read = list(dict.fromkeys(self.seen))
            self.order = [b for b in range(self.buckets) if b not in read] + read
            self.position = {b: i for i, b in enumerate(self.order)}
        return self.order

    def start(self, bucket: int, finish: Callable[[], None]) -> None:
        self.pending[bucket] = finish

    def finish(self, upto: int | None = None) -> None:
        """Await the pending gathers issued up to position `upto` of the issue order (all by
        default), oldest first."""
        for bucket in list(self.pending):
            if upto is not None and self.position[bucket] > upto:
                break
            self.pending.pop(bucket)()

    def _before_forward(self, own: list[int], module, args) -> None:
        if self.order is None:
            self.seen.extend(own)
        elif self.pending:
            self.finish(upto=max(self.position[b] for b in own))
