"""The planner's search (`lattice plan --auto`, lattice.planner.search): it covers the space a hand
enumeration gives, honours the memory limit (with ZeRO, checkpointing and accumulation to rescue a
setup), never prices a layout training refuses, and the command answers in text and JSON with a
train command that runs its first choice."""

import dataclasses
import itertools
import json
import re
import shlex

import pytest
from planner_cases import MACHINE, small

from lattice.cli import main as cli
from lattice.cli.plan_report import mode_verdicts
from lattice.cost import model_config
from lattice.cost.machines import MACHINES
from lattice.planner.search import Choice, price, search
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError


def test_search_covers_the_hand_enumerated_space_and_ranks_by_price():
    """Catches a search that skips feasible setups (a pp it never tries, a dp it drops): on 4 ranks
    of one node, every 1d and serial layout a hand enumeration lists (tp, pp with 1F1B at the largest
    micro-batch counts, dp) is among those the planner priced, and its first is the fastest of them."""
    cfg = small(n_layers=4)
    plan = search(cfg, gpus=4, machine=MACHINE, batch=8, ranks_per_node=4, precisions=("bf16",), modes=["1d", "serial"])
    found = {p.choice.describe() for p in plan.ranked}
    hand = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if 4 % (tp * pp):
                continue
            dp = 4 // (tp * pp)
            ms = [m for m in range(pp, 8 // dp + 1) if (8 // dp) % m == 0][-2:] if pp > 1 else [None]
            for m in ms:
                pipe = {"microbatches": m, "pp_schedule": "1f1b"} if pp > 1 else {}
                lay = Layout("serial" if tp == 1 else "1d", tp=tp, pp=pp, dp=dp, ranks_per_node=4, **pipe)
                hand.append(price(cfg, Choice(lay, precision="bf16"), batch=8, machine=MACHINE))
    missing = [p.choice.describe() for p in hand if p.choice.describe() not in found]
    assert not missing
    assert plan.ranked == sorted(plan.ranked, key=lambda p: p.step_s)
    assert plan.ranked[0].step_s <= min(p.step_s for p in hand) * (1 + 1e-12)


def test_a_tensor_group_that_only_some_option_settings_allow_is_searched():
    """Catches the search dropping a tp because the mode's default options refuse it: on 3 ranks,
    subgraph's default of 2 sub-grids does not divide tp = 3, yet 3 sub-grids do, and the model's
    12 heads split over them; and 2d and 3d, which no divisor of 3 ranks suits, named with the
    grids they need (4 and 9, 8 and 27), not a hint of tp = 4 or 8 that 3 ranks cannot give."""
    cfg = small(n_layers=4)  # 12 heads, d_model 192
    plan = search(cfg, gpus=3, machine=MACHINE, batch=6, ranks_per_node=3, precisions=("bf16",))
    assert any(p.choice.layout.mode == "subgraph" and p.choice.layout.tp == 3 for p in plan.ranked)
    assert plan.smallest_groups == {"2d": [4, 9], "3d": [8, 27]}
    verdicts = mode_verdicts(plan, ["2d", "3d"])
    assert verdicts["3d"] == "refused: no tp of 3 ranks makes a layout of it (tp = 3); its smallest are tp = 8 and 27"
    assert verdicts["2d"].endswith("its smallest are tp = 4 and 9")
    one = search(cfg, gpus=1, machine=MACHINE, batch=6, precisions=("bf16",), modes=["serial", "1d"])
    assert mode_verdicts(one, ["1d"])["1d"] == "refused: one rank has no tensor group to split over; its smallest are tp = 2 and 3"


def test_gradient_accumulation_is_priced_as_its_passes_and_one_update():
    """Catches the planner pricing --microbatches without --pp as one pass over the whole batch:
    two passes of 4 sequences each compute and run the tensor collectives of a 4-sequence step
    (twice the latency of one 8-sequence step's calls), hold one 4-sequence pass's activations,
    and reduce the gradients and update once."""
    cfg = small(n_layers=4)
    lay = Layout("1d", tp=2, dp=2, ranks_per_node=4)
    whole = price(cfg, Choice(lay), batch=16, machine=MACHINE)
    half = price(cfg, Choice(lay), batch=8, machine=MACHINE)
    passes = price(cfg, Choice(lay.replace(microbatches=2)), batch=16, machine=MACHINE)
    assert passes.terms["compute"] == pytest.approx(2 * half.terms["compute"])
    assert passes.terms["tensor"] == pytest.approx(2 * half.terms["tensor"])
    assert passes.terms["tensor"] > whole.terms["tensor"]  # the same bytes in twice the calls
    assert passes.terms["data"] == pytest.approx(half.terms["data"]) == pytest.approx(whole.terms["data"])
    assert passes.memory["activations"] == pytest.approx(half.memory["activations"])
    assert passes.memory["activations"] < whole.memory["activations"]


def test_gradient_accumulation_rescues_a_batch_whose_activations_are_over_the_limit():
    """Catches the search dropping a layout whose batch fits only in smaller passes: one rank, 64
    sequences, a limit below the checkpointed whole batch but above the checkpointed batch in 8
    passes. The planner must rank a setup with accumulation, within the limit, whose command
    trains it with --microbatches."""
    cfg = small(n_layers=4)
    precision = MACHINE.precision
    whole = price(cfg, Choice(Layout("serial"), precision=precision, checkpointing=True), batch=64, machine=MACHINE)
    passes = price(cfg, Choice(Layout("serial", microbatches=8), precision=precision, checkpointing=True), batch=64,
                   machine=MACHINE)
    limit = (whole.memory["total"] + passes.memory["total"]) / 2
    plan = search(cfg, gpus=1, machine=MACHINE, batch=64, precisions=(precision,), memory_gib=limit / 2 ** 30)
    assert plan.ranked and all(p.memory["total"] <= limit for p in plan.ranked)
    first = plan.ranked[0].choice
    assert first.layout.microbatches > 1 and first.layout.pipeline is None
    assert f"--microbatches {first.layout.microbatches}" in first.train_flags()
    assert f"accumulated m={first.layout.microbatches}" in first.describe()


def test_memory_limit_drops_and_counts_and_zero_or_checkpointing_rescue():
    """Catches a setup over the memory limit in the ranking, the drops going uncounted, or ZeRO and
    activation checkpointing never tried: with a limit between the smallest and the largest
    memory of the unlimited search, every ranked setup fits, some were dropped, and some ranked
    setup needed ZeRO or checkpointing to fit."""
    cfg = small(n_layers=4)
    free = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",))
    totals = sorted(p.memory["total"] for p in free.ranked)
    limit = totals[len(totals) // 4]
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",),
                  memory_gib=limit / 2 ** 30)
    assert plan.ranked and plan.over_memory > 0
    assert all(p.memory["total"] <= limit for p in plan.ranked)
    assert any(p.choice.zero or p.choice.checkpointing for p in plan.ranked)
    assert all(p.memory["total"] > limit for p in plan.closest_over.values())


def test_selective_checkpointing_is_tried_between_none_and_full():
    """Catches selective recomputation left out of the search, or tried after full recomputation
    (which adds more time): one rank, a limit between the selectively and the fully recomputed
    step's memory; the planner's setup recomputes selectively, and its price lies between the
    step without recomputation and the fully recomputed one, in time and in memory."""
    cfg = small(n_layers=4)
    precision = MACHINE.precision
    setups = [price(cfg, Choice(Layout("serial"), precision=precision, **kind), batch=16, machine=MACHINE)
              for kind in ({}, {"selective": True}, {"checkpointing": True})]
    none, selective, full = setups
    assert none.step_s < selective.step_s < full.step_s
    assert none.memory["total"] > selective.memory["total"] > full.memory["total"]
    limit = (none.memory["total"] + selective.memory["total"]) / 2
    plan = search(cfg, gpus=1, machine=MACHINE, batch=16, precisions=(precision,), memory_gib=limit / 2 ** 30)
    whole = [p for p in plan.ranked if p.choice.layout.accumulation == 1]
    assert whole and whole[0].choice.selective and not whole[0].choice.checkpointing
    assert "--selective-checkpointing" in whole[0].choice.train_flags()
    assert whole[0].step_s == pytest.approx(selective.step_s)


def test_a_zero_stage_below_the_highest_is_found_where_the_highest_takes_more_memory(monkeypatch):
    """Catches a search that skips a recomputation (or none) because its highest ZeRO stage is over
    the limit, where a lower stage fits: ZeRO-3's gathered weights can outweigh ZeRO-2's whole
    ones (under accumulation every block stays gathered). Prices stubbed: ZeRO-3 over the limit at
    every recomputation, ZeRO-2 without recomputation under it; the data-parallel layout's setup
    must be that one."""
    import importlib

    from lattice.planner.pricing import Priced

    def memory(choice):  # MiB: less recomputed and a higher stage, more memory, but stage 3 above 2
        kind = 2 if choice.checkpointing else 1 if choice.selective else 0
        return 100 - 20 * kind - {0: 0, 1: 10, 2: 20, 3: 5}[choice.zero]

    def stub(cfg, choice, *, batch, machine):
        return Priced(choice, 1.0 + choice.zero + 10 * (choice.checkpointing + choice.selective), {},
                      {"total": memory(choice) * 2 ** 20, "activations": 0.0})

    monkeypatch.setattr(importlib.import_module("lattice.planner.search"), "price", stub)
    plan = search(small(n_layers=2), gpus=2, machine=MACHINE, batch=2, modes=["serial"], memory_gib=85 / 1024)
    replicas = [p.choice for p in plan.ranked if p.choice.layout.dp == 2 and p.choice.layout.accumulation == 1]
    assert replicas and {(c.zero, c.checkpointing, c.selective) for c in replicas} == {(2, False, False)}


def test_no_micro_batch_of_zero_sequences_is_priced():
    """Catches the old `plan --splits` pricing "16 micro-batches of 0": a pipeline with more
    micro-batches than a replica's sequences is refused by `price`, and the search lists none."""
    cfg = small(n_layers=4)
    lay = Layout("1d", tp=2, pp=2, microbatches=4)
    with pytest.raises(LatticeConfigError, match="micro-batches"):  # (as training words it)
        price(cfg, Choice(lay), batch=2, machine=MACHINE)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=4, ranks_per_node=8, precisions=("bf16",))
    for p in plan.ranked:
        lay = p.choice.layout
        assert lay.pp == 1 or 4 // lay.dp >= lay.pipeline.m


@pytest.mark.parametrize("n_layers", [4, 6])
def test_train_flags_of_a_choice_give_back_its_layout(n_layers):
    """Catches a suggested command line that would train another layout than the one priced: the
    flags parse (as `lattice train` parses them) back into the same Layout (with 6 blocks, pp = 4
    with its uneven split)."""
    import argparse

    from lattice.cli.arguments import add_layout_flags, layout_from_args

    cfg = small(n_layers=n_layers)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=4, precisions=("bf16",))
    for p in plan.ranked[:40] + [p for p in plan.ranked[40:] if p.choice.layout.pp_layers]:
        parser = argparse.ArgumentParser()
        add_layout_flags(parser)
        for flag in ("--zero", "--precision"):
            parser.add_argument(flag)
        parser.add_argument("--activation-checkpointing", action="store_true")
        args = parser.parse_args(p.choice.train_flags().split())
        assert layout_from_args(args, ranks_per_node=4) == p.choice.layout, p.choice.train_flags()


def test_plan_auto_answers_in_text_and_json(capsys):
    """Catches `plan --auto` crashing on a real preset, printing columns that run together, or JSON
    that is not one document: GPT-2-medium on 16 GPUs of 4 per node."""
    argv = ["plan", "--auto", "--arch", "gpt2", "--model", "gpt2-medium", "--gpus", "16", "--ranks-per-node", "4",
            "--batch", "32", "--machine", "h100-node"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+[\d,]+\.\d", line)]
    assert len(rows) == 5
    assert "the first as a run: torchrun --nnodes 4 --nproc-per-node 4 " in out and "the other modes:" in out
    for mode in ("1d", "2d", "3d", "subgraph"):
        assert f"  {mode}: " in out
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert len(answer["top"]) == 5 and answer["priced"] >= answer["fit"] > 0
    steps = [t["step_s"] for t in answer["top"]]
    assert steps == sorted(steps)


def test_plan_auto_prints_a_train_command_that_runs_its_first_choice(capsys):
    """Catches the printed run dropping the launcher (a --dp 4 layout then refused in one process),
    the model's size flags or the batch, or naming another layout than the one ranked first."""
    from lattice.cli.arguments import layout_from_args

    argv = ["plan", "--auto", "--model", "small", "--n-layers", "2", "--no-bias", "--gpus", "4", "--batch", "8",
            "--machine", "cpu-2core"]
    assert cli.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the first as a run: "))
    words = shlex.split(line[len("the first as a run: "):])
    assert words[:2] == ["lattice", "train"]
    args = cli.build_parser("train").parse_args(words[1:])
    assert (args.nproc, args.n_layers, args.bias, args.batch_size) == (4, 2, False, 8)
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    first = answer["top"][0]
    assert answer["command"] == " ".join(words)  # the same line for scripts
    layout = layout_from_args(args)
    assert (layout.mode, layout.tp, layout.cp, layout.pp, layout.dp, dict(layout.options)) == (
        first["mode"], first["tp"], first["cp"], first["pp"], first["dp"], first["options"])
    assert (args.zero or 0, bool(args.activation_checkpointing)) == (first["zero"], first["activation_checkpointing"])
    assert cli.main(argv[:-4] + ["--gpus", "16", "--ranks-per-node", "4", "--batch", "16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the first as a run: "))
    assert "torchrun --nnodes 4 --nproc-per-node 4 " in line and " -m lattice train " in line


def test_plan_auto_refuses_bad_input_in_one_line(capsys):
    """Catches --auto without --gpus, an unknown mode or a precision the machine has no rate for
    ending in a traceback."""
    for extra, words in ((["--auto"], "--gpus"), (["--auto", "--gpus", "4", "--modes", "4d"], "no mode 4d"),
                         (["--auto", "--gpus", "4", "--machine", "cpu-2core", "--precision", "bf16"], "fp32 only"),
                         (["--auto", "--gpus", "4", "--batch", "0"], "give the global batch")):
        assert cli.main(["plan", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err


def test_a_classifier_is_planned_without_pipeline_or_context_parallelism():
    """Catches the planner proposing for --task classify a pipeline or cp, which training refuses
    (one target per sequence)."""
    cfg = model_config("bert", "bert-base", num_labels=3, n_layers=4)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",))
    assert plan.ranked
    assert all(p.choice.layout.pp == 1 and p.choice.layout.cp == 1 for p in plan.ranked)


def test_every_pipeline_the_search_ranks_splits_as_training_splits_it():
    """Catches `plan --auto` ranking pp = 4 for a model of 6 blocks with the flags `--pp 4` alone,
    which training refuses ("6 blocks do not split evenly into 4 stages"): an uneven split is
    priced and suggested with its --pp-layers, the extra blocks off the stages with the end parts."""
    cfg = small(n_layers=6)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=4, precisions=("bf16",))
    pipelined = [p.choice.layout for p in plan.ranked if p.choice.layout.pp > 1]
    assert {lay.pp for lay in pipelined} >= {2, 4}
    for lay in pipelined:
        counts = [len(c) for c in lay.pipeline.chunks(cfg.n_layers)]  # raises where training would
        if lay.pp == 4:
            assert lay.pipeline.v > 1 or counts == [1, 2, 2, 1]


def test_the_stage_figures_the_search_keeps_follow_every_argument_they_depend_on():
    """Catches the planner's kept stage figures (pricing.priced_blocks) answering a later price
    with the figures of another: a key that leaves out the machine, the placement of the groups on
    nodes, the ZeRO stage, the precision or the batch would price the second setup as the first.
    Each must equal the figures computed afresh (pricing.blocks_figures), and each pair differ."""
    from lattice.planner import pricing

    cfg = small(n_layers=4)
    lay = Layout("1d", tp=4, dp=2, ranks_per_node=8)
    spread = Layout("1d", tp=4, dp=2, ranks_per_node=2)  # the tensor groups now span nodes
    slower = dataclasses.replace(MACHINE, flop_rate=MACHINE.flop_rate / 2)
    base = dict(blocks=4, batch=4, machine=MACHINE, topology=lay.topology, zero=0, precision="fp32")
    variants = [{}, {"machine": slower}, {"topology": spread.topology}, {"zero": 1}, {"precision": "bf16"},
                {"batch": 2}]
    kept = []
    for change in variants:
        args = {**base, **change}
        kept.append(pricing.priced_blocks(cfg, lay, **args))
        assert kept[-1] == pricing.blocks_figures(cfg, lay, **args), change
        assert pricing.priced_blocks(cfg, lay, **args) is kept[-1]  # the second ask is kept
    for (a, fa), (b, fb) in itertools.combinations(zip(variants, kept), 2):
        assert fa != fb, (a, b)


def test_train_takes_the_fastest_option_setting_that_fits_and_keeps_the_given_ones():
    """Catches `lattice train` keeping 2d's defaults where keeping the gathered operands does not fit
    the device, choosing a setting slower than another that fits, or overriding an option the
    person gave: against every setting of 2d's options priced one by one (a hand list), without a
    limit the fastest (the declared defaults), under a limit between the settings' memories the
    fastest of those under it, under no setting's memory the smallest, and summa=broadcast given
    alone keeps it (keep_gathered then off)."""
    from lattice.planner.options import choose_options

    cfg, lay = small(), Layout("2d", tp=4, ranks_per_node=4)
    settings = [dict(vectors=v, summa=s, keep_gathered=k) for v in ("hosted", "replicated")
                for s in ("broadcast", "all_gather") for k in (False, True) if not (k and s == "broadcast")]
    hand = [price(cfg, Choice(lay.replace(options=o)), batch=8, machine=MACHINE) for o in settings]
    memories = sorted({p.memory["total"] for p in hand})
    assert len(memories) > 1  # keep_gathered costs memory, or this test tests nothing

    def chosen(limit, given=None):
        got = choose_options(cfg, lay, given=given or {}, batch=8, machine=MACHINE, memory_limit=limit)
        return got, dict(got.options)

    got, options = chosen(None)
    assert got.fits and got.chosen == ("vectors", "summa", "keep_gathered")
    assert got.priced.step_s == min(p.step_s for p in hand)
    assert options == {"vectors": "replicated", "summa": "all_gather", "keep_gathered": True}
    limit = (memories[0] + memories[-1]) / 2
    got, options = chosen(limit)
    under = [p for p in hand if p.memory["total"] <= limit]
    assert got.fits and got.priced.memory["total"] <= limit < memories[-1]
    assert got.priced.step_s == min(p.step_s for p in under)
    got, options = chosen(memories[0] / 2)
    assert not got.fits and got.priced.memory["total"] == memories[0]
    got, options = chosen(None, {"summa": "broadcast"})
    assert options["summa"] == "broadcast" and not options["keep_gathered"] and "summa" not in got.chosen
    assert choose_options(cfg, lay, given=settings[0], batch=8, machine=MACHINE, memory_limit=None) is None
    # `lattice train --precision bf16` on a machine with no bf16 rate (this CPU's preset) ranks them at
    # the machine's own precision rather than raising (it ended the run in a traceback)
    bf16 = choose_options(cfg, lay, given={}, batch=8, machine=MACHINES["cpu-2core"], memory_limit=None,
                          precision="bf16")
    assert bf16 is not None and bf16.fits


def test_train_runs_with_the_options_it_prints_and_hands_them_to_its_workers(tmp_path):
    """Catches a launcher whose workers choose again (or differently) or train with other options than
    the line printed says: `lattice train --mode 2d --tp 4` without options prints the chosen
    setting once, its workers' config line holds the same, and an option given is not chosen."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "lattice", "train", "--mode", "2d", "--tp", "4", "--nproc", "4", "--steps", "1",
           "--model", "tiny", "--vocab-size", "512", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
           "--no-keep-gathered", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("2d options: ")]
    assert len(line) == 1, proc.stdout
    picked = dict(re.findall(r"(vectors|summa|keep_gathered)=(\w+)", line[0].split(" (")[0]))
    assert set(picked) == {"vectors", "summa"}  # keep_gathered was given
    config = next(x for x in proc.stdout.splitlines() if x.startswith("config: "))
    assert "keep_gathered=False" in config
    assert all(f"{k}={v}" in config for k, v in picked.items()), (picked, config)
