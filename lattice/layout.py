"""From a layout request to a Topology and this process's ParallelContext.

    topo, options = make_topology("2d", tp=4, dp=2)   # validation only, no processes
    ctx = plan("2d", tp=4, rank=3)                    # a context without process groups
    ctx = init("2d", tp=4, dp=2)                      # in a torchrun-started process

This module joins the registry of modes (which declare axes, options and groups) with the pure
data of lattice.context, so that neither of those two imports the other.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
import torch
import torch.distributed as dist

from lattice.context import LatticeConfigError, MeshAxis, ParallelContext, Topology
from lattice.modes import REFERENCE_MODE, get_mode
from lattice.pipeline import PipelineConfig


def _natural_grid(world_size: int) -> tuple[int, ...]:
    return tuple(range(world_size))


def _axis_combinations(topo: Topology, mode_cls) -> list[tuple]:
    """Groups over several axes that this layout needs: the mode's, and the model replica's."""
    wanted = [topo.canonical_axes(axes) for axes in mode_cls.groups(topo)]
    wanted.append(topo.model_axes)
    wanted.append(topo.tensor_axes)  # a pipeline stage's tensor ranks (the same as the replica without pp)
    out = []
    for axes in wanted:
        live = tuple(a for a in axes if topo.size(a) > 1)
        if len(live) > 1 and live not in out:
            out.append(live)
    return out


def _create_multi_axis_groups(topo: Topology, rank: int, device_type: str) -> dict:
    """One process group per combination and coordinate; every rank creates every group, in the
    same order, as torch requires."""
    backend = "nccl" if device_type == "cuda" else None
    out = {}
    for axes in _axis_combinations(topo, get_mode(topo.mode)):
        mine, _ = dist.new_subgroups_by_enumeration(topo.all_groups(axes), backend=backend)
        out[axes] = mine
    return out


PLACEMENTS = ("natural", "topology")  # ranks in mesh order, or the mode's topology-aware grid
PIPELINE_OPTIONS = ("microbatches", "pp_schedule", "pp_virtual", "pp_layers", "pp_scatter_gather")


def pipeline_config(pp: int, options: dict):
    """Take the pipeline options out of `options`: a PipelineConfig for pp > 1, else None
    (refusing pipeline options without pp)."""
    given = {k: options.pop(k) for k in PIPELINE_OPTIONS if k in options}
    given = {k: v for k, v in given.items() if v is not None}
    if pp == 1:
        if given:
            raise LatticeConfigError(f"{sorted(given)} configure pipeline parallelism, which needs pp > 1; pass pp "
                                     f"(--pp) or drop them")
        return None
    layers = given.get("pp_layers")
    if isinstance(layers, str):
        try:
            layers = tuple(int(x) for x in layers.split(","))
        except ValueError:
            raise LatticeConfigError(f"pp_layers must be comma-separated block counts such as 2,3, got {layers!r}") from None
    return PipelineConfig(stages=pp, microbatches=given.get("microbatches"), schedule=given.get("pp_schedule", PipelineConfig.schedule),
                          virtual=given.get("pp_virtual"), layers=tuple(layers) if layers else None,
                          scatter_gather=given.get("pp_scatter_gather", True))


def make_topology(mode: str, *, tp: int = 1, dp: int = 1, pp: int = 1, ranks_per_node: int | None = None,
                  placement: str = "natural", **options) -> tuple[Topology, dict]:
    """Validate a layout request and build its Topology (no processes involved). Pipeline
    options in `options` are checked (see `pipeline_config`) and not returned."""
    topo, options, _ = _layout(mode, tp=tp, dp=dp, pp=pp, ranks_per_node=ranks_per_node, placement=placement,
                               **options)
    return topo, options


def _layout(mode: str, *, tp: int, dp: int, pp: int, ranks_per_node: int | None, placement: str,
            **options) -> tuple[Topology, dict, PipelineConfig | None]:
    """(Topology, the mode's options, the PipelineConfig or None) of a layout request."""
    mode_cls = get_mode(mode)
    if not isinstance(pp, int) or pp < 1:
        raise LatticeConfigError(f"pp must be a positive integer, got {pp!r}")
    options = dict(options)
    pipeline = pipeline_config(pp, options)  # takes the pipeline options out
    options = mode_cls.resolve_options(options)
    if not isinstance(dp, int) or dp < 1:
        raise LatticeConfigError(f"dp must be a positive integer, got {dp!r}")
    if not isinstance(tp, int) or tp < 1:
        raise LatticeConfigError(f"tp must be a positive integer, got {tp!r}")
    if pp > 1 and placement != "natural":
        raise LatticeConfigError("placement 'topology' is not implemented with pipeline parallelism; use the natural "
                                 "placement with pp > 1")
    tp_axes = mode_cls.mesh_axes(tp, options)
    axes = ((MeshAxis.DP, dp),) + (((MeshAxis.PP, pp),) if pp > 1 else ()) + tuple(tp_axes)
    world = math.prod(s for _, s in axes)
    rpn = ranks_per_node or world
    if placement not in PLACEMENTS:
        raise LatticeConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    grid = mode_cls.rank_grid(axes, rpn, placement, options) if placement == "topology" else _natural_grid(world)
    return Topology(mode=mode, axes=axes, rank_grid=tuple(grid), ranks_per_node=rpn), options, pipeline


def plan(mode: str, *, rank: int = 0, tp: int = 1, dp: int = 1, pp: int = 1, ranks_per_node: int | None = None,
         placement: str = "natural", **options) -> ParallelContext:
    """A ParallelContext without process groups, for inspecting layouts and building meta models."""
    topo, options, pipeline = _layout(mode, tp=tp, dp=dp, pp=pp, ranks_per_node=ranks_per_node,
                                      placement=placement, **options)
    return ParallelContext(topology=topo, rank=rank, options=options, pipeline=pipeline)


def init(mode: str = REFERENCE_MODE, *, tp: int = 1, dp: int = 1, pp: int = 1, ranks_per_node: int | None = None,
         placement: str = "natural", backend: str | None = None, seed: int = 0, timeout: float | None = None,
         **options) -> ParallelContext:
    """Build the ParallelContext for this process.

    In a process started by torchrun (or `lattice train --nproc N`), this initialises the default
    process group if needed and builds a DeviceMesh with named axes. `mode="serial"` with tp=dp=1
    needs no process group. Every rank validates the request before any collective runs.
    `pp` > 1 adds pipeline stages (a replica is then tp x pp ranks) with the options
    `microbatches`, `pp_schedule` ("gpipe", "1f1b", "interleaved"), `pp_virtual`, `pp_layers` and
    `pp_scatter_gather` (see lattice.pipeline).
    """
    topo, options, pipeline = _layout(mode, tp=tp, dp=dp, pp=pp, ranks_per_node=ranks_per_node,
                                      placement=placement, **options)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    world = dist.get_world_size() if dist.is_initialized() else env_world
    if world != topo.world_size:
        axes = " x ".join(f"{a.value}={s}" for a, s in topo.axes)
        raise LatticeConfigError(
            f"mode {mode!r} with {axes} needs {topo.world_size} processes but {world} were started; "
            f"launch with --nproc-per-node {topo.world_size} or change tp/dp so that their layout "
            f"has {world} ranks")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if world == 1 and not dist.is_initialized():
        if backend == "nccl":
            device = torch.device("cuda", 0)
        return ParallelContext(topology=topo, rank=0, options=options, mesh=None, device=device, seed=seed,
                               pipeline=pipeline)
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
    groups = _create_multi_axis_groups(topo, rank, device.type)
    embedding_group = None
    if pp > 2:  # the first and last stage of each tensor position (tied embeddings)
        ends = [[topo.rank_at({**topo.coords(r), MeshAxis.PP: 0}), topo.rank_at({**topo.coords(r), MeshAxis.PP: pp - 1})]
                for r in range(topo.world_size) if topo.coords(r)[MeshAxis.PP] == 0]
        embedding_group, _ = dist.new_subgroups_by_enumeration(ends, backend="nccl" if device.type == "cuda" else None)
    return ParallelContext(topology=topo, rank=rank, options=options, mesh=mesh, device=device, seed=seed,
                           multi_axis_groups=groups, pipeline=pipeline, embedding_group=embedding_group)
