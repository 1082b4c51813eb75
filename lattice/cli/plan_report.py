"""What `lattice plan` prints: the analytic model's figures for a layout, a pipeline split, every
tp x pp split of N ranks, the planner's ranking, or Optimus Table 1, as text (the command itself
is lattice.cli.plan)."""

from __future__ import annotations

from lattice.cost.machine import Machine, message_steps, wire_factor
from lattice.cost.model import Cost
from lattice.cost.pipeline import in_flight
from lattice.cost.tables import layer_table, optimus_table1
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.zero import ZERO_STAGES
from lattice.planner.pricing import TERMS
from lattice.planner.projection import pipeline_projection
from lattice.planner.search import divisors


def format_cost(c: Cost, machine: Machine) -> str:
    axes = " x ".join(f"{a.value}={n}" for a, n in c.topology.axes)
    rows = []
    for (phase, op, n), row in sorted(c.summary().items()):
        sel = [t for t in c.terms if t.phase == phase and t.op == op and c.term_ranks(t) == n]
        wire = sum(t.elements * wire_factor(op, n) for t in sel)
        msgs = sum(t.calls * message_steps(op, n) for t in sel)
        rows.append((phase, op, f"{n}", f"{row['calls']:.0f}", f"{row['elements']:,.0f}", f"{row['bytes'] / 2 ** 20:.3f}",
                     f"{wire:,.0f}", f"{msgs:.0f}"))
    total = ("total", "", "", f"{c.calls():.0f}", f"{c.elements():,.0f}", f"{c.bytes() / 2 ** 20:.3f}", f"{c.wire():,.0f}",
             f"{c.messages():.0f}")
    # the numeric columns widen for a model whose counts outgrow them (a published size)
    widths = [max(9, 1 + max(len(r[0]) for r in rows + [total])), 15] + [max(w, 1 + max(len(r[k]) for r in rows + [total])) for k, w in
                        zip(range(2, 8), (6, 8, 14, 10, 14, 10))]
    header = ("phase", "collective", "group", "calls", "elements", "MiB", "wire words", "messages")
    target = f" -> {c.target_seq} target tokens" if hasattr(c.cfg, "target_len") else ""  # an encoder-decoder's
    lines = [f"{c.mode} on {axes}, {c.cfg}", f"batch {c.batch} x {c.seq}{target} per replica, {c.itemsize}-byte values"
             f"{', ' + c.checkpointing + ' activation checkpointing' if c.checkpointing else ''}; per rank:", "",
             "  " + "".join(f"{h:<{w}}" if k < 2 else f"{h:>{w}}" for k, (h, w) in enumerate(zip(header, widths)))]
    for r in rows:
        lines.append("  " + "".join(f"{v:<{w}}" if k < 2 else f"{v:>{w}}" for k, (v, w) in enumerate(zip(r, widths))))
    lead = sum(widths[:3])
    lines.append("  " + f"{'total':<{lead}}" + "".join(f"{v:>{w}}" for v, w in zip(total[3:], widths[3:])))
    lines += ["", f"  compute: forward {c.flops['forward'] / 1e9:.3f} GFLOP, backward {c.flops['backward'] / 1e9:.3f} "
                  f"GFLOP (matrix products); elementwise {c.elementwise['forward'] / 1e6:.2f} + "
                  f"{c.elementwise['backward'] / 1e6:.2f} M elements",
              "  memory: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MiB" for k, v in c.memory.items()),
              "", f"  time on {machine.at(c.topology.world_size).describe()}:"]  # the rates its ranks see
    t = c.time(machine)
    lines.append("  " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()))
    return "\n".join(lines)


def format_pipeline(cfg, layout: Layout, *, batch: int, machine: Machine, setup: dict | None = None) -> str:
    r = pipeline_projection(cfg, layout, batch=batch, machine=machine, setup=setup)
    mode, tp, pp = layout.mode, layout.tp, layout.pp
    pcfg = r["pcfg"]
    virtual = f" (v={r['v']})" if r["v"] > 1 else ""
    lines = [f"{mode} tp={tp} x pp={pp}, {cfg}", f"batch {batch} per replica in {r['m']} micro-batches of "
             f"{batch // r['m']}, schedule {r['schedule']}{virtual}; bubble "
             f"(p-1)/(v m) = {r['bubble']:.3f}", "",
             f"  {'stage':<7}{'blocks':<22}{'p2p fwd elements':>18}{'p2p bwd elements':>18}{'MiB':>9}"
             f"{'in flight':>11}{'activations MiB':>17}"]
    n = len(r["chunks"])
    for s in range(pp):
        mine = [c for c in range(s, n, pp)]
        blocks = ", ".join(f"{r['chunks'][c].start}-{r['chunks'][c].stop - 1}" for c in mine)
        e = r["stage_p2p"][s]
        k = in_flight(pcfg, s)
        mib = (e["forward"] + e["backward"]) * r["itemsize"] / 2 ** 20
        lines.append(f"  {s:<7}{blocks:<22}{e['forward']:>18,.0f}{e['backward']:>18,.0f}{mib:>9.3f}{k:>11}"
                     f"{k * r['per_microbatch_activations'] / 2 ** 20:>17.2f}")
    lines += ["", f"  time on {machine.at(layout.world_size).describe()}:",
              f"  micro-batch slot {r['slot_s'] * 1e3:.3f} ms + stage hop {r['p2p_s'] * 1e3:.3f} ms, "
              f"step {r['step_s'] * 1e3:.3f} ms"]
    return "\n".join(lines)


def format_splits(cfg, ranks: int, *, batch: int, machine: Machine, layout_of, setup: dict | None = None) -> str:
    """Megatron-LM's Fig. 9 as a projection: every tp x pp = ranks the layout and model allow;
    `layout_of(tp, pp)` gives the Layout of each split, `setup` Choice's zero, precision and
    checkpointing."""
    rows = []
    mode = None
    for pp in [d for d in range(1, ranks + 1) if ranks % d == 0]:
        try:
            layout = layout_of(ranks // pp, pp)
            mode = layout.mode
            rows.append(pipeline_projection(cfg, layout, batch=batch, machine=machine, setup=setup))
        except LatticeConfigError as e:
            rows.append({"tp": ranks // pp, "pp": pp, "error": str(e)})
    lines = [f"{mode}: tp x pp = {ranks} ranks per replica, {cfg}, batch {batch}, on {machine.name}",
             f"  {'tp':>4}{'pp':>4}{'m':>4}{'bubble':>8}{'step ms':>14}"]
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['tp']:>4}{r['pp']:>4}  does not fit: {r['error']}")  # whole: it names the fix
        else:
            lines.append(f"  {r['tp']:>4}{r['pp']:>4}{r['m']:>4}{r['bubble']:>8.3f}{r['step_s'] * 1e3:>14,.3f}")
    if ok:
        best = min(ok, key=lambda r: r["step_s"])
        lines.append(f"  fastest: tp={best['tp']} x pp={best['pp']}")
    return "\n".join(lines)


def format_table1(b: int, s: int, h: int, p: int) -> str:
    """Optimus Table 1 (as printed) beside this model's figures, and the 3D / sub-graph rows."""
    paper, ours = optimus_table1(b, s, h, p), layer_table(b, s, h, p)
    lines = [f"one layer, b={b} s={s} h={h} p={p}, activation checkpointing: words moved per rank "
             f"(ring all-reduce 2(p-1)/p, tree broadcast/reduce log2 q) and multiplications per rank",
             f"  {'':<14}{'fwd comm':>16}{'bwd comm':>16}{'bwd as run':>16}{'fwd mults':>18}{'bwd mults':>18}"]
    for mode, row in ours.items():
        for src, r in (("paper", paper.get(mode)), ("model", row)):
            if r:
                run = f"{r['backward_as_run']:,.0f}" if "backward_as_run" in r else ""
                lines.append(f"  {mode + ' ' + src:<14}{r['forward']:>16,.0f}{r['backward']:>16,.0f}{run:>16}"
                             f"{r['forward_mults']:>18,.0f}{r['backward_mults']:>18,.0f}")
    return "\n".join(lines)


def why_slower(other, best) -> str:
    """The terms that make `other`'s step longer than `best`'s, largest first."""
    diffs = sorted(((other.terms[k] - best.terms[k], k) for k in TERMS), reverse=True)
    said = [f"{k} {other.terms[k] * 1e3:,.1f} ms against {best.terms[k] * 1e3:,.1f}" for d, k in diffs[:2] if d > 0]
    return "; ".join(said) or "the same terms, rounded"


def mode_verdicts(plan, modes) -> dict[str, str]:
    """Why the best setup of every other mode loses to the first (or why the mode has none)."""
    best, out = plan.ranked[0] if plan.ranked else None, {}
    for mode in modes:
        mine = plan.best_of(mode)
        if mine is not None and best is not None:
            if mine is best:
                out[mode] = "the first"
            else:
                out[mode] = (f"best {mine.choice.describe()}: {mine.step_s * 1e3:,.1f} ms, {mine.step_s / best.step_s:.2f}x "
                             f"the first: {why_slower(mine, best)}")
        elif mode in plan.closest_over:
            over = plan.closest_over[mode]
            out[mode] = (f"nothing fits: its smallest, {over.choice.describe()}, needs "
                         f"{over.memory['total'] / 2 ** 30:,.1f} GiB per rank")
        elif plan.smallest_groups.get(mode):
            tried = ", ".join(str(tp) for tp in divisors(plan.gpus) if tp > 1)
            smallest = " and ".join(map(str, plan.smallest_groups[mode]))
            out[mode] = (f"refused: no tp of {plan.gpus} ranks makes a layout of it (tp = {tried}); "
                         f"its smallest are tp = {smallest}" if tried else
                         f"refused: one rank has no tensor group to split over; its smallest are tp = {smallest}")
        else:
            reasons = plan.refused.get(mode)
            top = reasons.most_common(1)[0][0] if reasons else "no layout of it on these ranks"
            out[mode] = f"refused: {top}"
    return out


def format_search(plan, *, cfg, gpus: int, ranks_per_node: int, machine: Machine, batch: int, top: int, modes,
                  command: str | None) -> str:
    """`plan --auto`'s answer as text; `command`: the line that trains its first choice (None when
    nothing fits)."""
    limit = plan.memory_limit
    per_node = f"{ranks_per_node} per node" if gpus > ranks_per_node else "on one node"
    refused = sum(sum(r.values()) for r in plan.refused.values())
    lines = [f"{cfg}", f"{gpus} ranks {per_node}, global batch {batch} x {cfg.seq_len} tokens, on {machine.at(gpus).describe()}",
             f"memory per rank: {'no limit' if limit is None else f'{limit / 2 ** 30:,.1f} GiB'}; priced {plan.priced} "
             f"setups in {plan.seconds:.1f} s: {len(plan.ranked)} fit, {plan.over_memory} over the memory limit at "
             f"every ZeRO stage, with activation checkpointing and accumulation, {refused} layouts refused", ""]
    head = ("#", "step ms") + TERMS + ("GiB",)
    widths = (3, 11) + (11,) * len(TERMS) + (8,)
    lines.append("".join(f"{h:>{w}}" for h, w in zip(head, widths)) + "  setup")
    for k, p in enumerate(plan.ranked[:top], 1):
        values = (str(k), f"{p.step_s * 1e3:,.1f}") + tuple(f"{p.terms[t] * 1e3:,.1f}" for t in TERMS) + (
            f"{p.memory['total'] / 2 ** 30:,.2f}",)
        lines.append("".join(f"{v:>{w}}" for v, w in zip(values, widths)) + f"  {p.choice.describe()}")
    if plan.ranked:
        lines += ["", f"the first as a run: {command}"]
    lines += ["", "the other modes:"]
    lines += [f"  {mode}: {why}" for mode, why in mode_verdicts(plan, modes).items()]
    if plan.ranked:
        lines += ["", "the ZeRO stages:"] + [f"  --zero {zero}: {why}" for zero, why in zero_verdicts(plan).items()]
    return "\n".join(lines)


def zero_verdicts(plan) -> dict[int, str]:
    """The best setup at each ZeRO stage that fits, its memory per rank (at stage 3 with the
    weights it gathers during a step), and why it loses to the first."""
    best, out = plan.ranked[0], {}
    for zero in ZERO_STAGES:
        mine = next((p for p in plan.ranked if p.choice.zero == zero), None)
        if mine is None:
            out[zero] = "no setup that fits"
            continue
        gathered = mine.memory.get("gathered", 0)
        memory = f"{mine.memory['total'] / 2 ** 30:,.2f} GiB" + (
            f" ({gathered / 2 ** 30:,.2f} of them gathered during the step)" if gathered else "")
        verdict = "the first" if mine is best else f"{mine.step_s / best.step_s:.2f}x the first: {why_slower(mine, best)}"
        out[zero] = f"{mine.choice.describe()}: {mine.step_s * 1e3:,.1f} ms, {memory}; {verdict}"
    return out
