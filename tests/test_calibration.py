"""Calibration (lattice.calibration: calibrate, comm, timing) and the machine presets it fills:
each rate and curve fitted from micro-benchmark timings the test sets, the cpu preset read from
its file."""

import dataclasses
import json

import pytest
from planner_cases import MACHINE, small

from lattice.cost.machine import Machine
from lattice.cost.machines import MACHINES, machine_named
from lattice.cost.model import estimate
from lattice.parallel.context import LatticeConfigError


def test_kernel_rows_fitted_over_the_row_counts():
    """Catches a wrong fit of the calibration's row term: products timed at 64 to 512 rows that take
    (rows + 20) units give 20 back, and with any one timing 15% off the fit stays within 10 rows
    (the two-count solve it replaces gave 35 for the shortest); a larger product slower per row than a smaller one
    (out of cache), a smaller no slower per row, or a single row count give 0, never a negative or
    infinite term."""
    from lattice.calibration.calibrate import fit_kernel_rows

    rows = (64, 128, 256, 512)
    assert fit_kernel_rows([(m, (m + 20) * 3e-6) for m in rows]) == pytest.approx(20.0)
    for off in rows:
        for factor in (0.85, 1.15):
            noisy = [(m, (m + 20) * 3e-6 * (factor if m == off else 1.0)) for m in rows]
            assert abs(fit_kernel_rows(noisy) - 20) < 10, (off, factor)
    assert fit_kernel_rows([(m, m * (1 + m / 2048) * 3e-6) for m in rows]) == 0.0
    assert fit_kernel_rows([(m, m * 3e-6) for m in rows]) == 0.0
    assert fit_kernel_rows([(512, 1.0)]) == 0.0


def _row_term_of_products_slow_at_first(*, warm_and_in_turn: bool = True) -> float:
    """The calibration's row term of four products that take (rows + 20) x 10 µs, twice as long at
    first and back to that over 0.6 s (a process's first work), timed as `calibrate` times them
    (else each row count's samples one after the other, cold, the shortest first). The products
    advance a clock of their own in place of `time.perf_counter`, so that a loaded machine's
    descheduling cannot stretch them (busy-waited, the fit came out 9 under a full test run)."""
    import types

    import lattice.calibration.calibrate as calibrate
    import lattice.calibration.timing as timing

    now = [0.0]

    def product(rows):
        def run():
            now[0] += (rows + 20) * 1e-5 * (1 + max(0.0, 1 - now[0] / 0.6))
        return run

    rows = (64, 128, 256, 512)
    real_time, timing.time = timing.time, types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        if warm_and_in_turn:
            seconds = timing.timed_in_turn([product(m) for m in rows], 5, warm_rounds=1)
        else:
            seconds = [timing.timed_in_turn([product(m)], 5)[0] for m in rows]
    finally:
        timing.time = real_time
    return calibrate.fit_kernel_rows(list(zip(rows, seconds)))


def _differences_under_drift() -> list[tuple[float, float]]:
    """timed_differences of a collective's loop against the loop alone, on a clock of their own: the
    loop's time drifts from round to round (0.1 s plus 0 to 0.9 s, the machine's speed), the
    collective adds 10 ms plus 0 to 12 ms of its own noise."""
    import types

    import lattice.calibration.timing as timing

    now, calls = [0.0], {"with": 0, "without": 0}
    drift = [0.0, 0.8, 0.1, 0.9, 0.2]  # seconds, per round
    own = [0.0, 0.003, 0.006, 0.009, 0.012]

    def timed(name, extra):
        def run():
            r = max(calls[name] - 1, 0)  # the first call sets the repeats (one: each is over SAMPLE_S)
            calls[name] += 1
            now[0] += 0.1 + drift[r] + (0.010 + own[r] if extra else 0.0)
        return run

    real_time, timing.time = timing.time, types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        return timing.timed_differences([(timed("with", True), timed("without", False))], 5)
    finally:
        timing.time = real_time


def test_a_difference_of_timings_is_taken_within_each_round():
    """Catches a calibration's extra time (a collective's wake after a stretch of compute, a
    pipeline's growth per micro-batch) taken as the difference of two medians timed apart: where
    the machine's speed drifts between rounds by more than the extra itself, each median is that
    of the drift's middle round and their difference that round's extra alone (here 22 ms, the
    round with 12 ms of the collective's own noise), not the median over rounds of the extra
    (16 ms: 10 ms plus 0-12 of its own noise). The baseline is the loop alone's median: 0.1 s
    plus the median drift of 0.2 s."""
    from multiproc import run_distributed

    for (baseline, extra), in run_distributed(1, _differences_under_drift):
        assert baseline == pytest.approx(0.3)
        assert extra == pytest.approx(0.016)


def test_products_timed_in_turn_after_a_warm_round_keep_the_row_term():
    """Catches the calibration timing its row counts one after the other, cold: the shortest
    product, timed first while the process is new, came out slower per row and the row term fitted
    26-84 rows at 2 ranks where warm products timed in turn give 6-31 (pipelines of one-sequence
    micro-batches then priced 8-50% above their steps). Products of (rows + 20) units, slow at
    first, must still give 20 back; timed one after the other, cold, the same products give 118
    (111-124 when they were busy-waited)."""
    from multiproc import run_distributed

    for rank_rows in run_distributed(2, _row_term_of_products_slow_at_first):
        assert abs(rank_rows - 20) < 5, rank_rows
    for rank_rows in run_distributed(2, _row_term_of_products_slow_at_first, warm_and_in_turn=False):
        assert rank_rows > 100, rank_rows


def _waits_of_one_slow_rank() -> tuple:
    import time

    import torch
    import torch.distributed as dist

    from lattice.calibration.calibrate import measure_skew_curve

    pause = 0.002 if dist.get_rank() == 3 else 0.001
    spent = [0.0, 0]

    def work():
        t = time.perf_counter()
        time.sleep(pause)
        spent[0] += time.perf_counter() - t
        spent[1] += 1

    curve = measure_skew_curve(work, stretches=(0.02, 0.06), samples=5)
    # a loaded host oversleeps every pause by a fraction of a millisecond, the same on every rank:
    # the expected waits are derived from each rank's measured pause, not from the nominal 1 and 2 ms
    mine = torch.tensor([spent[0] / spent[1]], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return curve, [float(t) for t in every]


def test_skew_curve_waits_for_the_slowest_rank_of_each_group():
    """Catches the calibration's wait per synchronisation taken over the wrong ranks (the whole
    world for every group, or a group's mean): of 4 ranks whose pause takes d_i (r for three, 2r
    for the last, plus whatever the host oversleeps), groups of 2 wait the mean of their slowest
    rank's pause less the mean pause, (max(d0, d1) + max(d2, d3))/2 - mean(d), about 0.2 of the
    mean pause, and the group of 4 waits max(d) - mean(d), about 0.6 of it."""
    from multiproc import run_distributed

    for curve, pauses in run_distributed(4, _waits_of_one_slow_rank):
        mean = sum(pauses) / 4
        expected = {
            2: ((max(pauses[:2]) + max(pauses[2:])) / 2 - mean) / mean,
            4: (max(pauses) - mean) / mean,
        }
        assert 0.12 < expected[2] < 0.25 and 0.35 < expected[4] < 0.65, pauses  # one rank pauses twice as long
        by_group = {}
        for ranks, stretch, wait in curve:
            by_group.setdefault(ranks, []).append(wait / stretch)
        assert sorted(by_group) == [2, 4]
        assert all(abs(r - expected[2]) < 0.06 for r in by_group[2]), (by_group, expected)
        assert all(abs(r - expected[4]) < 0.1 for r in by_group[4]), (by_group, expected)


def test_machine_presets_and_files():
    """Catches a preset with a missing rate and a `--machine` file whose per-world calibrations stay
    lists (unhashable, never matched): each preset prices a step; a file's by_world rows are read,
    and `at` picks the calibration of the nearest world size."""
    cfg = small(n_layers=2)
    for name, machine in MACHINES.items():
        assert estimate(cfg, "serial", batch=2).time(machine)["step"] > 0, name
    m = machine_named(json.dumps({"flop_rate": 1e12, "alpha_intra": 1e-6, "beta_intra": 1e-10, "alpha_inter": 1e-5,
                                  "beta_inter": 1e-9, "ranks_per_node": 8,
                                  "by_world": [[1, 1e12, 1e9, 1e9, 1e-6, 1e-10],
                                               [8, 2e11, 1e9, 1e9, 1e-3, 1e-10, 1e-5, 1e10, 0, 0, 0, 0,
                                                [["all_reduce", 2e-3, 3e-10]]]]}))
    assert m.at(1).flop_rate == 1e12 and m.at(6).flop_rate == 2e11 and m.at(2).flop_rate == 1e12
    hash(m)  # a Machine file's nested lists became tuples
    assert m.at(8).link(False, "all_reduce") == (2e-3, 3e-10) and m.at(8).link(False, "broadcast") == (1e-3, 1e-10)
    assert m.at(8).link(True, "all_reduce") == (1e-3, 1e-9) and m.at(1).link(False, "all_reduce") == (1e-6, 1e-10)
    with pytest.raises(LatticeConfigError, match="no preset"):
        machine_named("no-such-machine")
    assert isinstance(MACHINES["cpu-2core"], Machine)


def test_each_machine_field_is_in_one_group_and_gpus_leave_the_shared_core_fields_alone():
    """Catches a field added to Machine without saying whether it is the papers' model, a measured
    departure from it or a wait of ranks sharing cores (each field in exactly one group), and a
    GPU preset that prices core sharing its ranks do not have."""
    from lattice.cost.machine import MEASURED_FIELDS, PAPER_FIELDS, SHARED_CORE_FIELDS

    groups = PAPER_FIELDS + MEASURED_FIELDS + SHARED_CORE_FIELDS
    assert sorted(groups) == sorted(f.name for f in dataclasses.fields(Machine)) and len(set(groups)) == len(groups)
    defaults = {f.name: f.default for f in dataclasses.fields(Machine) if f.name in SHARED_CORE_FIELDS}
    gpus = [m for name, m in MACHINES.items() if not name.startswith("cpu")]
    assert len(gpus) >= 5 and all(getattr(m, k) == v for m in gpus for k, v in defaults.items())
    assert any(getattr(MACHINES["cpu-2core"], k) != v for k, v in defaults.items())


def test_the_cpu_presets_rows_are_read_column_by_column_from_its_file():
    """Catches the cpu-2core preset losing its calibrated curves or reading them into the wrong
    columns: each of its rows at 2, 4 and 8 ranks is the file's, named field by field as
    BY_WORLD_FIELDS orders them, and the machine at 2 ranks reads the file's wake curve and
    pipeline schedules' times."""
    import json
    import os

    from lattice.cost import machines
    from lattice.cost.machine import BY_WORLD_FIELDS
    from lattice.cost.machines import frozen

    with open(os.path.join(os.path.dirname(machines.__file__), "cpu_2core.json")) as f:
        rows = json.load(f)["rows"]
    assert [list(row) for row in rows] == [list(BY_WORLD_FIELDS)] * 3 and [row["ranks"] for row in rows] == [2, 4, 8]
    two = MACHINES["cpu-2core"].at(2)
    assert two.flop_rate == rows[0]["flop_rate"] and two.skew == rows[0]["skew"]
    assert two.wake_curve == frozen(rows[0]["wake_curve"]) and len(two.wake_curve) == 4
    assert two.pipeline_actions == frozen(rows[0]["pipeline_actions"])
    assert MACHINES["cpu-2core"].at(8).collective_curves == frozen(rows[2]["collective_curves"])


def _pipeline_actions_on_set_timings() -> tuple:
    """`measure_pipeline_actions` on steps timed as if each schedule took 10 ms + 4 ms per micro-batch
    (gpipe), 3 ms (1f1b) or 5 ms (interleaved), against a price of 20 ms + 1 ms per micro-batch;
    with what the price was asked: (sizes of the model, micro-batches, batch, the machine's actions)."""
    import lattice.calibration.calibrate as calibrate
    import lattice.planner.pricing as pricing
    from lattice.cost import model_config

    per_microbatch = {"gpipe": 0.004, "1f1b": 0.003, "interleaved": 0.005}
    # the timed pairs in calibrate's order: each schedule at 3 micro-batches per stage beyond 1 (p = 2)
    fake = [(0.01 + 2 * per_microbatch[s], 4 * per_microbatch[s]) for s in ("gpipe", "1f1b", "interleaved")]
    asked = []

    def fake_price(cfg, choice, *, batch, machine):
        asked.append(((cfg.vocab_size, cfg.n_layers, cfg.d_model, cfg.seq_len), choice.layout.pipeline.m, batch,
                      machine.pipeline_actions))
        return pricing.Priced(choice, 0.02 + 0.001 * choice.layout.pipeline.m, {}, {})

    real, calibrate.timed_differences = calibrate.timed_differences, lambda pairs, n: fake[:len(pairs)]
    real_price, pricing.price = pricing.price, fake_price
    try:
        machine = dataclasses.replace(MACHINE, pipeline_actions=(("1f1b", 1.0),))
        cfg = model_config("gpt2", "small", vocab_size=2048, d_model=48, seq_len=16)
        return calibrate.measure_pipeline_actions(cfg, machine, 1), asked
    finally:
        calibrate.timed_differences, pricing.price = real, real_price


def test_a_schedules_own_time_per_chunk_is_its_slope_beyond_its_price():
    """Catches the calibration's pipeline_actions taken per micro-batch rather than per chunk
    (interleaved runs two chunks of one block per micro-batch on each rank, the others one of two),
    with the price's own growth per micro-batch left in, priced with the actions it is measuring,
    or timed on a model other than the family's at its own width and sequence (the tiny preset's
    ranks idle between chunks, which a step's do not: gpt2-wide's pipeline at 4 ranks grew 27.4 ms
    per micro-batch where the tiny model's grew 5.6). By hand, against a price growing 1 ms per
    micro-batch: gpipe 4 - 1 = 3 ms, 1f1b 3 - 1 = 2 ms, interleaved (5 - 1) / 2 = 2 ms."""
    from multiproc import run_distributed

    for actions, asked in run_distributed(2, _pipeline_actions_on_set_timings):
        assert dict(actions) == pytest.approx({"gpipe": 0.003, "1f1b": 0.002, "interleaved": 0.002}, abs=1e-9)
        assert [(m, batch) for _, m, batch, _ in asked] == [(2, 2), (6, 6)] * 3
        assert all(sizes == (16, 4, 48, 16) and not actions for sizes, _, _, actions in asked)


def _group_curves_on_set_timings() -> tuple:
    """`measure_group_curves` at 4 ranks with the loop's gain set to 8 x k ms for the k-th size."""
    import lattice.calibration.comm as calibrate

    gains = iter(range(1, 100))

    def fake(pairs, n):
        return [(0.01, 8e-3 * next(gains))]

    real, calibrate.timed_differences = calibrate.timed_differences, fake
    try:
        return calibrate.measure_group_curves(lambda coll: None, 1)
    finally:
        calibrate.timed_differences = real


def test_the_group_curves_are_each_sizes_gain_per_call_at_a_ranks_wire_bytes():
    """Catches the calibration's group curves at the wrong group sizes (at 4 ranks: pairs only; the
    world's is the collective curve), at the buffer's bytes rather than a rank's wire bytes
    (2 (n - 1)/n of them: the buffer itself for a pair) or per loop rather than per call (8 calls)."""
    from multiproc import run_distributed

    from lattice.calibration.calibrate import COLLECTIVE_SIZES

    expected = (("all_reduce", 2, tuple((numel * 4.0, k * 1e-3) for k, numel in enumerate(COLLECTIVE_SIZES, 1))),)
    for curves in run_distributed(4, _group_curves_on_set_timings):
        assert curves[0][:2] == expected[0][:2]
        assert [w for w, _ in curves[0][2]] == [w for w, _ in expected[0][2]]
        assert [t for _, t in curves[0][2]] == pytest.approx([t for _, t in expected[0][2]])
        assert len(curves) == 1


def _grad_sums_on_a_set_clock() -> tuple:
    """`measure_grad_sum_ratios` at 2 ranks with a clock that the all-reduce alone moves (1 ns per
    element), what it runs recorded: ("stretch" | "barrier" | elements and buffer of an all-reduce)."""
    import types

    import torch

    import lattice.calibration.comm as calibrate

    now, calls, buffers = [0.0], [], []
    real_reduce, real_barrier, real_time = calibrate.dist.all_reduce, calibrate.dist.barrier, calibrate.time

    def all_reduce(x, op=None, **kw):
        if x.dtype == torch.float64:  # the slowest rank's seconds: the real one
            return real_reduce(x, op=op)
        calls.append(x.numel())
        buffers.append(x)
        now[0] += x.numel() * 1e-9

    calibrate.dist.all_reduce, calibrate.dist.barrier = all_reduce, lambda: calls.append("barrier")
    calibrate.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        looped = {n: n * 0.5e-9 for n in calibrate.GRAD_SUM_SIZES}
        ratios = calibrate.measure_grad_sum_ratios(lambda: calls.append("stretch"), looped, 3)
    finally:
        calibrate.dist.all_reduce, calibrate.dist.barrier, calibrate.time = real_reduce, real_barrier, real_time
    return ratios, calls, len({id(b) for b in buffers}), len(buffers), [b.numel() for b in buffers]


def test_the_gradient_sum_is_timed_after_compute_and_a_barrier_on_a_fresh_buffer():
    """Catches the gradient sum timed back to back on one buffer (the loop the collectives' curves
    come from, which priced gpt2-deep's 4.4 MB sum at half the Trainer's time), without the stretch
    of compute and the barrier before each call, or its ratio taken at the buffer's bytes rather
    than a rank's wire bytes (2 (n - 1)/n of them: the buffer itself for a pair): a clock only the
    all-reduce moves (1 ns per element) against a loop of 0.5 ns per element gives 2 at every size."""
    from multiproc import run_distributed

    from lattice.calibration.comm import GRAD_SUM_SIZES

    for ratios, calls, distinct, total, sizes in run_distributed(2, _grad_sums_on_a_set_clock):
        assert [w for w, _ in ratios] == [n * 4.0 for n in GRAD_SUM_SIZES]
        assert [r for _, r in ratios] == pytest.approx([2.0] * len(GRAD_SUM_SIZES))
        assert calls == [c for n in GRAD_SUM_SIZES for _ in range(7) for c in ("stretch", "barrier", n)]
        assert sizes == [n for n in GRAD_SUM_SIZES for _ in range(7)]
        assert distinct == total  # each call on a buffer of its own, as a step's concatenated gradients


def test_kernel_rows_and_rate_from_the_median_of_the_product_bursts():
    """Catches the row term fitted from one burst of the products: the first, timed as the
    calibration's world starts, fitted 70-75 rows for gpt2-deep at 2 ranks where two later bursts
    of the same calibration gave 43-56. Of three bursts taking (rows + 50) x 1 µs, (rows + 150) x
    1 µs and (rows + 50) x 1.3 µs, the row term is 50 and the rate the median of what each burst
    gives the batch's products with it: weights x (512 + 50) over 562, 662 and 730.6 µs, the
    second's."""
    from lattice.calibration.calibrate import fit_product_rates

    rows = [64, 128, 256, 512]
    bursts = [[(m + 50) * 1e-6 for m in rows], [(m + 150) * 1e-6 for m in rows], [(m + 50) * 1.3e-6 for m in rows]]
    kernel_rows, rate = fit_product_rates(rows, bursts, weights=1e6)
    assert kernel_rows == pytest.approx(50.0)
    assert rate == pytest.approx(1e6 * 562 / 662e-6)


def test_here_calibrates_each_world_once_and_plans_from_the_cache(tmp_path, monkeypatch, capsys):
    """Catches `--machine here` calibrating again on every plan (a minute each), a cache that does
    not read back into the same rates, a plan that does not say whose rates it priced with and how
    old they are, and a corrupt cache or more ranks than the host runs ending in a traceback: the
    first call at 1 rank calibrates (and says so), the second reads the cache and gives the same
    Machine, `plan --auto --machine here` prints the rates line with their age, and the bad cases
    are one line each."""
    from lattice.bench import host
    from lattice.cli import main as cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    logged = []
    first, line = host.host_machine([1], log=logged.append)
    assert len(logged) == 1 and logged[0].startswith("calibrating this host at 1 rank")
    assert host.cache_file().is_relative_to(tmp_path) and host.cache_file().exists()
    again, _ = host.host_machine([1], log=logged.append)
    assert len(logged) == 1 and again == first and first.at(1).flop_rate > 0
    assert line.startswith("rates: this host's, calibrated at 1 rank ") and " ago " in line
    argv = ["plan", "--auto", "--model", "small", "--n-layers", "2", "--gpus", "1", "--batch", "2"]
    assert cli.main([*argv, "--machine", "here"]) == 0 and cli.main(argv) == 0  # here is the default on CPU
    out = capsys.readouterr()
    assert out.out.count("rates: this host's, calibrated at 1 rank ") == 2 and "calibrating" not in out.err
    with pytest.raises(LatticeConfigError, match=r"is more than its \d+ cores run .*--machine .*h100-node"):
        host.host_machine([host.RANKS_PER_CORE * host.cores() + 1])
    host.cache_file().write_text("{")
    assert cli.main([*argv, "--machine", "here"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot be read" in err and "--recalibrate" in err
