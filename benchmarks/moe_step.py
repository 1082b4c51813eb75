"""A mixture of experts beside the dense model of the same active parameters, per layout: step
time, the share of the step's elements the experts' all-to-alls move, and the experts' weights and
AdamW moments per rank against ep.

    python benchmarks/moe_step.py -o benchmarks/results/moe_step.json
    python benchmarks/moe_step.py --layouts "1d tp=4" "1d tp=4 ep=4" --steps 3

The MoE model is Mixtral's `small` preset (8 experts of width 256, top 2); the dense one is a
Llama of the same shape whose MLP is top_k x 256 wide, so that a token meets as many weights in
both. Each layout runs on its ranks (gloo, one thread each): one step to warm up, then `--steps`
timed steps of the Trainer's work (forward, backward, the in-replica gradient sums, AdamW; with dp
replicas each on its 1/dp of the batch, without their gradient average), their median reported; CommMeter counts one step's collectives; the cost model's all-to-all elements (balanced routing:
every rank receives as many rows as it sends) are reported beside the measured ones (their
sums over the ranks, and the busiest rank's over its price), with the routing's imbalance, the most loaded expert over the mean (of the
worst layer, the whole batch's). The experts' memory per rank is the
bytes of the rank's expert parameters and, after the step, their two AdamW moments; at ep > 1
(over a replica's ranks, the replicas, or both) against 1/ep of the same layout's ep = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lattice.bench.provenance import provenance  # noqa: E402
from lattice.bench.world import spawn  # noqa: E402

LAYOUTS = ("serial", "1d tp=4", "1d tp=4 ep=4", "1d tp=4 sequence_parallel=True ep=4", "2d tp=4", "2d tp=4 ep=2",
           "subgraph tp=4 subgrids=2", "subgraph tp=4 subgrids=2 ep=2", "serial dp=4", "serial dp=4 ep=4",
           "1d tp=2 sequence_parallel=True dp=2", "1d tp=2 sequence_parallel=True dp=2 ep=4")


def parse(text: str) -> dict:
    mode, *rest = text.split()
    out = {"mode": mode}
    for item in rest:
        key, value = item.split("=")
        out[key] = {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)
    return out


def _measure(layout: dict, arch: str, steps: int, batch: int) -> dict:
    import torch
    import torch.distributed as dist

    import lattice
    from lattice.models.llama import LlamaConfig
    from lattice.models.mixtral import MixtralConfig

    ctx = lattice.init(**layout)
    moe = MixtralConfig.preset("small", vocab_size=2048)
    cfg = moe if arch == "moe" else LlamaConfig.preset("small", vocab_size=2048,
                                                      intermediate_size=moe.top_k * moe.intermediate_size)
    model = lattice.build_model(cfg, ctx)
    opt = torch.optim.AdamW([{"params": list(model.parameters())}], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    rows = slice(ctx.coord(lattice.MeshAxis.DP) * batch // ctx.dp, (ctx.coord(lattice.MeshAxis.DP) + 1) * batch // ctx.dp)
    tokens, targets = tokens[rows], targets[rows]  # this replica's share of the batch

    def step():
        model.forward_backward(tokens, targets)
        opt.step()
        opt.zero_grad(set_to_none=True)

    with lattice.CommMeter() as meter:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    moments = sum(opt.state[p][k].numel() * opt.state[p][k].element_size() for p in experts
                  for k in ("exp_avg", "exp_avg_sq"))
    summary = meter.summary()
    total = sum(v["elements"] for v in summary.values())
    to_all = sum(v["elements"] for k, v in summary.items() if k[1] == "all_to_all")
    # the cost model prices balanced routing: its all-to-all elements beside the measured ones, and
    # the routing's imbalance (the most loaded expert over the mean, the worst layer) beside them
    options = {k: v for k, v in layout.items() if k != "mode"}
    modelled = lattice.cost.estimate(cfg, layout["mode"], batch=len(tokens), seq=cfg.seq_len, rank=ctx.rank,
                                     **options).summary()
    loads = getattr(model, "step_metrics", dict)()
    imbalance = max((loads[k] / loads[k.replace("_max", "_mean")] for k in loads if k.endswith("_load_max")),
                    default=1.0)
    return {"step_s": statistics.median(slowest.tolist()), "elements": total, "all_to_all_elements": to_all,
            "all_to_all_elements_modelled": sum(v["elements"] for k, v in modelled.items() if k[1] == "all_to_all"),
            "load_max_over_mean": imbalance,
            "expert_param_bytes": sum(p.numel() * p.element_size() for p in experts), "expert_moment_bytes": moments}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    import lattice

    rows = []
    for text in args.layouts:
        layout = parse(text)
        world = lattice.context(**layout).world_size
        row = {"layout": text}
        for arch in ("dense", "moe"):
            if arch == "dense" and layout.get("ep", 1) > 1:
                continue
            ranks = spawn(world, _measure, layout, arch, args.steps, args.batch)
            row[arch] = ranks[0]
            row[arch]["expert_param_bytes_per_rank"] = [r["expert_param_bytes"] for r in ranks]
            row[arch]["all_to_all_elements_per_rank"] = [r["all_to_all_elements"] for r in ranks]
            row[arch]["all_to_all_elements_modelled_per_rank"] = [r["all_to_all_elements_modelled"] for r in ranks]
            row[arch]["expert_moment_bytes_per_rank"] = [r["expert_moment_bytes"] for r in ranks]
        rows.append(row)
        moe = row["moe"]
        dense = f"dense {row['dense']['step_s'] * 1e3:7.1f} ms, " if "dense" in row else " " * 20
        pairs = list(zip(moe["all_to_all_elements_per_rank"], moe["all_to_all_elements_modelled_per_rank"]))
        measured, balanced = sum(m for m, _ in pairs), sum(b for _, b in pairs)
        moe["all_to_all_measured_over_modelled"] = measured / balanced if balanced else None
        moe["all_to_all_busiest_rank_over_modelled"] = max(m / b for m, b in pairs) if balanced else None
        print(f"{text:<40} {dense}moe {moe['step_s'] * 1e3:7.1f} ms, all-to-all "
              f"{moe['all_to_all_elements'] / max(moe['elements'], 1):5.1%} of the elements moved"
              + (f" ({measured / balanced:.3f} of the cost model's balanced routing over the ranks, the busiest "
                 f"rank's {moe['all_to_all_busiest_rank_over_modelled']:.3f}; most loaded expert "
                 f"{moe['load_max_over_mean']:.2f}x the mean)" if balanced else "") + ", experts "
              f"{max(moe['expert_param_bytes_per_rank']) / 2 ** 20:6.2f} MiB weights + "
              f"{max(moe['expert_moment_bytes_per_rank']) / 2 ** 20:6.2f} MiB moments on the fullest rank", flush=True)
    for row in rows:  # experts' memory against 1/ep of the same layout without ep
        layout = parse(row["layout"])
        ep = layout.pop("ep", 1)
        if ep == 1:
            continue
        base = next((r for r in rows if parse(r["layout"]) == layout), None)
        if base is None:
            continue
        for kind in ("expert_param_bytes_per_rank", "expert_moment_bytes_per_rank"):
            ratio = max(row["moe"][kind]) / (max(base["moe"][kind]) / ep)
            row["moe"][kind.replace("_per_rank", "_over_1_ep")] = ratio
        print(f"{row['layout']}: experts' weights {row['moe']['expert_param_bytes_over_1_ep']:.3f} and moments "
              f"{row['moe']['expert_moment_bytes_over_1_ep']:.3f} of 1/ep of {base['layout']}'s")
    if args.output:
        Path(args.output).write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
