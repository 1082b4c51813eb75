"""Whether splitting a row-parallel product into chunks, each chunk's all-reduce started (async)
while the next chunk multiplies (Domino's and torchtitan's async-TP idea), pays on this world:
the product alone, the product then its all-reduce (what 1d's forward does), and the chunked forms,
timed in turn by the calibration's `timed_rounds` (each sample at least 50 ms; the median over
rounds of the slowest rank's sample).

    torchrun --nproc-per-node 2 benchmarks/chunked_overlap.py                  # gloo, 1 thread per rank
    torchrun --nproc-per-node 2 benchmarks/chunked_overlap.py --rows 2048 --chunks 2 4 8

The shape is 1d's MLP output projection in benchmarks/peer_blocks.py (batch 8 x 128 tokens, 4h/p =
512 in, h = 256 out at p = 2): a 1 MB all-reduce after a 1024 x 512 x 256 product.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from lattice.calibration.timing import timed_rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="tokens (batch x sequence)")
    parser.add_argument("--inner", type=int, default=512, help="the product's inner size (4h/p)")
    parser.add_argument("--out", type=int, default=256, help="the product's output size (h)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x, w = torch.randn(args.rows, args.inner), torch.randn(args.inner, args.out)

    def product_alone():
        return x @ w

    def product_then_all_reduce():
        y = x @ w
        dist.all_reduce(y)
        return y

    def chunked(k):
        def step():
            pieces, works = [], []
            for rows in x.chunk(k):
                pieces.append(rows @ w)  # (rows/k, out), summed over the group while the next multiplies
                works.append(dist.all_reduce(pieces[-1], async_op=True))
            for work in works:
                work.wait()
            return torch.cat(pieces)
        return step

    forms = {"product alone": product_alone, "product, then its all-reduce": product_then_all_reduce}
    forms.update({f"{k} chunks, all-reduces overlapped": chunked(k) for k in args.chunks})
    samples = torch.tensor(timed_rounds(list(forms.values()), args.rounds, warm_rounds=1), dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # each round's slowest rank
    times = dict(zip(forms, samples.tolist()))
    if dist.get_rank() == 0:
        base = statistics.median(times["product, then its all-reduce"])
        print(f"({args.rows} x {args.inner}) @ ({args.inner} x {args.out}) and its all-reduce, "
              f"p = {dist.get_world_size()}, {dist.get_backend()}, 1 thread per rank, ms, {args.rounds} rounds "
              f"in turn:")
        for name, t in times.items():
            print(f"  {name:<34} median {statistics.median(t) * 1e3:7.3f} ({min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})"
                  f"   / unchunked {statistics.median(t) / base:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
