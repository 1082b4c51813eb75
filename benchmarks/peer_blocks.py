"""One transformer block (GPT-2's: pre-LayerNorm, fused q/k/v, causal attention, a 4h GELU MLP,
biases) in lattice and in a peer's tensor-parallel layers, on the same gloo world: forward +
backward per block, timed in alternating rounds, and the ratio of the medians.

    torchrun --nproc-per-node 8 benchmarks/peer_blocks.py --peer colossal-3d            # lattice 3d, q = 2
    torchrun --nproc-per-node 8 benchmarks/peer_blocks.py --peer colossal-3d -o keep_gathered=True
    torchrun --nproc-per-node 4 benchmarks/peer_blocks.py --peer colossal-2d            # lattice 2d, q = 2
    torchrun --nproc-per-node 2 benchmarks/peer_blocks.py --peer megatron-1d            # lattice 1d
    torchrun --nproc-per-node 2 benchmarks/peer_blocks.py --peer megatron-1d --layers 4 # the whole model
    torchrun --nproc-per-node 2 benchmarks/peer_blocks.py --peer megatron-1d --layers 4 --without-communication

Megatron-core's ColumnParallelLinear / RowParallelLinear (`pip install --no-deps megatron-core`;
0.16.1 is the newest for Python 3.11) are the 1D peer, always without sequence parallelism
(Megatron's takes its buffers from CUDA); lattice's `-o sequence_parallel=True` then runs against it. The 2D / 3D peer is Colossal-AI's legacy layers (LayerNorm2D/3D, Linear2D/3D: `pip install --no-deps
colossalai==0.5.0 peft accelerate galore_torch bitsandbytes` beside lattice; its pinned torch and
transformers are not needed for these layers). It is never a dependency of lattice or its tests.
Both blocks take their layout's activation pieces (2d: [B/q, T, h/q]; 3d: [B/q², T, h/q]),
attention runs on each rank's n/q heads, and the time is the slowest rank's. One thread per
rank, as `lattice bench` runs.

With `--layers L` (1D only) the whole GPT-2 instead: token embedding split over the vocabulary,
learned positions, L blocks, the final LayerNorm, the head tied to the token embedding and the
vocabulary-parallel cross-entropy, forward + backward of the loss on (B, T) tokens: lattice's GPT
against the same model from Megatron-core's layers (VocabParallelEmbedding, the blocks above, a
ColumnParallelLinear head given the embedding's weight, vocab_parallel_cross_entropy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def colossal_block(kind: str, h: int, n: int):
    """GPT-2's block from Colossal-AI's legacy layers, built in forward order (its 3D layers swap
    their input and output groups as each is built, as Colossal's own models do)."""
    import importlib

    layers = importlib.import_module(f"colossalai.legacy.nn.layer.parallel_{kind}.layers")
    # CPU patch: initialisation runs under Colossal's per-mode CUDA random states; here the
    # default generator (the values do not matter for timing)
    layers.seed = lambda mode: contextlib.nullcontext()
    Norm, Linear = getattr(layers, f"LayerNorm{kind.upper()}"), getattr(layers, f"Linear{kind.upper()}")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.qkv, self.proj = Norm(h, eps=1e-5), Linear(h, 3 * h), Linear(h, h)
            self.ln_2, self.fc, self.fc_proj = Norm(h, eps=1e-5), Linear(h, 4 * h), Linear(4 * h, h)

        def forward(self, x):  # (b, T, h/q) -> (b, T, h/q)
            b, T, _ = x.shape
            qkv = self.qkv(self.ln_1(x)).view(b, T, 3, -1, h // n)  # this rank's n/q heads
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, T, -1)
            x = x + self.proj(y)
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    return Block()


def megatron_block(h: int, n: int, tp: int, sequence_parallel: bool):
    """GPT-2's block from Megatron-core's tensor-parallel layers (1D): q/k/v and fc
    ColumnParallelLinear, both projections RowParallelLinear, LayerNorms replicated, on the CPU
    (use_cpu_initialization, no gradient-accumulation fusion); its input-gradient all-reduce runs
    beside the weight-gradient product, as Megatron's linear does."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                 params_dtype=torch.float32, gradient_accumulation_fusion=False,
                                 sequence_parallel=sequence_parallel)
    init = nn.init.xavier_normal_
    column = dict(config=config, init_method=init, bias=True, gather_output=False)
    row = dict(config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = ColumnParallelLinear(h, 3 * h, **column), RowParallelLinear(h, h, **row)
            self.fc, self.fc_proj = ColumnParallelLinear(h, 4 * h, **column), RowParallelLinear(4 * h, h, **row)

        def forward(self, x):  # (T, b, h) replicated (T/p with sequence parallelism), Megatron's order -> same
            qkv = self.qkv(self.ln_1(x))[0]
            T, b = qkv.shape[:2]
            qkv = qkv.view(T, b, 3, -1, h // n)  # this rank's n/p heads
            q, k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(3))  # (b, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(T, b, -1)
            x = x + self.proj(y)[0]
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))[0], approximate="tanh"))[0]

    return Block()


def megatron_gpt(h: int, n: int, tp: int, vocab: int, T: int, layers: int):
    """GPT-2 from Megatron-core's layers, as its GPTModel assembles it without pipeline or
    sequence parallelism: a (B, T) batch in, the mean token loss out."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy

    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                 params_dtype=torch.float32, gradient_accumulation_fusion=False)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = VocabParallelEmbedding(vocab, h, init_method=nn.init.xavier_normal_, config=config)
            self.wpe = nn.Embedding(T, h)
            self.blocks = nn.ModuleList(megatron_block(h, n, tp, sequence_parallel=False) for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            self.head = ColumnParallelLinear(h, vocab, config=config, init_method=nn.init.xavier_normal_, bias=False,
                                             gather_output=False, skip_weight_param_allocation=True)

        def forward(self, tokens, targets):  # (B, T) each
            x = (self.wte(tokens) + self.wpe.weight[:tokens.shape[1]]).transpose(0, 1).contiguous()  # (T, B, h)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x), weight=self.wte.weight)[0]  # (T, B, V/p)
            return vocab_parallel_cross_entropy(logits, targets.t().contiguous()).mean()

    return GPT()


class _Done:
    """What an async collective returns, for one that did nothing."""

    def wait(self, *args, **kwargs):
        return True


@contextlib.contextmanager
def collectives_free():
    """Every collective lattice and the peers call becomes a no-op that leaves its tensors as they
    are: the step's compute (and Python) alone, with both ranks still running side by side on the
    cores, i.e. the floor that no overlap or fusion of collectives can go below. The values are
    wrong (partial sums stay partial) but the shapes, and so the work, are the step's own."""
    import lattice.parallel.comm as comm

    def nothing(*args, async_op=False, **kwargs):
        return _Done() if async_op else None

    names = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
             "reduce", "all_gather", "reduce_scatter", "_reduce_scatter_base", "_all_gather_base"]
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    saved_comm = {name: getattr(comm, name) for name in ("unmetered_all_gather", "_native_reduce_scatter")}
    try:
        for name in saved:
            setattr(dist, name, nothing)
        for name in saved_comm:
            setattr(comm, name, nothing)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for name, fn in saved_comm.items():
            setattr(comm, name, fn)


def lattice_block(mode: str, tp: int, options: dict, h: int, n: int, T: int):
    """Block 0 of lattice's GPT-2 in `mode`, its mode, and the block's in-replica gradient sums
    (what sync_grads runs for its parameters after backward: replicated vectors' sums over their
    plane), which the peer's gradient hooks do inside its backward."""
    import lattice
    from lattice.parallel.sharding import all_reduce_grads, grad_sum_buckets

    ctx = lattice.init(mode, tp=tp, **options)
    cfg = lattice.GPTConfig(vocab_size=256, seq_len=T, d_model=h, n_heads=n, n_layers=1)
    model = lattice.GPT(cfg, ctx)
    params = dict(model.named_parameters())
    sums = [(ctx.group(*axes), [params[name] for name in names if name.startswith("blocks.0.")])
            for axes, names in grad_sum_buckets(model)]

    def sync_grads():
        for group, mine in sums:
            if group is not None and mine:
                all_reduce_grads(mine, group)

    return model.blocks[0], model.mode, sync_grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=["megatron-1d", "colossal-2d", "colossal-3d"], required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=0,
                        help="time the whole GPT-2 of this many blocks (forward + backward of the loss), 1D only")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of the whole model (--layers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="forward + backward per block per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("-o", "--mode-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of lattice's mode, e.g. -o keep_gathered=True")
    parser.add_argument("--without-communication", action="store_true",
                        help="after the rounds, the same rounds with every collective a no-op: each step's "
                             "compute alone, the floor for any communication lever")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, torch.profiler's top operations of both blocks on rank 0")
    args = parser.parse_args()
    if args.layers and args.peer != "megatron-1d":
        parser.error("--layers (the whole model) is for --peer megatron-1d")
    torch.set_num_threads(1)
    kind = args.peer.split("-")[1]
    world = int(os.environ["WORLD_SIZE"])
    from lattice.modes.options import given_mode_options

    options = given_mode_options(argparse.Namespace(mode_option=args.mode_option))

    dist.init_process_group("gloo")
    h, n, B, T = args.hidden, args.heads, args.batch, args.seq
    if args.peer == "megatron-1d":
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        # Megatron's sequence parallelism takes its buffers from CUDA (get_global_memory_buffer), so
        # on the CPU its block runs without it, whatever lattice's options
        peer = (megatron_gpt(h, n, world, args.vocab, T, args.layers) if args.layers else
                megatron_block(h, n, world, sequence_parallel=False))
    else:
        from colossalai.legacy.initialize import launch as colossal_launch

        # torchrun's store already serves MASTER_PORT: the default group is made above from it,
        # and Colossal's launch (which would open its own tcp:// store there) only registers it
        init, dist.init_process_group = dist.init_process_group, lambda *a, **k: None
        try:
            colossal_launch(config=dict(parallel=dict(tensor=dict(mode=kind, size=world))), rank=dist.get_rank(),
                            world_size=world, host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                            backend="gloo", verbose=False)
        finally:
            dist.init_process_group = init
        peer = colossal_block(kind, h, n)
    gen = torch.Generator().manual_seed(dist.get_rank())
    if args.layers:  # the whole model: the same tokens into both, the loss's backward
        import lattice

        cfg = lattice.GPTConfig(vocab_size=args.vocab, seq_len=T, d_model=h, n_heads=n, n_layers=args.layers)
        model = lattice.GPT(cfg, lattice.init(kind, tp=world, **options))
        tokens, targets = (torch.randint(0, args.vocab, (B, T), generator=torch.Generator().manual_seed(0))
                           for _ in range(2))

        def lattice_step():
            model(tokens, targets).backward()
            model.sync_grads()

        steps = {"lattice": lattice_step, "peer": lambda: peer(tokens, targets).backward()}
    else:
        mine, mode, sync_grads = lattice_block(kind, world, options, h, n, T)
        shape = mode.residual_shape(B, T)
        x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        # Megatron's layers take (T, B, h): the same values, transposed once outside the timing (with
        # lattice's sequence parallelism, whose residual holds T/p of the tokens, values of their own)
        if kind == "1d" and shape != (B, T, h):
            peer_x, peer_dy = torch.randn(T, B, h, generator=gen), torch.randn(T, B, h, generator=gen)
        elif kind == "1d":
            peer_x, peer_dy = x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous()
        else:
            peer_x, peer_dy = x, dy

        def lattice_step():
            mine(x.clone().requires_grad_()).backward(dy)
            sync_grads()

        steps = {"lattice": lattice_step, "peer": lambda: peer(peer_x.clone().requires_grad_()).backward(peer_dy)}

    def run(step, count):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            step()
        elapsed = torch.tensor((time.perf_counter() - start) / count)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        return float(elapsed)

    def rounds(steps):
        times = {name: [] for name in steps}
        for step in steps.values():
            run(step, args.warmup)
        for r in range(args.rounds):
            for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
                times[name].append(run(steps[name], args.steps))
        return times

    label = f"lattice {kind}" + "".join(f" {k}={v}" for k, v in options.items())
    peer_label = "Megatron-core 1D" if kind == "1d" else f"Colossal-AI legacy {kind.upper()}"
    who_ran = {"lattice": label, "peer": peer_label}

    def show(times, suffix=""):
        for name in times:
            who = who_ran[name] + suffix
            print(f"  {who:<48} " + " ".join(f"{t * 1e3:8.2f}" for t in times[name])
                  + f"   median {statistics.median(times[name]) * 1e3:8.2f}")

    times = rounds(steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    if dist.get_rank() == 0:
        what = f"GPT-2 of {args.layers} blocks, vocabulary {args.vocab}" if args.layers else "GPT-2 block"
        print(f"{what}, hidden {h}, {n} heads, batch {B} x {T}, p = {world}, gloo, 1 thread per rank; "
              f"forward + backward per {'step' if args.layers else 'block'}, ms, {args.rounds} alternating rounds "
              f"of {args.steps}:")
        show(times)
        ratios = [a / b for a, b in zip(times["lattice"], times["peer"])]
        print(f"  {label} / {'Megatron-core' if kind == '1d' else 'Colossal'} {kind.upper()} = "
              f"{median['lattice'] / median['peer']:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.without_communication:
        def free(step):
            def step_without_communication():
                with collectives_free():
                    step()
            return step_without_communication

        bare = rounds({name: free(step) for name, step in steps.items()})
        bare_median = {name: statistics.median(t) for name, t in bare.items()}
        if dist.get_rank() == 0:
            print(f"every collective a no-op (compute alone), {args.rounds} alternating rounds of {args.steps}:")
            show(bare, ", no communication")
            for name in bare:
                print(f"  {who_ran[name]}: communication "
                      f"{(median[name] - bare_median[name]) * 1e3:.2f} ms of {median[name] * 1e3:.2f} "
                      f"({(1 - bare_median[name] / median[name]) * 100:.1f}%)")
            print(f"  floor: {label} without communication / {peer_label} with it = "
                  f"{bare_median['lattice'] / median['peer']:.3f}; compute alone, lattice / peer = "
                  f"{bare_median['lattice'] / bare_median['peer']:.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(step, args.steps)
            if dist.get_rank() == 0:
                print(f"\n{name}: top operations on rank 0 over {args.steps} forward + backward")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
