"""Peak memory of building a model on one rank, in a fresh process per case.

    python benchmarks/build_memory.py --model gpt2 --layout 1d:4 --layout 2d:4

Builds `lattice.build_model(cfg, ctx)` for one rank of the layout from a planning context (no process
group: construction does not communicate) and prints the process's peak resident memory above
what `import torch` and the context already took, beside the size of that rank's shards and of
the largest single full tensor. A rank should need its shards plus one full tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _one(model: str, mode: str, tp: int, rank: int, vocab: int) -> dict:
    import math

    import torch

    import lattice
    from lattice import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig.preset(model, vocab_size=vocab)
    ctx = lattice.context(mode, tp=tp, rank=rank)
    with torch.device("meta"):  # specs only, to size the shards without allocating
        meta = lattice.build_model(cfg, ctx)
    shard_bytes = sum(p.numel() * 4 for p in meta.parameters())
    largest_full = max(math.prod(s.full_shape) for s in meta.specs.values()) * 4
    del meta
    base = _peak_rss_bytes()
    model_ = lattice.build_model(cfg, ctx)
    peak = _peak_rss_bytes() - base
    return {"mode": mode, "tp": tp, "rank": rank, "peak_bytes": peak, "shard_bytes": shard_bytes,
            "largest_full_bytes": largest_full, "params": sum(p.numel() for p in model_.parameters())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--layout", action="append", default=None, metavar="MODE:TP",
                    help="e.g. 1d:4 or 2d:4 (repeatable; default 1d:4, 2d:4 and serial:1)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        mode, tp, rank = args.child.split(":")
        print(json.dumps(_one(args.model, mode, int(tp), int(rank), args.vocab_size)))
        return 0
    mib = 2 ** 20
    print(f"model {args.model}, vocabulary {args.vocab_size}, float32; peak RSS growth while building one rank's model")
    print(f"  {'layout':<10}{'rank':>5}{'peak MiB':>11}{'shards MiB':>12}{'largest full MiB':>18}{'peak - shards':>15}")
    for layout in args.layout or ["serial:1", "1d:4", "2d:4"]:
        mode, tp = layout.split(":")
        for rank in range(int(tp)):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--vocab-size", str(args.vocab_size),
                                  "--child", f"{mode}:{tp}:{rank}"], check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {layout:<10}{rank:>5}{r['peak_bytes'] / mib:>11.1f}{r['shard_bytes'] / mib:>12.1f}"
                  f"{r['largest_full_bytes'] / mib:>18.1f}{(r['peak_bytes'] - r['shard_bytes']) / mib:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
