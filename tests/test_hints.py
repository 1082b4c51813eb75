"""The refusal table: every model a layout refuses, across the families, the modes and their
tensor-parallel degrees, names values that work; each value, applied alone, is accepted."""

import dataclasses
import re

import pytest

import lattice
from lattice import LatticeConfigError
from lattice.models import get_arch
from lattice.modes import get_mode

# sizes that the layouts below split unevenly, one or two at a time
CHANGES = [dict(d_model=30), dict(d_model=36, n_heads=6), dict(n_heads=3, d_model=24), dict(n_heads=5, d_model=40),
           dict(n_heads=6, d_model=48), dict(d_model=96, n_heads=12), dict(n_kv_heads=1), dict(n_kv_heads=3, n_heads=6)]
LAYOUTS = [("1d", dict(tp=t)) for t in (2, 3, 4, 5, 8)] + [("2d", dict(tp=4)), ("2d", dict(tp=9)), ("3d", dict(tp=8))] \
    + [("subgraph", dict(tp=t, subgrids=g)) for t, g in ((4, 2), (4, 4), (6, 3), (8, 2))]
OFFER = re.compile(r"; values that work with everything else as given: (.*)$")


def _refusals():
    """(family, config, layout, message) of every refusal of a model by a layout in the table."""
    out = []
    for arch in ("gpt2", "llama"):
        family = get_arch(arch)
        for change in CHANGES:
            try:
                cfg = family.config_class(**{**family.test_shapes[0], **change})
            except (LatticeConfigError, TypeError):  # a size the family itself refuses, or has not
                continue
            for mode, kw in LAYOUTS:
                layout = lattice.Layout.of(mode, **kw)
                try:
                    get_mode(mode)(cfg, layout.context())
                except LatticeConfigError as e:
                    out.append((arch, cfg, layout, str(e)))
    return out


def _accepted(cfg, layout) -> bool:
    try:
        get_mode(layout.mode)(cfg, layout.context())
    except LatticeConfigError:
        return False
    return True


def test_every_suggested_value_is_accepted():
    """Catches a hint that fixes one constraint and breaks another (1d at tp 5 suggesting a
    d_model that fits tp but not n_heads = 12), a hint naming a value the mode still refuses,
    and a model check that refuses without offering working values."""
    refusals = _refusals()
    assert len(refusals) >= 40, len(refusals)
    applied = 0
    for arch, cfg, layout, message in refusals:
        assert "\n" not in message, message
        offer = OFFER.search(message)
        if offer is None:
            assert message.endswith("no single change of tp, d_model or the head counts fits; change several"), message
            continue
        for item in offer.group(1).split("; "):
            name, values = item.split(" ", 1)
            for value in map(int, values.split(" or ")):
                if name == "tp":
                    ok = _accepted(cfg, layout.replace(tp=value))
                else:
                    ok = _accepted(dataclasses.replace(cfg, **{name: value}), layout)
                assert ok, (arch, layout.mode, layout.tp, message, name, value)
                applied += 1
    assert applied >= 80, applied


@pytest.mark.parametrize("tp,works", [(5, "tp 4 or 6"), (7, "tp 6 or 12")])
def test_the_reported_one_d_case_suggests_what_works(tp, works):
    """Catches the hint of the first-hour report: the default model at --mode 1d --tp 5 was told
    to use d_model 190 or 195, which n_heads = 12 then refused."""
    cfg = lattice.GPTConfig.preset("small", vocab_size=2048)
    with pytest.raises(LatticeConfigError) as e:
        lattice.build_model(cfg, lattice.context("1d", tp=tp))
    assert str(e.value).endswith(f"values that work with everything else as given: {works}"), str(e.value)


BATCH_LAYOUTS = [dict(mode="2d", tp=4, dp=2), dict(mode="2d", tp=4, pp=2, microbatches=4), dict(mode="3d", tp=8, dp=3),
                 dict(mode="subgraph", tp=4, subgrids=2, dp=2), dict(mode="subgraph", tp=4, subgrids=2, common="subgrid"),
                 dict(mode="1d", tp=2, pp=2, microbatches=3), dict(mode="serial", dp=4, pp=2, microbatches=2),
                 dict(mode="1d", tp=2, sequence_parallel=True, dp=3)]


def test_every_suggested_global_batch_is_accepted():
    """Catches a batch hint that satisfies one constraint and breaks another (a multiple of dp
    whose replica batch the micro-batches or the mesh then cannot split, as '2d q = 2 with 4
    micro-batches: give each replica a multiple of 2' did): every global batch a refusal names
    passes the whole check of the run."""
    from lattice.training.run_spec import TrainConfig, check_run

    cfg = lattice.GPTConfig(vocab_size=61, seq_len=8, d_model=32, n_heads=4, n_layers=4)
    refused = applied = 0
    for kw in BATCH_LAYOUTS:
        ctx = lattice.Layout.of(**kw).context()
        for batch in range(1, 41):
            try:
                check_run(TrainConfig(batch_size=batch), cfg, ctx)
                continue
            except LatticeConfigError as e:
                message = str(e)
            refused += 1
            offer = re.search(r"; global batch sizes \(--batch-size\) that work with everything else as given: "
                              r"(\d+(?: or \d+)?)$", message)
            assert offer, message
            for value in map(int, offer.group(1).split(" or ")):
                check_run(TrainConfig(batch_size=value), cfg, ctx)  # raises if the hint was wrong
                applied += 1
    assert refused >= 150 and applied >= refused, (refused, applied)
