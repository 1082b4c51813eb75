"""Published multi-GPU training runs priced by lattice's cost model: each configuration as its
source states it (model, sequence, global batch, TP x PP x DP or FSDP, micro-batch, schedule,
recomputation, precision) on the machine preset of its cluster, the predicted throughput per GPU
against the published one, and for each problem (model, GPUs, global batch) where the published
configuration ranks among the planner's setups of the same kind, and the planner's first choice
over all of lattice's layouts.

    python benchmarks/published_configs.py -o benchmarks/results/published_configs.json
    python benchmarks/published_configs.py --no-search          # the pricing alone (seconds)

Throughput per GPU: tokens/s, or for sources that publish model FLOP/s, their own count
(Narayanan et al.: 96 B s l h² (1 + s/(6h) + V/(16 l h)) per step, recomputation included) over
the predicted step. The error is (predicted - published) / published.

What the cost model cannot express is priced by its nearest and named in the row's `as_priced`:
FSDP (torchtitan) as lattice's ZeRO-3 over the same ranks (each block's weights gathered for its
forward and again for its backward, the next block's prefetched, the gradients reduce-scattered
as backward completes them), torchtitan's selective recomputation ("op": every other matrix
product's output and attention's kept) as lattice's (every product's output and attention's kept,
`--selective-checkpointing`), fp16 as bf16; Megatron-LM's runs
with the gradients reduced after backward ("reductions after backward"), as it did then.
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
from lattice.cost.machines import MACHINES  # noqa: E402
from lattice.cost.model import model_config  # noqa: E402
from lattice.modes.layout import Layout  # noqa: E402
from lattice.parallel.context import LatticeConfigError  # noqa: E402
from lattice.planner.pricing import Choice, price  # noqa: E402
from lattice.planner.search import USABLE_MEMORY, search, uneven_split  # noqa: E402

NARAYANAN = "Narayanan et al., SC21, Table 1 (Selene: DGX A100 80GB, 8 x HDR 200 Gb/s per node)"
TITAN_A100 = "torchtitan docs/performance.md, Llama 3 on 64 A100 80GB, FSDP2"
TITAN_H100 = "torchtitan docs/performance.md, Table 1: Llama 3.1 8B on 8 H100 (96 GB HBM2e, 500 W), FSDP2"
MEGATRON19 = "Shoeybi et al., Megatron-LM (2019): 8.3B on 512 V100 (DGX-2H), 15.1 PFLOP/s sustained"
#: the systems that reduced the gradients over dp after backward rather than beside it: Megatron-LM
#: until --overlap-grad-reduce (September 2023: NVIDIA/Megatron-LM issues #391 and #456), whose
#: ParallelTransformer also took only pipelines of equal stages (num_layers divisible by pp)
MEGATRON = (NARAYANAN, MEGATRON19)


def _gpt(h, heads, layers, seq=2048, vocab=51200):
    return ("gpt2", None, dict(d_model=h, n_heads=heads, n_layers=layers, seq_len=seq, vocab_size=vocab))


#: (source, name, (arch, preset, sizes), machine, gpus, tp, pp, global batch, micro-batch, recompute (True:
#:  whole blocks, "selective", False: none), fsdp, published value, unit)
PUBLISHED = [
    (NARAYANAN, "GPT 1.7B", _gpt(2304, 24, 24), "a100-node", 32, 1, 1, 512, 1, True, False, 137, "TFLOP/s"),
    (NARAYANAN, "GPT 3.6B", _gpt(3072, 32, 30), "a100-node", 64, 2, 1, 512, 1, True, False, 138, "TFLOP/s"),
    (NARAYANAN, "GPT 7.5B", _gpt(4096, 32, 36), "a100-node", 128, 4, 1, 512, 1, True, False, 142, "TFLOP/s"),
    (NARAYANAN, "GPT 18.4B", _gpt(6144, 48, 40), "a100-node", 256, 8, 1, 1024, 1, True, False, 135, "TFLOP/s"),
    (NARAYANAN, "GPT 39.1B", _gpt(8192, 64, 48), "a100-node", 512, 8, 2, 1536, 1, True, False, 138, "TFLOP/s"),
    (NARAYANAN, "GPT 76.1B", _gpt(10240, 80, 60), "a100-node", 1024, 8, 4, 1792, 1, True, False, 140, "TFLOP/s"),
    (NARAYANAN, "GPT 145.6B", _gpt(12288, 96, 80), "a100-node", 1536, 8, 8, 2304, 1, True, False, 148, "TFLOP/s"),
    (NARAYANAN, "GPT 310.1B", _gpt(16384, 128, 96), "a100-node", 1920, 8, 16, 2160, 1, True, False, 155, "TFLOP/s"),
    (NARAYANAN, "GPT 529.6B", _gpt(20480, 128, 105), "a100-node", 2520, 8, 35, 2520, 1, True, False, 163, "TFLOP/s"),
    (NARAYANAN, "GPT 1008B", _gpt(25600, 160, 128), "a100-node", 3072, 8, 64, 3072, 1, True, False, 163, "TFLOP/s"),
    (TITAN_A100, "Llama 3 8B, selective AC", ("llama", "llama3-8b", {}), "a100-node", 64, 1, 1, 64, 1, "selective", True,
     2973, "tokens/s"),
    (TITAN_A100, "Llama 3 70B, full AC", ("llama", "llama3-70b", {}), "a100-node", 64, 1, 1, 64, 1, True, True,
     331, "tokens/s"),
    (TITAN_H100, "Llama 3.1 8B, selective AC", ("llama", "llama3-8b", {}), "h100-node", 8, 1, 1, 16, 2, "selective", True,
     5762, "tokens/s"),
    (MEGATRON19, "GPT-2 8.3B", _gpt(3072, 32, 72, seq=1024, vocab=51200), "dgx2h-v100", 512, 8, 1, 512, 8, True,
     False, 15.1e3 / 512, "TFLOP/s"),
]


def cfg_of(row):
    arch, preset, sizes = row[2]
    return model_config(arch, preset, **sizes)


def narayanan_flops(cfg, batch: int) -> float:
    """Model FLOPs of one step with recomputation, as Narayanan et al. count them."""
    B, s, l, h, V = batch, cfg.seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def published_choice(row) -> Choice:
    _, _, _, _, gpus, tp, pp, batch, micro, recompute, fsdp, _, _ = row
    dp = gpus // (tp * pp)
    replica = batch // dp
    pipe = dict(microbatches=replica // micro, pp_schedule="1f1b", pp_layers=uneven_split(cfg_of(row), pp)) if pp > 1 else {}
    lay = Layout("1d" if tp > 1 else "serial", tp=tp, pp=pp, dp=dp, ranks_per_node=MACHINES[row[3]].ranks_per_node,
                 options={"sequence_parallel": False} if tp > 1 and not fsdp else {}, **pipe)
    return Choice(lay, zero=3 if fsdp else 0, precision="bf16", checkpointing=recompute is True,
                  selective=recompute == "selective",
                  overlap_grad_reduce=row[0] not in MEGATRON)


def per_gpu(cfg, row, step_s: float) -> float:
    gpus, batch, unit = row[4], row[7], row[12]
    if unit == "TFLOP/s":
        return narayanan_flops(cfg, batch) / step_s / gpus / 1e12
    return batch * cfg.seq_len / step_s / gpus


def _layout_ranking(ranked) -> list:
    """[((tp, pp, dp), its fastest setup)] of the setups without context parallelism, fastest first:
    the layouts of the published kind, each at its best ZeRO stage, checkpointing, micro-batches and
    schedule."""
    best = {}
    for q in ranked:
        lay = q.choice.layout
        key = (lay.tp, lay.pp, lay.dp)
        if lay.cp == 1 and (key not in best or q.step_s < best[key].step_s):
            best[key] = q
    return sorted(best.items(), key=lambda item: item[1].step_s)


def _system_ranking(cfg, row, machine) -> list:
    """[((tp, pp, dp), its price)] of every split of the row's GPUs its own system offers, with the
    row's other settings as published (its micro-batch, 1F1B, recomputation, FSDP or not): tp
    within a node, pp dividing the blocks' count (Megatron-LM's) or not (torchtitan's: uneven
    stages as lattice splits them), each that fits 90% of the device's memory, fastest first."""
    _, _, _, _, gpus, _, _, batch, micro, _, fsdp, _, _ = row
    out = []
    for tp in [t for t in (1, 2, 4, 8) if gpus % t == 0 and t <= machine.ranks_per_node]:
        for pp in [q for q in range(1, cfg.n_layers + 1) if (gpus // tp) % q == 0
                   and (row[0] not in MEGATRON or cfg.n_layers % q == 0)]:
            dp = gpus // (tp * pp)
            if batch % dp or (batch // dp) % micro or (pp > 1 and (batch // dp) // micro < pp):
                continue
            variant = (row[:5] + (tp, pp) + row[7:])
            try:
                priced = price(cfg, published_choice(variant), batch=batch, machine=machine)
            except LatticeConfigError:
                continue
            if priced.memory["total"] <= USABLE_MEMORY * machine.memory_gib * 2 ** 30:
                out.append(((tp, pp, dp), priced))
    return sorted(out, key=lambda item: item[1].step_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-search", action="store_true", help="price the published configurations only")
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    rows = []
    for row in PUBLISHED:
        source, name, _, machine_name, gpus, tp, pp, batch = row[:8]
        cfg = cfg_of(row)
        machine = MACHINES[machine_name]
        choice = published_choice(row)
        priced = price(cfg, choice, batch=batch, machine=machine)
        predicted = per_gpu(cfg, row, priced.step_s)
        out = {"source": source, "name": name, "machine": machine_name, "gpus": gpus, "batch": batch,
               "published": row[11], "unit": row[12], "as_priced": choice.describe(), "step_s": priced.step_s,
               "predicted": predicted, "error": (predicted - row[11]) / row[11],
               "terms_s": priced.terms, "memory_gib": priced.memory["total"] / 2 ** 30}
        if not args.no_search:
            start = time.perf_counter()
            kind = ["1d", "serial"]
            same_kind = search(cfg, gpus=gpus, machine=machine, batch=batch, modes=kind, precisions=("bf16",),
                               placements=("natural",))
            layouts = _layout_ranking(same_kind.ranked)
            mine = (tp, pp, gpus // (tp * pp))
            out["layout_rank"] = 1 + [key for key, _ in layouts].index(mine) if mine in dict(layouts) else None
            out["layouts"] = len(layouts)
            out["same_kind_first"] = layouts[0][1].choice.describe() if layouts else None
            system = _system_ranking(cfg, row, machine)
            out["system_rank"] = 1 + [key for key, _ in system].index(mine) if mine in dict(system) else None
            out["system_layouts"] = len(system)
            out["system_first"] = system[0][1].choice.describe() if system else None
            published_step = priced.step_s
            whole = search(cfg, gpus=gpus, machine=machine, batch=batch, precisions=("bf16",),
                           placements=("natural",))
            first = whole.ranked[0] if whole.ranked else None
            out["planner_first"] = first.choice.describe() if first else None
            out["planner_first_gain"] = published_step / first.step_s - 1 if first else None
            out["search_s"] = time.perf_counter() - start
        rows.append(out)
        rank = (f"  its system's {out['system_rank']} of {out['system_layouts']}; lattice 1d's {out['layout_rank']} of "
                f"{out['layouts']}; planner's first "
                f"{out['planner_first']} ({out['planner_first_gain']:+.0%})" if "layouts" in out else "")
        print(f"{name:<28} {gpus:>5} GPUs  {choice.describe():<52} published {row[11]:>8.1f} {row[12]:<9} "
              f"predicted {predicted:>8.1f}  error {out['error']:+6.1%}{rank}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    ranked = [r for r in rows if r.get("layout_rank")]
    if ranked:
        print(f"the published layout in the planner's top 5 of its kind in {sum(r['layout_rank'] <= 5 for r in ranked)} "
              f"of {len(rows)} problems; among its own system's splits (its settings as published) in "
              f"{sum((r['system_rank'] or 99) <= 5 for r in rows)}")
    print(f"median |error| {statistics.median(errors):.1%} over {len(rows)} configurations from "
          f"{len({r['source'] for r in rows})} sources")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"provenance": provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except LatticeConfigError as e:
        raise SystemExit(f"error: {e}")
