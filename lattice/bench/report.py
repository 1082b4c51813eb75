"""The sweeps of `lattice bench` (strong and weak scaling on this machine, the cost model's
projection to the papers' scale) and its tables and plots."""

from __future__ import annotations

import itertools
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from lattice import cost as costmodel
from lattice.models.gpt2 import GPTConfig
from lattice.modes import REFERENCE_MODE, parallel_modes, peer_mode
from lattice.parallel.context import LatticeConfigError

# Scaled down from Optimus Tables 2-3 and the 3D paper's Tables 1-2 (s = 512, 24 layers there):
# strong scaling keeps the problem; weak scaling grows h with √p (parameters per rank fixed) and
# the batch with √p, and keeps 12-wide heads so that the head count grows with the model.
STRONG = dict(vocab_size=1024, seq_len=64, d_model=192, n_heads=24, n_layers=2)
STRONG_BATCH = 12
WEAK = {1: (96, 8, 4), 2: (144, 12, 6), 4: (192, 16, 8), 8: (288, 24, 12), 9: (288, 24, 12)}  # p: (h, n, B)
SIZES = (1, 2, 4, 8, 9)
PROJECTION_SIZES = (4, 8, 16, 27, 36, 64)


def weak_config(p: int) -> tuple[GPTConfig, int]:
    h, n, batch = WEAK[p]
    return GPTConfig(vocab_size=1024, seq_len=64, d_model=h, n_heads=n, n_layers=2), batch


def projection(machine: costmodel.Machine = costmodel.PAPER_CLUSTER) -> dict:
    """The cost model's step time per sequence (the 3D paper's Eq. 6) of the Transformer stem, as
    both papers measure it, at their scale: strong scaling as Optimus Table 3 (b = 24, h = 3072),
    weak as Table 2 (h = 1024·√p, b = 24·√p), s = 512, 24 layers, fp16 activations, activation
    checkpointing, every mode's topology-aware placement (bunched in 2D), 4 GPUs per node."""
    from lattice.modes import get_mode

    out = {"machine": machine.describe(), "strong": {}, "weak": {}}
    for family in ("strong", "weak"):
        for p in PROJECTION_SIZES:
            # weak: h = 1024·√p in 64-wide heads, b = 24·√p
            h, b = (3072, 24) if family == "strong" else (64 * round(16 * p ** 0.5), round(24 * p ** 0.5))
            cfg = GPTConfig(vocab_size=50304, seq_len=512, d_model=h, n_heads=h // 64, n_layers=24)
            row = {}
            for mode in parallel_modes():
                try:
                    c = costmodel.estimate(cfg, mode, batch=b, tp=p, dtype=torch.float16,
                                           activation_checkpointing=True, ranks_per_node=machine.ranks_per_node,
                                           placement="topology", **get_mode(mode).fit_options(cfg, p))
                except LatticeConfigError:
                    continue
                t = c.time(machine, stem=True)
                row[mode] = {"step_per_seq_s": t["step"] / b, "comm_s": t["forward_comm"] + t["backward_comm"],
                             "compute_s": t["forward_compute"] + t["backward_compute"]}
            out[family][p] = {"h": h, "b": b, **row}
    return out


def crossovers(proj: dict) -> list[str]:
    """Where a layout that is slower at the smallest shared size first beats another one."""
    notes = []
    for family in ("strong", "weak"):
        modes = sorted({m for r in proj[family].values() for m in r if isinstance(r[m], dict)})
        for hi, lo in itertools.permutations(modes, 2):
            both = [(p, r[hi]["step_per_seq_s"], r[lo]["step_per_seq_s"]) for p, r in proj[family].items()
                    if hi in r and lo in r]
            if not both or both[0][1] < both[0][2]:
                continue  # hi is not the slower one where they first meet
            wins = [p for p, a, b in both if a < b]
            where = f"first at p = {wins[0]}" if wins else "not within p <= 64"
            notes.append(f"{family}: {hi} faster than {lo} {where} (compared at p = {[p for p, _, _ in both]})")
    return notes


# ----------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": "gloo (CPU)"}


def _mb(x):
    return f"{x / 2 ** 20:.2f}"


def format_table(result: dict) -> str:
    rows = result["rows"]
    serial_act = next((r["act_bytes"] for r in rows if r["mode"] == REFERENCE_MODE), None)
    p = result["p"]
    w = max([14] + [len(r["label"]) + 1 for r in rows] + [len(label) + 1 for label, _ in result.get("skipped", [])])
    head = (f"{'mode':<{w}}{'fwd ms':>8}{'bwd ms':>8}{'step ms':>9}{'pred ms':>9}{'comm MB':>9}{'model MB':>9}"
            f"{'ratio':>7}{'act MB/rk':>10}{'act·p/ser':>10}{'param MB/rk':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['label']:<{w}}{r['error']}")
            continue
        rel = "" if serial_act is None else f"{r['act_bytes'] * (p if r['mode'] != REFERENCE_MODE else 1) / serial_act:.3f}"
        pred = f"{r['step_pred_s'] * 1e3:.1f}" if "step_pred_s" in r else "-"
        lines.append(f"{r['label']:<{w}}{r['forward_s'] * 1e3:8.1f}{r['backward_s'] * 1e3:8.1f}{r['step_s'] * 1e3:9.1f}"
                     f"{pred:>9}{_mb(r['comm_bytes']):>9}{_mb(r['comm_bytes_analytic']):>9}{r['comm_ratio']:7.3f}"
                     f"{_mb(r['act_bytes']):>10}{rel:>10}{_mb(r['param_bytes']):>12}")
    for label, why in result.get("skipped", []):
        lines.append(f"{label:<{w}}skipped: {why}")
    ratio = peer_ratio(result)
    if ratio is not None:
        lines.append(f"{peer_mode('dtensor')} step / dtensor step = {ratio:.3f}")
    return "\n".join(lines)


def peer_ratio(result: dict) -> float | None:
    by = {r["label"]: r for r in result["rows"] if "error" not in r}
    mine = peer_mode("dtensor")
    if mine in by and "dtensor" in by:
        return by[mine]["step_s"] / by["dtensor"]["step_s"]
    return None


def prediction_errors(results: list[dict]) -> list[float]:
    return [(r["step_pred_s"] - r["step_s"]) / r["step_s"] for res in results for r in res["rows"]
            if "step_pred_s" in r and "error" not in r and r["mode"] != "dtensor"]


def plot_single(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    x = range(len(rows))
    axes[0].bar(x, [r["forward_s"] * 1e3 for r in rows], label="forward")
    axes[0].bar(x, [r["backward_s"] * 1e3 for r in rows], bottom=[r["forward_s"] * 1e3 for r in rows], label="backward")
    axes[0].bar(x, [(r["step_s"] - r["forward_s"] - r["backward_s"]) * 1e3 for r in rows],
                bottom=[(r["forward_s"] + r["backward_s"]) * 1e3 for r in rows], label="update")
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar([i - 0.2 for i in x], [r["comm_bytes"] / 2 ** 20 for r in rows], 0.4, label="measured")
    axes[1].bar([i + 0.2 for i in x], [r["comm_bytes_analytic"] / 2 ** 20 for r in rows], 0.4, label="cost model")
    axes[1].set_ylabel("communication per rank per step (MiB)")
    axes[2].bar([i - 0.2 for i in x], [r["act_bytes"] / 2 ** 20 for r in rows], 0.4, label="saved activations")
    axes[2].bar([i + 0.2 for i in x], [r["param_bytes"] / 2 ** 20 for r in rows], 0.4, label="parameters")
    axes[2].set_ylabel("MiB per rank")
    for ax in axes:
        ax.set_xticks(list(x), labels, rotation=20)
        ax.legend()
    fig.suptitle(f"lattice bench, p = {result['p']}: {result['cfg']['d_model']}-wide, {result['cfg']['n_layers']} "
                 f"layers, batch {result['batch']}x{result['cfg']['seq_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweeps(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, family in zip(axes[:2], ("strong", "weak")):
        series: dict[str, list] = {}
        for res in report.get(family, []):
            for r in res["rows"]:
                if "error" not in r:
                    series.setdefault(r["label"], []).append((res["p"], r["step_s"] * 1e3, r.get("step_pred_s")))
        for label, pts in series.items():
            line, = ax.plot([p for p, _, _ in pts], [t for _, t, _ in pts], "o-", label=label)
            pred = [(p, t * 1e3) for p, _, t in pts if t is not None]
            if pred:
                ax.plot([p for p, _ in pred], [t for _, t in pred], "x--", color=line.get_color(), alpha=0.6)
        ax.set_xlabel("processes p")
        ax.set_ylabel("median step (ms); x-- calibrated model")
        ax.set_title(f"{family} scaling, measured on this machine")
        ax.legend()
    for ax, family in zip(axes[2:], ("strong", "weak")):
        proj = report["projection"][family]
        for mode in sorted({m for r in proj.values() for m in r if isinstance(r[m], dict)}):
            pts = [(int(p), r[mode]["step_per_seq_s"] * 1e3) for p, r in proj.items() if mode in r]
            ax.plot([p for p, _ in pts], [t for _, t in pts], "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("model step time per sequence (ms)")
        ax.set_title(f"projection, {family} scaling")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_projection(proj: dict) -> str:
    lines = [f"projection ({proj['machine']}), model step time per sequence in ms:"]
    for family in ("strong", "weak"):
        modes = sorted({m for r in proj[family].values() for m in r if isinstance(r[m], dict)})
        lines.append(f"  {family:<7}{'p':>4}{'h':>7}{'b':>6}" + "".join(f"{m:>10}" for m in modes))
        for p, r in proj[family].items():
            cells = "".join(f"{r[m]['step_per_seq_s'] * 1e3:10.2f}" if m in r else f"{'-':>10}" for m in modes)
            lines.append(f"  {'':<7}{p:>4}{r['h']:>7}{r['b']:>6}{cells}")
    return "\n".join(lines)
