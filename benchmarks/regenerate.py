"""Regenerate every committed benchmark result and benchmarks/README.md from them:

    python benchmarks/regenerate.py            # ~10 minutes on 2 shared CPU cores

1. `lattice bench --nproc 2` and `--nproc 4`: every mode and the DTensor peer side by side
   (bench_p2.*, bench_p4.*);
2. `lattice bench --sweep all`: strong and weak scaling over p = 1, 2, 4, 8, 9 with a calibration
   before every mode, and the cost model's projection to 16, 36 and 64 GPUs (sweeps.*);
3. Optimus Table 1 from `lattice plan --table1` and SUPER's Eq. 4-7 (tables.json);
4. benchmarks/README.md, rendered from those files (the project README links to it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import lattice  # noqa: E402
from lattice import bench, cost  # noqa: E402
from lattice.bench import report  # noqa: E402
from lattice.bench.provenance import provenance  # noqa: E402

RESULTS = HERE / "results"
SINGLE = ["--model", "small", "--vocab-size", "2048", "--batch", "8", "--steps", "10", "--warmup", "2", "--calibrate"]


def _bench(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    status = bench.run_bench(parser.parse_args(argv + ["--out", str(RESULTS)]))
    if status:
        raise SystemExit(f"lattice bench {' '.join(argv)} failed ({status})")


def paper_tables() -> dict:
    table1 = {f"p={p}": {"paper": cost.optimus_table1(24, 512, 3072, p), "model": cost.layer_table(24, 512, 3072, p)}
              for p in (4, 16, 64)}
    super_rows = []
    for n, g, n_node in ((8, 2, 4), (16, 4, 4), (16, 8, 4), (64, 16, 4)):
        for aware in (False, True):
            topo = lattice.context("subgraph", tp=n, subgrids=g, ranks_per_node=n_node,
                                placement="topology" if aware else "natural").topology
            super_rows.append({"n": n, "g": g, "n_node": n_node, "placement": "topology" if aware else "natural",
                               "equations": cost.super_messages(n, g, n_node, aware),
                               "counted": cost.count_messages(topo, (lattice.MeshAxis.SUBGRID,))})
    return {"optimus_table1": table1, "super_messages": super_rows}


# ----------------------------------------------------------------------------- README rendering


def _ms(x):
    return f"{x * 1e3:.0f}"


def _mb(x):
    return f"{x / 2 ** 20:.2f}"


def single_table(result: dict) -> list[str]:
    rows = result["rows"]
    serial = next((r for r in rows if r["mode"] == "serial"), None)
    p = result["p"]
    out = ["| mode | forward ms | backward ms | step ms | comm MiB measured | cost model | ratio | "
           "activations MiB/rank | × p / serial | parameters MiB/rank |", "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | {r['error']} |" + " |" * 8)
            continue
        rel = "" if serial is None or r["mode"] == "serial" else f"{r['act_bytes'] * p / serial['act_bytes']:.3f}"
        out.append(f"| {r['label']} | {_ms(r['forward_s'])} | {_ms(r['backward_s'])} | {_ms(r['step_s'])} | "
                   f"{_mb(r['comm_bytes'])} | {_mb(r['comm_bytes_analytic'])} | {r['comm_ratio']:.3f} | "
                   f"{_mb(r['act_bytes'])} | {rel} | {_mb(r['param_bytes'])} |")
    for label, why in result.get("skipped", []):
        out.append(f"| {label} | skipped: {why} |" + " |" * 8)
    return out


def sweep_table(results: list[dict]) -> list[str]:
    """One row per (p, mode). Activations are compared with serial on the same model: measured
    where serial ran (p = 1 of the strong sweep), else the cost model's serial figure (which the
    tests hold to the measured one within 2%)."""
    from lattice import GPTConfig

    out = ["| p | h | heads | batch | mode | step ms | predicted ms | error | comm ratio | activations × p / serial |",
           "|" + "---|" * 10]
    measured_serial = {json.dumps(res["cfg"], sort_keys=True) + str(res["batch"]): r["act_bytes"]
                       for res in results for r in res["rows"] if r["mode"] == "serial"}
    for res in results:
        cfg = res["cfg"]
        key = json.dumps(cfg, sort_keys=True) + str(res["batch"])
        serial = measured_serial.get(key) or cost.estimate(GPTConfig(**cfg), "serial", batch=res["batch"]).memory["activations"]
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {res['p']} | {cfg['d_model']} | {cfg['n_heads']} | {res['batch']} | {r['label']} | "
                           f"{r['error']} | | | | |")
                continue
            pred = r.get("step_pred_s")
            err = "" if pred is None or r["mode"] == "dtensor" else f"{(pred - r['step_s']) / r['step_s']:+.0%}"
            rel = "" if r["mode"] == "serial" else f"{r['act_bytes'] * res['p'] / serial:.3f}"
            out.append(f"| {res['p']} | {cfg['d_model']} | {cfg['n_heads']} | {res['batch']} | {r['label']} | "
                       f"{_ms(r['step_s'])} | {'' if pred is None else _ms(pred)} | {err} | {r['comm_ratio']:.3f} | "
                       f"{rel} |")
    return out


def projection_table(proj: dict, family: str) -> list[str]:
    out = ["| GPUs | h | b | 1d | 2d | 3d |", "|---|---|---|---|---|---|"]
    for p, r in proj[family].items():
        cells = " | ".join(f"{r[m]['step_per_seq_s'] * 1e3:.1f}" if m in r else "—" for m in ("1d", "2d", "3d"))
        out.append(f"| {p} | {r['h']} | {r['b']} | {cells} |")
    return out


def table1_rows(tables: dict) -> list[str]:
    out = ["| p | mode | source | forward words | backward words | backward as run | forward mults | backward mults |",
           "|" + "---|" * 8]
    for p, both in tables["optimus_table1"].items():
        for mode in ("1d", "2d", "3d", "subgraph"):
            for src in ("paper", "model"):
                r = both[src].get(mode)
                if r:
                    run = f"{r['backward_as_run']:,.0f}" if "backward_as_run" in r else ""
                    out.append(f"| {p[2:]} | {mode} | {src} | {r['forward']:,.0f} | {r['backward']:,.0f} | {run} | "
                               f"{r['forward_mults']:,.0f} | {r['backward_mults']:,.0f} |")
    return out


def render(single: dict, sweeps: dict, tables: dict) -> str:
    m = sweeps["machine"]
    errors = report.prediction_errors(sweeps["strong"] + sweeps["weak"])
    lines = [
        "## Benchmarks: lattice against the papers' analysis and against PyTorch's tensor parallelism", "",
        "Regenerate everything below (results, plots and this section) with one command, about 10 minutes "
        "on 2 CPU cores:", "", "```bash", "python benchmarks/regenerate.py", "```", "",
        f"Measured on {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, {m['backend']}, "
        f"{m['date']}; one rank = one process with one thread (the CPU stand-in for a device), so p > 2 shares "
        f"the cores; the machine was shared with other jobs, so times are noisy. Every mode is built first and "
        f"their timed steps are interleaved round-robin, so load changes fall on all of them alike. Times are "
        f"the median over steps of the slowest rank; a step is forward, backward and the AdamW update "
        f"(foreach, as torchtitan builds it). Communication is what CommMeter "
        f"counted in one step (for the DTensor peer, its collectives counted by a dispatch mode in the same "
        f"units) next to `lattice.cost`'s figure. Activations are the bytes autograd saves for backward, "
        f"parameters the largest share on any rank. Files: `benchmarks/results/`.", ""]
    for key in ("p2", "p4"):
        res = single[key]["result"]
        cfg = res["cfg"]
        lines += [f"### Every mode side by side, p = {res['p']}", "",
                  f"`lattice bench --nproc {res['p']} {' '.join(SINGLE)}` — GPT-2 shape, d_model {cfg['d_model']}, "
                  f"{cfg['n_heads']} heads, {cfg['n_layers']} layers, vocabulary {cfg['vocab_size']}, batch "
                  f"{res['batch']} x {cfg['seq_len']}:", ""]
        lines += single_table(res)
        ratio = report.peer_ratio(res)
        if ratio is not None:
            by = {r["label"]: r for r in res["rows"]}
            fb = (by["1d"]["forward_s"] + by["1d"]["backward_s"]) / (by["dtensor"]["forward_s"] + by["dtensor"]["backward_s"])
            lines += ["", f"lattice `1d` step time / DTensor peer step time = **{ratio:.3f}** "
                          f"(forward + backward alone: {fb:.3f})."]
        lines += ["", f"![p = {res['p']}](results/bench_{key}.png)", ""]
    lines += ["### Strong and weak scaling on this machine", "",
              "Scaled down from Optimus Tables 2-3 and the 3D paper's Tables 1-2: strong scaling keeps d_model "
              "192, 24 heads, batch 12 x 64, 2 layers; weak scaling grows d_model with √p (96, 144, 192, 288, "
              "288) and the batch (4, 6, 8, 12, 12). Modes whose layout does not fit p are left out (2D needs a "
              "square, 3D a cube, 1D and the peer n_heads % p = 0). Predicted = `lattice.cost` with α, β, F and the "
              "other rates fitted by micro-benchmarks on this machine just before and after the timed steps "
              "(geometric mean). Activations × p / "
              "serial compare with serial on the same model: measured at p = 1 in the strong sweep; the weak sweep "
              "changes the model with p, so there it is the cost model's serial figure (which tests/test_cost.py "
              "holds to the measured one within 2%).", "",
              "Strong scaling:", ""] + sweep_table(sweeps["strong"]) + ["", "Weak scaling:", ""] + sweep_table(sweeps["weak"])
    if errors:
        lines += ["", f"Calibrated model vs measurement: median |error| of the predicted step time = "
                      f"**{statistics.median(abs(e) for e in errors):.0%}** over {len(errors)} lattice runs "
                      f"(the DTensor peer is not lattice's model and is left out)."]
    lines += ["", "![sweeps](results/sweeps.png)", "",
              "### Projection to the papers' scale", "",
              f"The cost model on {sweeps['projection']['machine']}: model step time per sequence (ms) of the "
              "Transformer stem (the papers measure the stem alone), s = 512, 24 layers, fp16, activation "
              "checkpointing, bunched 2D placement. Strong scaling as Optimus Table 3 (b = 24, h = 3072):", ""]
    lines += projection_table(sweeps["projection"], "strong")
    lines += ["", "Weak scaling as Optimus Table 2 (h = 1024·√p, b = 24·√p):", ""]
    lines += projection_table(sweeps["projection"], "weak")
    lines += [""] + [f"- {c}" for c in sweeps["crossovers"]]
    lines += ["", "### The papers' tables from the cost model", "",
              "Optimus Table 1 (one layer, activation checkpointing, b = 24, s = 512, h = 3072; words moved per rank "
              "with ring all-reduce and tree broadcast/reduce, and multiplications per rank) beside the model's "
              "figures, and the 3D and sub-graph rows the model derives the same way. \"backward as run\" is "
              "lattice's own count: torch's checkpoint stops recomputing after the last saved tensor, so 1D "
              "skips the MLP's all-reduce there. The sub-graph row counts its branch entry and exit; its "
              "gradient all-reduces (data parallel, once per step) are outside the layer. Regenerate one with `lattice plan --table1 --tp 64 --batch 24 "
              "--seq-len 512 --d-model 3072 --n-heads 64`.", ""] + table1_rows(tables)
    lines += ["", "SUPER Eq. 4-7 (messages of one segmented collective, intra-node / inter-node) against counting on "
                  "the layouts (natural placement; topology-aware round-robin placement):", "",
              "| n | g | n_node | placement | Eq. 4-7 | counted |", "|---|---|---|---|---|---|"]
    for r in tables["super_messages"]:
        lines.append(f"| {r['n']} | {r['g']} | {r['n_node']} | {r['placement']} | {tuple(r['equations'])} | "
                     f"{tuple(r['counted'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--render-only", action="store_true", help="only rewrite README.md from the results")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        for p in (2, 4):
            _bench(["--nproc", str(p)] + SINGLE)
        _bench(["--sweep", "all", "--steps", "6", "--warmup", "1"])
        (RESULTS / "tables.json").write_text(json.dumps({"provenance": provenance(),
                                                         **paper_tables()}, indent=1))
    single = {f"p{p}": json.loads((RESULTS / f"bench_p{p}.json").read_text()) for p in (2, 4)}
    sweeps = json.loads((RESULTS / "sweeps.json").read_text())
    tables = json.loads((RESULTS / "tables.json").read_text())
    section = render(single, sweeps, tables)
    (HERE / "README.md").write_text(section)
    print(f"wrote {HERE / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
