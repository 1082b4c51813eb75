"""The papers' crossovers from the planner (`lattice.planner.search`) on the papers' machines, each beside
the paper's number, and the planner's own choice at 64, 256 and 1024 GPUs.

    python benchmarks/planner_projection.py [-o benchmarks/results/planner_projection.json]

- Optimus §5 (Frontera RTX, 64 GPUs): 2D against 1D, the Transformer stem of Table 3's strong
  scaling (h 3072, 64 heads, 24 layers, s 512, b 24, activation checkpointing, half precision):
  the paper reports 1.48x for training.
- The 3D paper's Table 2 (Longhorn, 64 V100): 3D against 1D and 2D at h 3072 per sequence (the
  paper's b 24, 1D's 12; here b 48 for all, which lattice's 3D splits over q² = 16): 2.32x and 1.57x
  (its table's per-sequence step times: 0.550, 0.497, 0.359 s).
- Megatron-LM's Figure 9 (64 A100, GPT of 162.2B parameters: 88 layers, h 12288, 96 heads,
  s 2048): every tensor x pipeline split of 64 GPUs at batch 32 and 128; the paper's best is
  t = 8 (the GPUs of a node), p = 8.
- SUPER (Lassen): D&SP against data parallelism for T5-Large at one sequence per GPU on 4 and 8
  GPUs: 2.22x and 3.05x.
- The GPU model against an H200's measured serial bf16 steps with the optimizer's full update
  (benchmarks/results/cuda_h200_steps.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from lattice.bench.provenance import provenance
from lattice.cost.machines import MACHINES
from lattice.cost import model_config
from lattice.planner.search import Choice, uneven_split, price, search
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError

STEM = dict(d_model=3072, n_heads=64, n_layers=24, seq_len=512, vocab_size=51200)


def _pure(cfg, mode: str, tp: int, *, batch: int, machine, ckpt: bool, **options):
    """The papers' pure tensor layout: one replica of tp ranks, the fastest of the mode's option
    settings given (default options otherwise)."""
    lay = Layout(mode, tp=tp, ranks_per_node=machine.ranks_per_node, options=options)
    return price(cfg, Choice(lay, precision="bf16", checkpointing=ckpt), batch=batch, machine=machine)


def optimus(rows: list) -> None:
    machine = MACHINES["frontera-rtx"]
    cfg = model_config("gpt2", "small", **STEM)
    one = _pure(cfg, "1d", 64, batch=24, machine=machine, ckpt=True)
    two = _pure(cfg, "2d", 64, batch=24, machine=machine, ckpt=True, vectors="hosted")
    rows.append({"paper": "Optimus §5", "machine": "frontera-rtx", "gpus": 64, "comparison": "2d over 1d, training step",
                 "paper_value": 1.48, "planner_value": one.step_s / two.step_s,
                 "detail": {"1d_s": one.step_s, "2d_s": two.step_s, "1d_terms": one.terms, "2d_terms": two.terms}})


def cube(rows: list) -> None:
    machine = MACHINES["longhorn-v100"]
    cfg = model_config("gpt2", "small", **STEM)
    per_seq = {}
    for mode, batch in (("1d", 48), ("2d", 48), ("3d", 48)):  # lattice's 3d splits a batch over q² = 16
        p = _pure(cfg, mode, 64, batch=batch, machine=machine, ckpt=True)
        per_seq[mode] = p.step_s / batch
    rows.append({"paper": "3D Table 2", "machine": "longhorn-v100", "gpus": 64, "comparison": "3d over 1d, per sequence",
                 "paper_value": 2.32, "paper_table_value": 0.550 / 0.359, "planner_value": per_seq["1d"] / per_seq["3d"]})
    rows.append({"paper": "3D Table 2", "machine": "longhorn-v100", "gpus": 64, "comparison": "3d over 2d, per sequence",
                 "paper_value": 1.57, "paper_table_value": 0.497 / 0.359, "planner_value": per_seq["2d"] / per_seq["3d"]})


def megatron(rows: list) -> None:
    machine = MACHINES["a100-node"]
    cfg = model_config("gpt2", "small", d_model=12288, n_heads=96, n_layers=88, seq_len=2048, vocab_size=51200)
    for batch in (32, 128):
        splits = []
        for t in (1, 2, 4, 8, 16, 32, 64):
            pp = 64 // t
            try:
                lay = Layout("1d" if t > 1 else "serial", tp=t, pp=pp, microbatches=batch, pp_schedule="1f1b",
                             pp_layers=uneven_split(cfg, pp), ranks_per_node=8) if pp > 1 else \
                    Layout("1d", tp=t, ranks_per_node=8)
                p = price(cfg, Choice(lay, precision="bf16", checkpointing=True), batch=batch, machine=machine)
                splits.append((t, pp, p.step_s, p.memory["total"] / 2 ** 30))
            except LatticeConfigError as e:
                splits.append((t, pp, None, str(e)))
        ok = [s for s in splits if s[2] is not None and s[3] <= 0.9 * machine.memory_gib]
        best = min(ok, key=lambda s: s[2]) if ok else None
        rows.append({"paper": "Megatron-LM Fig. 9", "machine": "a100-node", "gpus": 64,
                     "comparison": f"best tensor x pipeline split, batch {batch}", "paper_value": "t=8 x p=8",
                     "planner_value": f"t={best[0]} x p={best[1]}" if best else "none fits",
                     "detail": [{"t": t, "p": pp, "step_s": s, "memory_gib": mem} for t, pp, s, mem in splits]})


def superb(rows: list) -> None:
    machine = MACHINES["lassen-v100"]
    cfg = model_config("t5", "t5-large")
    for gpus, paper in ((4, 2.22), (8, 3.05)):
        dp = price(cfg, Choice(Layout("serial", dp=gpus, ranks_per_node=4), precision="bf16"), batch=gpus,
                   machine=machine)
        best = None
        for g in (2, 4, 8):
            if g > gpus:
                continue
            try:
                lay = Layout("subgraph", tp=gpus, options={"subgrids": g}, ranks_per_node=4,
                             placement="topology" if gpus > 4 else "natural")  # SUPER's topology-aware placement
                p = price(cfg, Choice(lay, precision="bf16"), batch=gpus, machine=machine)
            except LatticeConfigError:
                continue
            best = p if best is None or p.step_s < best.step_s else best
        rows.append({"paper": "SUPER §V", "machine": "lassen-v100", "gpus": gpus,
                     "comparison": "D&SP over data parallelism, T5-Large, 1 sequence per GPU", "paper_value": paper,
                     "planner_value": dp.step_s / best.step_s if best else None,
                     "detail": {"dp_s": dp.step_s, "dsp": best.choice.describe() if best else None,
                                "dsp_s": best.step_s if best else None}})


def choices(rows: list) -> None:
    """The planner's own first choice for the stem at 64, 256 and 1024 GPUs on each paper machine
    (weak scaling of the batch: 4 sequences per GPU)."""
    cfg = model_config("gpt2", "small", **STEM)
    for name in ("frontera-rtx", "longhorn-v100", "a100-node"):
        for gpus in (64, 256, 1024):
            plan = search(cfg, gpus=gpus, machine=MACHINES[name], batch=4 * gpus)
            best = plan.ranked[0] if plan.ranked else None
            modes = {m: (plan.best_of(m).step_s / best.step_s if plan.best_of(m) else None)
                     for m in ("1d", "2d", "3d", "subgraph", "serial")} if best else {}
            rows.append({"paper": "planner's choice", "machine": name, "gpus": gpus,
                         "comparison": "first choice for the stem model, 4 sequences per GPU",
                         "planner_value": best.choice.describe() if best else "none fits",
                         "step_s": best.step_s if best else None, "best_of_each_mode_over_first": modes,
                         "priced": plan.priced, "seconds": plan.seconds})


def h200(rows: list) -> None:
    """The GPU model against what an H200 measured here (benchmarks/cuda_check.py, serial bf16
    steps with fp32 masters, each step AdamW's update of every master row as the planner prices it:
    benchmarks/results/cuda_h200_steps.json; the steps of cuda_h200.json skipped that update): an H200
    machine from the same recipe as the presets (989 TFLOP/s dense bf16, 4.8 TB/s)."""
    from pathlib import Path

    from lattice.cost.machines import gpu_machine

    machine = gpu_machine("H200", peak_half=989e12, peak_fp32=494e12, hbm=4.8e12, memory_gib=141, ranks_per_node=1,
                   intra_gbs=450, alpha_intra=5e-6, node_nic_gbs=50)
    measured = json.loads((Path(__file__).parent / "results" / "cuda_h200_steps.json").read_text())["throughput"]
    for run in measured:
        cfg = model_config(run["arch"], run["preset"], seq_len=run["seq_len"])
        p = price(cfg, Choice(Layout("serial"), precision="bf16"), batch=run["batch"], machine=machine)
        rows.append({"paper": "H200 measured", "machine": "H200 (preset recipe)", "gpus": 1,
                     "comparison": f"serial bf16 step, {run['arch']} {run['preset']} {run['batch']} x {run['seq_len']}",
                     "paper_value": run["step_ms"] / 1e3, "planner_value": p.step_s,
                     "error": (p.step_s - run["step_ms"] / 1e3) / (run["step_ms"] / 1e3)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", default=None)
    args = p.parse_args()
    rows: list = []
    for part in (optimus, cube, megatron, superb, h200, choices):
        part(rows)
    for r in rows:
        value = r["planner_value"]
        value = f"{value:.2f}x" if isinstance(value, float) else value
        paper = r.get("paper_value")
        paper = f"{paper:.2f}x" if isinstance(paper, float) else (paper or "")
        extra = ""
        if "best_of_each_mode_over_first" in r:
            extra = "; best of each mode / first: " + ", ".join(
                f"{m} {v:.2f}" for m, v in r["best_of_each_mode_over_first"].items() if v)
        if "error" in r:
            paper, value, extra = f"{r['paper_value'] * 1e3:.1f} ms", f"{r['planner_value'] * 1e3:.1f} ms", \
                f" ({r['error']:+.0%})"
        print(f"{r['paper']:<20} {r['machine']:<14} {r['gpus']:>5}  {r['comparison']}: paper {paper or '-'}, "
              f"planner {value}{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "rows": rows}, f, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


if __name__ == "__main__":
    main()
