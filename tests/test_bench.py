"""lattice.bench: the DTensor peer against lattice's serial model, its communication count, the
saved-activation measurement, mode selection and one whole (untimed-for-asserts) bench run.
No test here asserts a time."""

import argparse
import json

import pytest
import torch
import torch.distributed as dist
from multiproc import run_distributed

import lattice
from lattice import bench, cost
from lattice.bench import measure, peers

CFG = dict(vocab_size=96, seq_len=16, d_model=24, n_heads=6, n_layers=2)


def _batch(cfg, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=gen) for _ in range(2))


def test_peer_is_lattices_serial_model_in_plain_pytorch():
    """Catches a weight mapping bug (W[in, out] not transposed into nn.Linear, q/k/v taken from the
    wrong slice of the stacked qkv, an untied head): float64 logits must equal lattice's."""
    cfg = lattice.GPTConfig(**CFG)
    ref = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    peer = peers.PeerGPT(cfg).double()
    peer.load_lattice(ref.full_state_dict())
    tokens, _ = _batch(cfg)
    torch.testing.assert_close(peer(tokens), ref(tokens), rtol=1e-12, atol=1e-12)
    assert peer.head.weight is peer.wte.weight


def _peer_on_ranks():
    cfg = lattice.GPTConfig(**CFG)
    ref = lattice.GPT(cfg, lattice.context("serial"))
    sd = ref.full_state_dict()
    tokens, targets = _batch(cfg)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    from torch.distributed.device_mesh import init_device_mesh

    peer = peers.PeerGPT(cfg)
    peer.load_lattice(sd)
    peers.parallelize_peer(peer, init_device_mesh("cpu", (dist.get_world_size(),)))
    meter = lattice.CommMeter()
    with meter, peers.DTensorComm(meter):
        loss = peers.peer_loss(peer, tokens, targets)
        peers.peer_backward(loss)
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(peer.wte.weight.grad.full_tensor(), ref.embed.wte.grad, rtol=1e-4, atol=1e-6)
    model = cost.estimate(cfg, "1d", batch=4, tp=dist.get_world_size())
    return {k: v["elements"] for k, v in meter.summary().items()}, {k: v["elements"] for k, v in model.summary().items()}


def test_dtensor_peer_equals_serial_and_moves_what_1d_moves():
    """Catches a peer that is not the same model (loss or tied-embedding gradient differ from
    serial) and a DTensor collective the counter misses or mis-sizes: the peer implements
    Megatron 1D, so per (phase, op, group) its elements equal the 1D model's."""
    for measured, model in run_distributed(2, _peer_on_ranks):
        assert measured == pytest.approx(model, rel=0.01)


def _llama_peer_on_ranks():
    from torch.distributed.device_mesh import init_device_mesh

    from lattice.models.llama import LlamaConfig

    cfg = LlamaConfig.preset("tiny", vocab_size=64, seq_len=8)
    ref = lattice.build_model(cfg, lattice.context("serial"))
    tokens, targets = _batch(cfg)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    peer = peers.parallelize_peer_llama(peers.PeerLlama(cfg, ref.full_state_dict()),
                                        init_device_mesh("cpu", (dist.get_world_size(),)))
    meter = lattice.CommMeter()
    with meter, peers.DTensorComm(meter):
        loss = peers.peer_loss(peer, tokens, targets)
        peers.peer_backward(loss)
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grad = peer.hf.model.layers[0].self_attn.k_proj.weight.grad.full_tensor()
    torch.testing.assert_close(grad.t(), ref.blocks[0].attn.qkv.k.weight.grad, rtol=1e-4, atol=1e-6)
    model = cost.estimate(cfg, "1d", batch=4, tp=dist.get_world_size())
    return {k: v["elements"] for k, v in meter.summary().items()}, {k: v["elements"] for k, v in model.summary().items()}


def test_dtensor_llama_peer_equals_serial_and_moves_what_1d_moves():
    """The same for the Llama peer (transformers' LlamaForCausalLM under torchtitan's plan):
    catches a peer computing another function (loss, a kv projection's gradient) or Llama
    collectives (q/k/v behind one input, gate/up behind another) the cost model counts
    differently from what DTensor sends."""
    for measured, model in run_distributed(2, _llama_peer_on_ranks):
        assert measured == pytest.approx(model, rel=0.01)


def test_saved_activation_bytes_counts_each_storage_once_and_no_parameters():
    """Catches double counting of views (x and x.t() share a storage) or counting a weight that
    autograd saves as if it were an activation."""
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8, requires_grad=True)

    def run():
        y = lin(x)  # saves x (and the weight, a parameter)
        z = torch.relu(y)  # saves its output, 4 x 16
        return (z * x.t().sum()).sum()  # mul saves z and a fresh scalar

    assert measure.saved_activation_bytes(lin, run) == 4 * (4 * 8 + 4 * 16 + 1)


def test_mode_selection_names_why_a_mode_does_not_fit():
    """Catches the bench trying a layout that cannot run (it would fail mid-benchmark) or skipping
    one silently."""
    cfg = lattice.GPTConfig(**CFG)
    runs, skipped = measure.applicable(cfg, 4, 2, None)
    assert ("1d", "1d", {}) in runs and ("dtensor", "dtensor", {}) in runs
    assert any(label == "2d" and "square" in why for label, why in skipped)
    odd_vocab = lattice.GPTConfig(**{**CFG, "vocab_size": 97})  # 1d pads it, the peer cannot
    runs, skipped = measure.applicable(odd_vocab, 4, 3, ["1d", "dtensor"])
    assert [r[0] for r in runs] == ["1d"]
    assert skipped == [("dtensor", "vocab_size = 97 is not divisible by p = 3")]
    runs, skipped = measure.applicable(cfg, 4, 4, ["1d"])
    assert runs == [] and "n_heads = 6" in skipped[0][1]
    assert measure.applicable(cfg, 4, 1, None) == ([("serial", "serial", {})], [])


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    """Catches a broken end-to-end path (processes, metering, reporting): one tiny untimed run of
    1d and the peer on 2 processes must write the JSON and PNG, with every mode's loss equal to
    serial's and its measured communication equal to the model's."""
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(["--nproc", "2", "--model", "tiny", "--vocab-size", "96", "--seq-len", "16",
                              "--batch", "2", "--steps", "1", "--warmup", "0", "--modes", "1d,dtensor",
                              "--out", str(tmp_path), "--timeout", "300"])
    assert bench.run_bench(args) == 0
    report = json.loads((tmp_path / "bench_p2.json").read_text())
    rows = {r["label"]: r for r in report["result"]["rows"]}
    assert set(rows) == {"serial", "1d", "dtensor"}
    for label in ("1d", "dtensor"):
        assert rows[label]["comm_ratio"] == pytest.approx(1.0, abs=0.01)
        assert rows[label]["loss"] == pytest.approx(rows["serial"]["loss"], rel=1e-4)
    assert rows["1d"]["comm_by_op_match"]
    assert (tmp_path / "bench_p2.png").stat().st_size > 0
    assert "1d step / dtensor step" in capsys.readouterr().out


def test_bench_refuses_bad_requests_in_one_line(capsys):
    """Catches a typo'd mode or an impossible size starting processes (and failing later, or
    benchmarking nothing) instead of a one-line refusal naming what is allowed."""
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    for argv, expect in ((["--modes", "1d,4d"], "unknown mode(s) ['4d']"), (["--nproc", "0"], "--nproc must be"),
                         (["--sweep", "weak", "--sizes", "1,3"], "--sizes must be")):
        assert bench.run_bench(parser.parse_args(argv + ["--out", "/nonexistent/never"])) == 2
        err = capsys.readouterr().err.strip()
        assert expect in err and "\n" not in err
