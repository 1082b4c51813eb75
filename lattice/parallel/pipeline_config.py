"""A pipeline's shape, decided once with the layout (`lattice.modes.layout.Layout`): the stages,
the micro-batches, the schedule and its virtual stages, which blocks each stage holds, and the
bubble the schedule leaves. lattice.parallel.pipeline builds and runs the stages from it."""

from __future__ import annotations

from dataclasses import dataclass

from lattice.parallel.context import LatticeConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineConfig:
    """How a replica's pp stages run: `microbatches` per step (default pp), the `schedule`, the
    virtual stages per rank (`virtual`, interleaved only; default 2) and an optional explicit
    split (`layers`: blocks per stage, or per virtual stage with interleaving)."""

    stages: int
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual: int | None = None
    layers: tuple[int, ...] | None = None
    #: send 1/t of a residual replicated over t tensor ranks and all-gather it on arrival
    scatter_gather: bool = True

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise LatticeConfigError(f"pp_schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        m = self.microbatches
        if m is not None and (not isinstance(m, int) or m < 1):
            raise LatticeConfigError(f"microbatches must be a positive integer, got {m!r}")
        if self.virtual is not None and self.schedule != "interleaved":
            raise LatticeConfigError(f"pp_virtual applies to the interleaved schedule; got pp_schedule "
                                     f"{self.schedule!r}: drop pp_virtual or use pp_schedule='interleaved'")
        if self.schedule == "1f1b" and self.m < self.stages:
            raise LatticeConfigError(f"1F1B needs at least pp = {self.stages} micro-batches, got {self.m}: use "
                                     f"--microbatches {self.stages} or more, or pp_schedule 'gpipe'")
        if self.schedule == "interleaved":
            if self.v < 2:
                raise LatticeConfigError(f"the interleaved schedule needs pp_virtual >= 2 stages per rank, got {self.v}")
            if self.stages < 2:
                raise LatticeConfigError("the interleaved schedule needs pp >= 2")
            if self.m % self.stages:
                raise LatticeConfigError(
                    f"the interleaved schedule needs a multiple of pp = {self.stages} micro-batches (as Megatron-LM), "
                    f"got {self.m}: use --microbatches {max(self.stages, self.m - self.m % self.stages)} or "
                    f"{self.m + self.stages - self.m % self.stages}, or pp_schedule '1f1b'")
        if self.layers is not None and (len(self.layers) != self.stages * self.v or min(self.layers) < 1):
            raise LatticeConfigError(f"pp_layers {list(self.layers)} must give {self.stages * self.v} positive block counts "
                                     f"(one per {'virtual ' if self.v > 1 else ''}stage)")

    @property
    def m(self) -> int:
        return self.microbatches or self.stages

    @property
    def v(self) -> int:
        return (self.virtual or 2) if self.schedule == "interleaved" else 1

    def chunks(self, n_layers: int, counted: str = "n_layers") -> list[range]:
        """The blocks of each (virtual) stage, in model order; chunk c runs on rank stage c % pp.
        `counted`: the config fields whose sum n_layers is (for messages)."""
        n = self.stages * self.v
        if self.layers is not None:
            if sum(self.layers) != n_layers:
                raise LatticeConfigError(f"pp_layers {list(self.layers)} add up to {sum(self.layers)} blocks, but the "
                                         f"model has {counted} = {n_layers}")
            counts = list(self.layers)
        else:
            if n_layers < n:
                raise LatticeConfigError(f"{counted} = {n_layers} blocks cannot fill {n} {'virtual ' if self.v > 1 else ''}"
                                         f"stages of at least one block each; use at most {n_layers} stages")
            if n_layers % n:
                raise LatticeConfigError(
                    f"{counted} = {n_layers} blocks do not split evenly into {n} {'virtual ' if self.v > 1 else ''}"
                    f"stages; choose {counted} divisible by {n}, or give the split with pp_layers "
                    f"(e.g. --pp-layers {','.join(map(str, _uneven(n_layers, n)))})")
            counts = [n_layers // n] * n
        starts = [sum(counts[:i]) for i in range(n)]
        return [range(a, a + c) for a, c in zip(starts, counts)]

    def bubble(self) -> float:
        """The idle fraction of a step: (p - 1) / (v m)."""
        return (self.stages - 1) / (self.v * self.m)


def _uneven(n_layers: int, n: int) -> list[int]:
    base, extra = divmod(n_layers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


# ----------------------------------------------------------------------------- scatter/gather
