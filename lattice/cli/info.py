"""`lattice info`: a layout printed from the shard specs alone (no processes, no weights): which
rank holds which slice of every parameter, the groups of every mesh axis, the pipeline stages and
SUPER's message counts.

    lattice info --mode 2d --tp 4 --dp 2
"""

from __future__ import annotations

from lattice.cli.arguments import given_sizes, layout_from_args
from lattice.models import DEFAULT_ARCH
from lattice.modes.layout import PLACEMENTS
from lattice.parallel.context import MeshAxis


def _fmt_slice(slices, shape) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" if (s.start, s.stop) != (0, n) else ":"
                           for s, n in zip(slices, shape)) + "]"


def run_info(args) -> int:
    """Print a layout from the shard specs alone: no processes, no weights (a meta model)."""
    import torch

    from lattice.cost import model_config
    from lattice.models import build_model

    ctx = layout_from_args(args).context()
    topo = ctx.topology
    arch = args.arch or DEFAULT_ARCH
    cfg = model_config(arch, args.model, vocab_size=args.vocab_size, **given_sizes(args))
    with torch.device("meta"):
        model = build_model(cfg, ctx)
    axes = " x ".join(f"{a.value}={s}" for a, s in topo.axes)
    ranks = f"{topo.world_size} rank{'s' * (topo.world_size > 1)}"
    print(f"layout: mode {args.mode}, {ranks}, mesh {axes}, options {dict(ctx.options)}")
    if ctx.layout.accumulation > 1:
        print(f"gradient accumulation: each replica's batch in {ctx.layout.accumulation} forward and backward "
              f"passes per update")
    print(f"model: {arch} {args.model or type(cfg).default_preset} {cfg.to_dict()}, {model.num_parameters():,} parameters")
    if ctx.pipeline is not None:
        _print_stages(model)
    print("ranks (mesh coordinates, node):")
    for r in range(topo.world_size):
        coords = ", ".join(f"{a.value}={c}" for a, c in topo.coords(r).items())
        print(f"  rank {r}: {coords}; node {topo.node_of(r)}")
    print("groups per mesh axis:")
    for axis in topo.axis_names:
        print(f"  {axis.value}: " + " ".join(str(g) for g in topo.all_groups(axis)))
    _print_message_counts(args, topo)
    print("parameters: full shape, spec; then each distinct slice and the ranks holding it")
    for name, spec in model.specs.items():
        held: dict[str, list[int]] = {}
        for r in range(topo.world_size):
            coords = topo.coords(r)
            key = _fmt_slice(spec.slices(coords, topo), spec.storage_shape) if spec.holds(coords) else "none"
            held.setdefault(key, []).append(r)
        pad = f" padded to {list(spec.padded_shape)}" if spec.padded_shape else ""
        print(f"  {name} {list(spec.full_shape)}{pad}: {spec.describe(topo)}")
        print("      " + "; ".join(f"{k} on ranks {v}" for k, v in held.items()))
    _print_optimizer_memory(args, cfg, model.num_parameters())
    return 0


def _print_optimizer_memory(args, cfg, total: int) -> None:
    """What each rank keeps between steps in fp32 -- weights, gradients and AdamW's moments --
    without and with the distributed optimizer (lattice.parallel.zero), and per parameter of the model."""
    import torch

    from lattice.models import build_model
    from lattice.parallel.zero import ZERO_STAGES
    from lattice.parallel.pipeline import microbatch_count
    from lattice.parallel.zero_layout import memory_per_rank, parts_freed, zero_shards

    layout = layout_from_args(args)
    topo = layout.topology
    print(f"memory per rank between steps, fp32 (weights + gradients + AdamW moments, MiB; bytes per parameter of "
          f"the model times the ranks of one replica):")
    print("  rank  " + "".join(f"{'--zero ' + str(z):>24}" for z in ZERO_STAGES))
    gathered = 0
    for r in range(topo.world_size):
        ctx = layout.context(r)
        with torch.device("meta"):
            model = build_model(cfg, ctx)
        m = microbatch_count(ctx)
        cells = []
        for zero in ZERO_STAGES:
            held = memory_per_rank(model, *zero_shards(ctx), zero, 4, parts_freed=parts_freed(model, m, True))
            gathered = max(gathered, held.pop("gathered", 0))
            b = sum(held.values())
            cells.append(f"{b / 2 ** 20:.2f} ({b * topo.replica_size / total:.2f} B/param)")
        print(f"  {r:<6}" + "".join(f"{c:>24}" for c in cells))
    print(f"  --zero 3 gathers during a step, at most (two blocks, or a part outside them with its tied table; "
          f"under micro-batches every part outside them and two blocks): "
          f"{gathered / 2 ** 20:.2f} MiB")


def _print_stages(model) -> None:
    """Which (virtual) stage holds which of the model's parts, and on which ranks."""
    from lattice.parallel.context import MeshAxis

    ctx, parts = model.ctx, model.parts_
    pcfg, topo = ctx.pipeline, ctx.topology
    chunks = pcfg.chunks(len(model.pipeline_blocks()))
    encoder = len(getattr(model, parts.blocks))  # an encoder-decoder's decoder blocks follow its encoder's
    virtual = f", {pcfg.v} virtual stages per rank" if pcfg.v > 1 else ""
    print(f"pipeline: {pcfg.stages} stages, schedule {pcfg.schedule}, {pcfg.m} micro-batches{virtual}; bubble "
          f"(p-1)/(v m) = {pcfg.bubble():.3f}")

    def named(ids: range) -> list[str]:
        runs = [(parts.blocks, [i for i in ids if i < encoder], 0),
                (parts.decoder, [i for i in ids if i >= encoder], encoder)]
        return [f"{name} {held[0] - base}-{held[-1] - base}" for name, held, base in runs if held]

    for c, blocks in enumerate(chunks):
        stage = c % pcfg.stages
        ranks = [r for r in range(topo.world_size) if topo.coords(r)[MeshAxis.PP] == stage]
        held = (list(parts.first) if c == 0 else []) + named(blocks)
        held += list(parts.middle) if encoder - 1 in blocks else []
        held += list(parts.last) + ["loss"] if c == len(chunks) - 1 else []
        label = f"stage {stage}" + (f" (chunk {c})" if pcfg.v > 1 else "")
        print(f"  {label}: {', '.join(held)}; ranks {ranks}")


def _print_message_counts(args, topo) -> None:
    """SUPER Eq. 3 counted on the layout: one collective over each mesh axis, every rank one
    message to each member of its group, split into intra- and inter-node messages, for this
    placement and the other one."""
    from lattice.cost import count_messages

    layouts = {placement: layout_from_args(args, placement=placement).topology
               for placement in (PLACEMENTS if topo.pp_size == topo.cp_size == 1 else PLACEMENTS[:1])}
    print(f"messages of one collective over each axis, {topo.ranks_per_node} rank{'s' * (topo.ranks_per_node > 1)} per node "
          f"(intra-node / inter-node; SUPER Eq. 3):")
    for axis in topo.model_axes:
        counts = "; ".join(f"{placement} placement {'%d / %d' % count_messages(t, (axis,))}"
                           for placement, t in layouts.items())
        print(f"  {axis.value}: {counts}")
