"""Several sources mixed with weights, as Megatron-LM's `--data-path 0.7 a 0.3 b`: `--data "0.7 a
0.3 b"`. Sample i of the run (step t's row r is sample t*B + r) comes from the source whose share
of [0, 1) holds frac((i + 1/2) * (sqrt(5) - 1) / 2 + seed's offset): an equidistributed sequence, so
over any n samples each source's count is within a few samples of its weight * n, and a sample's
source is a function of (seed, i) alone (a resumed run draws the same). Its window is a uniform
start in that source, drawn from the step's generator as for a single source.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lattice.data.token_files import windows
from lattice.parallel.context import LatticeConfigError

GOLDEN = (math.sqrt(5) - 1) / 2


def parse_blend(spec: str | None) -> list[tuple[float, str]] | None:
    """[(weight, path), ...] normalized to sum 1 of a `--data "W1 PATH1 W2 PATH2 ..."`, or None
    for a single source (a path that is not such a list); a list that does not parse is refused."""
    if spec is None:
        return None
    words = spec.split()
    if len(words) < 2 or not _is_number(words[0]):
        return None
    if len(words) % 2 or not all(_is_number(w) for w in words[::2]):
        raise LatticeConfigError(f"--data {spec!r} is not a blend of weighted sources: write it as \"0.7 PATH_A 0.3 "
                                 f"PATH_B\" (a weight before each path)")
    weights = [float(w) for w in words[::2]]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise LatticeConfigError(f"--data {spec!r}: every weight of a blend must be a positive number, got "
                                 f"{', '.join(words[::2])}")
    total = sum(weights)
    return [(w / total, path) for w, path in zip(weights, words[1::2])]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


class Blend:
    """Token streams (each a tensor or a memory-mapped array) drawn from in proportion to `weights`."""

    def __init__(self, parts: list, weights: list[float], names: list[str]):
        self.parts, self.weights, self.names = parts, np.asarray(weights, dtype=np.float64), names
        self.bounds = np.cumsum(self.weights)
        self.bounds[-1] = 1.0

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def sources(self, first: int, count: int, seed: int) -> np.ndarray:
        """The source of samples first .. first + count - 1."""
        i = np.arange(first, first + count, dtype=np.float64)
        u = np.mod((i + 0.5) * GOLDEN + seed * GOLDEN * GOLDEN, 1.0)
        return np.searchsorted(self.bounds, u, side="right")

    def step_windows(self, step: int, gen: torch.Generator, *, seed: int, batch_size: int, length: int,
                     rows: slice) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """(windows (rows, length), their sources, their first tokens in them) of step `step`'s
        global batch: sample step*B + r from its source."""
        which = self.sources(step * batch_size, batch_size, seed)
        where = torch.rand(batch_size, generator=gen, dtype=torch.float64)
        picked = np.arange(batch_size)[rows]
        starts = np.array([int(where[r] * (len(self.parts[which[r]]) - length + 1)) for r in picked], dtype=np.int64)
        out = [windows(self.parts[which[r]], torch.tensor([s]), length) for r, s in zip(picked, starts)]
        return (torch.cat(out) if out else torch.empty(0, length, dtype=torch.int64)), which[picked], starts

    def spread(self, n: int, length: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """(windows (n, length), their sources, their first tokens) of the validation: window k
        from source `sources(k)`, each source's windows evenly spread over it."""
        which = self.sources(0, n, 0)
        out = torch.empty(n, length, dtype=torch.int64)
        starts = np.zeros(n, dtype=np.int64)
        for k, part in enumerate(self.parts):
            mine = np.flatnonzero(which == k)
            if len(mine):
                starts[mine] = torch.linspace(0, len(part) - length, len(mine)).long().numpy()
                out[torch.from_numpy(mine)] = windows(part, torch.from_numpy(starts[mine]), length)
        return out, which, starts
