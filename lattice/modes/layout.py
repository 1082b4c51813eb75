"""From a layout request to a Topology and this process's ParallelContext.

    layout = Layout("2d", tp=4, dp=2)                 # validation only, no processes
    ctx = layout.context(rank=3)                      # a context without process groups (or plan("2d", tp=4, rank=3))
    ctx = init(layout)                                # in a torchrun-started process (or init("2d", tp=4, dp=2))

This module joins the registry of modes (which declare axes, options and groups) with the pure
data of lattice.parallel.context, so that neither of those two imports the other.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from lattice.modes import REFERENCE_MODE, available_modes, get_mode
from lattice.modes.options import flag
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, Topology
from lattice.parallel.pipeline_config import SCHEDULES, PipelineConfig


def _axis_combinations(topo: Topology, mode_cls, expert_axes: tuple = ()) -> list[tuple]:
    """Groups over several axes that this layout needs: the mode's, the model replica's, and the
    experts' where they span the replicas and an axis of the replica."""
    wanted = [topo.canonical_axes(axes) for axes in mode_cls.groups(topo)] + [topo.canonical_axes(expert_axes)]
    wanted.append(topo.model_axes)
    wanted.append(topo.tensor_axes)  # a pipeline stage's tensor ranks (the same as the replica without pp)
    wanted.append(topo.canonical_axes((MeshAxis.DP, MeshAxis.CP)))  # the gradient reduction's, under cp
    out = []
    for axes in wanted:
        live = tuple(a for a in axes if topo.size(a) > 1)
        if len(live) > 1 and live not in out:
            out.append(live)
    return out


def _create_multi_axis_groups(topo: Topology, rank: int, device_type: str, expert_axes: tuple = ()) -> dict:
    """One process group per combination and coordinate; every rank creates every group, in the
    same order, as torch requires."""
    backend = "nccl" if device_type == "cuda" else None
    out = {}
    for axes in _axis_combinations(topo, get_mode(topo.mode), expert_axes):
        mine, _ = dist.new_subgroups_by_enumeration(topo.all_groups(axes), backend=backend)
        out[axes] = mine
    return out


CP_ATTENTION = ("ring", "all_gather", "ulysses")  # lattice.models.components.ContextParallel
PLACEMENTS = ("natural", "topology")  # ranks in mesh order, or the mode's topology-aware grid


@dataclass(frozen=True)
class Layout:
    """One layout request, whole: the mode, its sizes, the pipeline settings, the mode's options,
    the placement of ranks on nodes. Validated when built (no processes involved); `topology` and
    `pipeline` are derived from it, and `options` holds the mode's options with its defaults
    filled in, so two requests for the same layout compare equal.

        Layout("2d", tp=4, dp=2)
        Layout("1d", tp=2, pp=2, microbatches=4, options={"sequence_parallel": True})
        Layout.of("1d", tp=2, sequence_parallel=True)   # keyword arguments as lattice.init takes them

    The pipeline settings (`microbatches`, `pp_schedule`, `pp_virtual`, `pp_layers`,
    `pp_scatter_gather`; see lattice.parallel.pipeline_config.PipelineConfig) need pp > 1, but
    `microbatches`, which with pp = 1 is gradient accumulation (the replica batch in that many
    forward and backward passes before one update); None leaves each at its default."""

    # the fields with `flag` metadata are the command-line flags of a layout (lattice.cli.arguments
    # derives them); `options` holds the modes' own, whose flags lattice.modes.options derives
    mode: str = flag(REFERENCE_MODE, "parallel layout", choices=available_modes)
    tp: int = flag(1, "ranks per model replica (tensor parallel degree)")
    dp: int = flag(1, "data-parallel replicas")
    pp: int = flag(1, "pipeline stages (a model replica is tp x pp ranks)")
    cp: int = flag(1, "context-parallel ranks: each holds 2 of 2·cp chunks of every sequence, attention runs "
                      "around their ring (a model replica is tp x cp x pp ranks)")
    cp_attention: str = flag("ring", "how attention reads the other cp ranks' keys: around the ring, all-gathered, "
                                     "or all-to-all to whole sequences of 1/cp of the heads (ulysses)",
                             choices=lambda: CP_ATTENTION)
    microbatches: int | None = flag(None, "micro-batches per step: a pipeline's (default pp), or with --pp 1 "
                                          "gradient accumulation (the replica batch in that many passes, one "
                                          "update; default 1)")
    pp_schedule: str | None = flag(None, f"pipeline schedule (default {PipelineConfig.schedule})",
                                   choices=lambda: SCHEDULES)
    pp_virtual: int | None = flag(None, "virtual stages per rank, interleaved (default 2)")
    pp_layers: tuple[int, ...] | None = flag(None, "blocks per (virtual) stage (default: an even split)",
                                             metavar="N,N,...")
    pp_scatter_gather: bool | None = flag(None, "send 1/tp of a replicated residual between stages and all-gather "
                                                "it (default on)")
    ep: int = flag(1, "expert-parallel ranks: a mixture of experts' experts split over this many ranks, each token "
                      "sent to its experts' rank and back: a replica's (1d: tp; 2d, 3d: q; subgraph: tp / subgrids), "
                      "the cp ranks, the dp replicas, or several of them (their product)")
    options: Mapping[str, Any] = field(default_factory=dict)
    placement: str = flag(PLACEMENTS[0], "rank placement: in mesh order, or the mode's topology-aware grid",
                          choices=lambda: PLACEMENTS)
    ranks_per_node: int | None = flag(None, "ranks per node for placement (default: all on one node)")

    def __post_init__(self):
        mode_cls = get_mode(self.mode)
        for name in ("tp", "dp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LatticeConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.pp_layers, str):  # "2,3" from the command line or a config file
            try:
                object.__setattr__(self, "pp_layers", tuple(int(x) for x in self.pp_layers.split(",")))
            except ValueError:
                raise LatticeConfigError(f"pp_layers must be comma-separated block counts such as 2,3, "
                                         f"got {self.pp_layers!r}") from None
        elif self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        object.__setattr__(self, "options", mode_cls.resolve_options(dict(self.options)))
        object.__setattr__(self, "expert_axes", mode_cls.expert_axes(self.ep, self.tp, self.dp, self.options, self.cp))
        object.__setattr__(self, "pipeline", self._pipeline_config())
        if self.placement not in PLACEMENTS:
            raise LatticeConfigError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.pp > 1 and self.placement != "natural":
            raise LatticeConfigError("placement 'topology' is not implemented with pipeline parallelism; use the "
                                     "natural placement with pp > 1")
        if len(self.expert_axes) > 1 and self.placement != "natural":
            raise LatticeConfigError(f"placement 'topology' is not implemented with ep = {self.ep} over several mesh "
                                     f"axes; use the natural placement")
        if self.cp_attention not in CP_ATTENTION:
            raise LatticeConfigError(f"cp_attention must be one of {CP_ATTENTION}, got {self.cp_attention!r}")
        if self.cp > 1 and self.placement != "natural":
            raise LatticeConfigError("placement 'topology' is not implemented with context parallelism; use the "
                                     "natural placement with cp > 1")
        axes = ((MeshAxis.DP, self.dp),) + (((MeshAxis.PP, self.pp),) if self.pp > 1 else ()) \
            + (((MeshAxis.CP, self.cp),) if self.cp > 1 else ()) + tuple(mode_cls.mesh_axes(self.tp, self.options))
        world = math.prod(s for _, s in axes)
        per_node = self.ranks_per_node or world
        grid = (mode_cls.rank_grid(axes, per_node, self.placement, self.options) if self.placement == "topology"
                else tuple(range(world)))
        object.__setattr__(self, "topology", Topology(mode=self.mode, axes=axes, rank_grid=tuple(grid),
                                                      ranks_per_node=per_node))

    def _pipeline_config(self) -> PipelineConfig | None:
        given = {k: getattr(self, k) for k in PIPELINE_SETTINGS if getattr(self, k) is not None}
        if self.pp == 1:
            m = given.pop("microbatches", 1)  # gradient accumulation
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise LatticeConfigError(f"microbatches must be a positive integer, got {m!r}")
            if given:
                raise LatticeConfigError(f"{sorted(given)} configure pipeline parallelism, which needs pp > 1; "
                                         f"pass pp (--pp) or drop them")
            return None
        return PipelineConfig(stages=self.pp, microbatches=self.microbatches,
                              schedule=self.pp_schedule or PipelineConfig.schedule, virtual=self.pp_virtual,
                              layers=self.pp_layers, scatter_gather=self.pp_scatter_gather is not False)

    @classmethod
    def of(cls, mode: str = REFERENCE_MODE, **kwargs) -> "Layout":
        """A Layout from keyword arguments as `lattice.init` takes them: the fields by name, every
        other keyword an option of the mode."""
        names = {f.name for f in fields(cls)} - {"mode", "options"}
        return cls(mode, **{k: v for k, v in kwargs.items() if k in names},
                   options={k: v for k, v in kwargs.items() if k not in names})

    def replace(self, **changes) -> "Layout":
        """This layout with some fields changed (`options` merged into the current ones)."""
        if "options" in changes:
            changes["options"] = {**self.options, **changes["options"]}
        return dataclasses.replace(self, **changes)

    def record(self) -> dict:
        """The request as plain values, for a checkpoint's record and the run's config."""
        return {f.name: (dict(v) if f.name == "options" else list(v) if isinstance(v, tuple) else v)
                for f in fields(self) for v in [getattr(self, f.name)]}

    def stage_layout(self) -> "Layout":
        """The tensor ranks of one pipeline stage alone: this mode, tp and options, one replica, no
        pipeline, placed on nodes as the whole layout is (`ranks_per_node`, `placement`)."""
        # the stage's share of ep: without the replicas' and the cp ranks'
        ep = self.ep // math.prod(self.topology.size(a) for a in self.expert_axes if a in (MeshAxis.DP, MeshAxis.CP))
        return Layout(self.mode, tp=self.tp, ep=ep, options=self.options, ranks_per_node=self.ranks_per_node,
                      placement=self.placement)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def accumulation(self) -> int:
        """Gradient accumulation's passes per step: `microbatches` without a pipeline, else 1 (a
        pipeline's micro-batches are its schedule's)."""
        return (self.microbatches or 1) if self.pp == 1 else 1

    def context(self, rank: int = 0) -> ParallelContext:
        """A ParallelContext of `rank` without process groups, for inspecting layouts and building
        meta models."""
        return ParallelContext(topology=self.topology, rank=rank, options=self.options, pipeline=self.pipeline,
                               layout=self)


PIPELINE_SETTINGS = ("microbatches", "pp_schedule", "pp_virtual", "pp_layers", "pp_scatter_gather")


def as_layout(mode, kwargs: dict) -> Layout:
    """A Layout given whole, or built from `lattice.init`'s keyword arguments."""
    if isinstance(mode, Layout):
        if kwargs:
            raise LatticeConfigError(f"a Layout is given whole; change it with layout.replace({', '.join(kwargs)}=...)")
        return mode
    return Layout.of(mode, **kwargs)


def context(mode="serial", *, rank: int = 0, **layout) -> ParallelContext:
    """A ParallelContext without process groups (a Layout, or the keyword arguments of `init`),
    for inspecting layouts and building meta models."""
    return as_layout(mode, layout).context(rank)


def check_process_count(layout, nproc: int, command: str) -> None:
    """Refuse, before any process starts, a layout whose ranks are not the processes `lattice
    COMMAND` will run in: the --nproc N it starts, or (nproc 1) the one process it is."""
    need = layout.world_size
    if nproc == need:
        return
    axes = " x ".join(f"{a.value}={s}" for a, s in layout.topology.axes)
    has = f"mode {layout.mode!r} with {axes} has {need} ranks"
    if nproc > 1:
        raise LatticeConfigError(f"--nproc {nproc} does not match the layout: {has}; use --nproc {need} or change "
                                 f"--tp/--dp/--pp/--cp")
    raise LatticeConfigError(f"{has}, one process each; add --nproc {need} to start them on this machine (or start "
                             f"them with torchrun --nproc-per-node {need} -m lattice {command} ...), or change "
                             f"--tp/--dp/--pp/--cp")


def init(mode: str | Layout = REFERENCE_MODE, *, backend: str | None = None, seed: int = 0,
         timeout: float | None = None, **layout) -> ParallelContext:
    """Build the ParallelContext for this process.

    In a process started by torchrun (or `lattice train --nproc N`), this initialises the default
    process group if needed and builds a DeviceMesh with named axes. `mode="serial"` with tp=dp=1
    needs no process group. Every rank validates the request before any collective runs.
    `pp` > 1 adds pipeline stages (a replica is then tp x pp ranks) with the options
    `microbatches`, `pp_schedule` ("gpipe", "1f1b", "interleaved"), `pp_virtual`, `pp_layers` and
    `pp_scatter_gather` (see lattice.parallel.pipeline). `cp` > 1 splits every sequence over
    that many ranks per tensor position (context parallelism; lattice.parallel.context_parallel).
    """
    layout = as_layout(mode, layout)
    topo, options, pipeline, pp = layout.topology, layout.options, layout.pipeline, layout.pp
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    world = dist.get_world_size() if dist.is_initialized() else env_world
    if world != topo.world_size:
        axes = " x ".join(f"{a.value}={s}" for a, s in topo.axes)
        raise LatticeConfigError(
            f"mode {layout.mode!r} with {axes} needs {topo.world_size} processes but {world} were started; "
            f"launch with --nproc-per-node {topo.world_size} or change tp/dp/pp/cp so that the layout "
            f"has {world} rank{'' if world == 1 else 's'}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if world == 1 and not dist.is_initialized():
        if backend == "nccl":
            device = torch.device("cuda", 0)
        return ParallelContext(topology=topo, rank=0, options=options, mesh=None, device=device, seed=seed,
                               pipeline=pipeline, layout=layout)
    if not dist.is_initialized():
        # `timeout`: seconds a collective waits for the other ranks before failing (torch's default
        # is 30 minutes, which makes a stalled rank look like a hang)
        dist.init_process_group(backend, **({"timeout": timedelta(seconds=timeout)} if timeout else {}))
    rank = dist.get_rank()
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor(topo.rank_grid, dtype=torch.int64).reshape(topo.shape)
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=tuple(a.value for a in topo.axis_names))
    groups = _create_multi_axis_groups(topo, rank, device.type, layout.expert_axes)
    embedding_group = None
    if pp > 2:  # the first and last stage of each tensor position (tied embeddings)
        ends = [[topo.rank_at({**topo.coords(r), MeshAxis.PP: 0}), topo.rank_at({**topo.coords(r), MeshAxis.PP: pp - 1})]
                for r in range(topo.world_size) if topo.coords(r)[MeshAxis.PP] == 0]
        embedding_group, _ = dist.new_subgroups_by_enumeration(ends, backend="nccl" if device.type == "cuda" else None)
    return ParallelContext(topology=topo, rank=rank, options=options, mesh=mesh, device=device, seed=seed,
                           multi_axis_groups=groups, pipeline=pipeline, embedding_group=embedding_group,
                           layout=layout)
