"""The parallel topology (which rank sits where on the mesh) and the per-process context.

A `Topology` is pure data: the mode, the named mesh axes with their sizes, and which global rank
sits at each mesh position. It needs no process group, so `lattice info` and the cost model can
use it for any rank. A `ParallelContext` is one process's view of a topology: its rank, its mesh
coordinates, and the process group of each axis (from `torch.distributed.device_mesh`).

"axis" always means a mesh axis (an enum member of `MeshAxis`); "dim" always means a tensor
dimension.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes the built-in modes use. Data parallelism is always the outermost
    axis. The list is not closed: a mode module may declare its own axes as members of any
    `str`-valued Enum (see `Axis`); Topology and ParallelContext accept those alike."""

    DP = "dp"
    PP = "pp"  # pipeline stages (present when pp > 1), between DP and the tensor axes
    CP = "cp"  # context parallel: chunks of every sequence (present when cp > 1), between PP and the tensor axes
    TP = "tp"  # 1D: the tensor-parallel group
    ROW = "row"  # 2D: rank (i, j) = (row, col)
    COL = "col"
    CUBE_I = "cube_i"  # 3D: rank (i, j, l)
    CUBE_J = "cube_j"
    CUBE_L = "cube_l"
    SUBGRID = "subgrid"  # sub-graph: which sub-grid (g of them)
    MEMBER = "member"  # sub-graph: position inside the sub-grid (n_g of them)


#: axes every layout may have, of size 1 when absent
OPTIONAL_AXES = (MeshAxis.DP, MeshAxis.PP, MeshAxis.CP)

#: A mesh axis: a member of MeshAxis or of a mode's own str-valued Enum.
Axis = enum.Enum


class LatticeConfigError(ValueError):
    """A layout, size or file that cannot work. The message names the problem and the fix."""


class TrainingStopped(RuntimeError):
    """Training ended early on purpose (non-finite loss or gradient under --on-nan stop); the
    message says why and what was kept."""


class Diverged(TrainingStopped):
    """Training stopped on a non-finite loss, gradient or weight: a restart from the last
    checkpoint would reach it again."""


@dataclass(frozen=True)
class Topology:
    """Mesh axes (outermost first) and the global rank at every mesh position.

    `rank_grid` lists global ranks in mesh order (row-major over `axes`); a placement other than
    "natural" is a permutation of range(world_size).
    """

    mode: str
    axes: tuple[tuple[MeshAxis, int], ...]
    rank_grid: tuple[int, ...]
    ranks_per_node: int

    def __post_init__(self):
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise LatticeConfigError(f"mesh axes repeat: {names}")
        for axis, size in self.axes:
            if size < 1:
                raise LatticeConfigError(f"mesh axis {axis.value} has size {size}; sizes must be >= 1")
        if sorted(self.rank_grid) != list(range(self.world_size)):
            raise LatticeConfigError(
                f"rank placement must be a permutation of 0..{self.world_size - 1}, got {self.rank_grid}")
        if self.ranks_per_node < 1:
            raise LatticeConfigError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        # torch orders a process group's members by global rank, while lattice's collectives and
        # shard specs take group rank k to be mesh coordinate k; the two agree exactly when ranks
        # increase along every axis (true of transposed and tiled placements).
        grid = torch.tensor(self.rank_grid, device="cpu").reshape(self.shape)  # (also under a meta default device)
        for dim, (axis, size) in enumerate(self.axes):
            if size > 1 and not (grid.diff(dim=dim) > 0).all():
                raise LatticeConfigError(
                    f"rank placement must increase along every mesh axis, but it does not along "
                    f"{axis.value!r}; use a transposed or tiled placement (torch orders group members "
                    f"by global rank)")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def axis_names(self) -> tuple[MeshAxis, ...]:
        return tuple(axis for axis, _ in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of one pipeline stage (every axis but DP, PP and CP)."""
        return self.world_size // (self.size(MeshAxis.DP) * self.size(MeshAxis.PP) * self.size(MeshAxis.CP))

    @property
    def pp_size(self) -> int:
        return self.size(MeshAxis.PP)

    @property
    def cp_size(self) -> int:
        return self.size(MeshAxis.CP)

    @property
    def replica_size(self) -> int:
        """Ranks in one model replica: tp x cp x pp (every axis but DP)."""
        return self.world_size // self.size(MeshAxis.DP)

    def has(self, axis: MeshAxis) -> bool:
        return axis in self.axis_names

    def size(self, axis: MeshAxis) -> int:
        for name, size in self.axes:
            if name == axis:
                return size
        if axis in OPTIONAL_AXES:
            return 1
        raise KeyError(f"mode {self.mode!r} has no mesh axis {axis.value!r}; its axes are "
                       f"{[a.value for a in self.axis_names]}")

    def coords(self, rank: int) -> dict[Axis, int]:
        """Mesh coordinates of a global rank."""
        flat = self.rank_grid.index(rank)
        out = {}
        for axis, size in reversed(self.axes):
            out[axis] = flat % size
            flat //= size
        return dict(reversed(list(out.items())))

    def rank_at(self, coords: Mapping[MeshAxis, int]) -> int:
        flat = 0
        for axis, size in self.axes:
            flat = flat * size + coords.get(axis, 0)
        return self.rank_grid[flat]

    @property
    def model_axes(self) -> tuple[Axis, ...]:
        """The axes of one model replica: every axis but DP."""
        return tuple(a for a in self.axis_names if a != MeshAxis.DP)

    @property
    def tensor_axes(self) -> tuple[Axis, ...]:
        """The axes of one pipeline stage's tensor ranks: every axis but DP, PP and CP."""
        return tuple(a for a in self.axis_names if a not in OPTIONAL_AXES)

    def canonical_axes(self, axes) -> tuple[Axis, ...]:
        """`axes` (one axis or several) in mesh order, refusing axes this topology lacks."""
        axes = (axes,) if isinstance(axes, enum.Enum) else tuple(axes)
        for a in axes:
            if not self.has(a) and a not in OPTIONAL_AXES:
                raise KeyError(f"mode {self.mode!r} has no mesh axis {a.value!r}; its axes are "
                               f"{[x.value for x in self.axis_names]}")
        return tuple(a for a in self.axis_names if a in axes)

    def group_members(self, axes, rank: int) -> list[int]:
        """Global ranks of `rank`'s group over `axes` (one axis or several): the ranks that differ
        from it only along those axes. One axis: in axis-coordinate order (equal to global-rank
        order, which `__post_init__` enforces). Several: in global-rank order, as torch numbers
        the members of a process group."""
        axes = self.canonical_axes(axes)
        coords = self.coords(rank)
        members = [self.rank_at({**coords, **dict(zip(axes, ks))})
                   for ks in itertools.product(*(range(self.size(a)) for a in axes))]
        return members if len(axes) == 1 else sorted(members)

    def all_groups(self, axes) -> list[list[int]]:
        """Every group over `axes`, each listed once, in the order of their lowest ranks."""
        grouped, groups = set(), []
        for rank in range(self.world_size):
            if rank not in grouped:  # the groups over axes partition the ranks: one per rank not yet in one
                members = self.group_members(axes, rank)
                grouped.update(members)
                groups.append(members)
        return groups

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass
class ParallelContext:
    """One process's place in a topology: its rank, coordinates and per-axis process groups.

    Built once by `lattice.init` and passed explicitly to everything that communicates. With
    `mesh=None` (serial mode, or planning a layout without processes) every axis must have size 1
    for communication, but coordinates and shard layouts still work for any rank.
    """

    topology: Topology
    rank: int
    options: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    #: process groups over several mesh axes, keyed by their axes in mesh order (lattice.init
    #: creates those the mode declares in `Mode.groups`, and the model-parallel group)
    multi_axis_groups: Mapping[tuple, Any] = field(default_factory=dict)
    #: pipeline parallelism (stages, micro-batches, schedule), None without it
    pipeline: Any = None  # lattice.parallel.pipeline_config.PipelineConfig | None
    #: with pp > 2 and tied embeddings: the group of this tensor position's first and last stage
    embedding_group: Any = None
    #: the lattice.modes.layout.Layout this context was built from (None for a context built by hand)
    layout: Any = None

    def __post_init__(self):
        if not 0 <= self.rank < self.topology.world_size:
            raise LatticeConfigError(f"rank {self.rank} outside world size {self.topology.world_size}")
        self.coords = self.topology.coords(self.rank)

    @property
    def mode(self) -> str:
        return self.topology.mode

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp(self) -> int:
        return self.topology.size(MeshAxis.DP)

    @property
    def tp(self) -> int:
        return self.topology.tp_size

    @property
    def pp(self) -> int:
        return self.topology.pp_size

    @property
    def cp(self) -> int:
        """Context-parallel ranks: how many hold chunks of the same sequences."""
        return self.topology.cp_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self.coords.get(MeshAxis.PP, 0)

    def size(self, axis: MeshAxis) -> int:
        return self.topology.size(axis)

    def coord(self, axis: MeshAxis) -> int:
        if not self.topology.has(axis) and axis in OPTIONAL_AXES:
            return 0
        if axis not in self.coords:
            raise KeyError(f"mode {self.mode!r} has no mesh axis {axis.value!r}")
        return self.coords[axis]

    def group(self, *axes):
        """The process group over one or several mesh axes (None when it has one rank).

        `ctx.group(MeshAxis.TP)`; `ctx.group(CUBE_I, CUBE_J)` for a plane of the cube, which the
        mode must declare in `Mode.groups`; `ctx.group(*ctx.topology.model_axes)` (also
        `ctx.model_group()`) for the ranks of this model replica. Members of a group over several
        axes are numbered in global-rank order (see `Topology.group_members`)."""
        axes = self.topology.canonical_axes(axes)
        if math.prod(self.size(a) for a in axes) == 1:
            return None
        if self.mesh is None:
            raise RuntimeError(
                f"this ParallelContext has no process groups (built for planning); the group over "
                f"{[a.value for a in axes]} has {math.prod(self.size(a) for a in axes)} ranks")
        live = tuple(a for a in axes if self.size(a) > 1)
        if len(live) == 1:
            return self.mesh.get_group(live[0].value)
        if live not in self.multi_axis_groups:
            raise KeyError(
                f"no process group over axes {[a.value for a in live]}: mode {self.mode!r} must declare "
                f"it in its `groups` classmethod so that lattice.init creates it on every rank")
        return self.multi_axis_groups[live]

    def model_group(self):
        """The process group of this model replica (every axis but DP); None for one rank."""
        return self.group(*self.topology.model_axes)

    def tensor_group(self):
        """The tensor-parallel ranks of this pipeline stage (every axis but DP and PP; the
        model replica's group without pipeline parallelism); None for one rank."""
        return self.group(*self.topology.tensor_axes)

    def destroy_groups(self) -> None:
        """Destroy the process groups this context made (every rank calls it): an idle gloo group
        still polls (~0.05% of a core each), which a process building many layouts in turn pays
        for all of them. The default group, which a mesh of the whole world may use, stays."""
        import torch.distributed as dist

        groups = {*(self.mesh.get_all_groups() if self.mesh is not None else ()), *self.multi_axis_groups.values(),
                  self.embedding_group}
        for group in groups - {None, dist.GroupMember.NON_GROUP_MEMBER, dist.GroupMember.WORLD}:
            dist.destroy_process_group(group)

    def describe(self) -> str:
        coords = ", ".join(f"{a.value}={c}" for a, c in self.coords.items())
        return f"rank {self.rank}/{self.world_size} mode={self.mode} ({coords})"


def nearest_working(current: int, works, limit: int) -> list[int]:
    """The accepted values nearest `current` below and above it (up to `limit`)."""
    below = next((v for v in range(current - 1, 0, -1) if works(v)), None)
    above = next((v for v in range(current + 1, limit + 1) if works(v)), None)
    return [v for v in (below, above) if v is not None]
