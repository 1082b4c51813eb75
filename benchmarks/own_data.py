"""Own data at scale: tokenization throughput, and the peak memory of training on a corpus
much larger than the model.

    python benchmarks/own_data.py --megabytes 200

Writes a text file of the given size (the built-in corpus's paragraphs shuffled and repeated),
tokenizes it once as `lattice train --data` does (BPE trained on the streamed text, tokens
written to a memory-mapped uint16 file) and reports MB/s and the peak RSS of that step; then runs
`lattice train --data FILE` for a few steps in a fresh process and reports its peak RSS, which
stays bounded because batches read only their windows of the token file.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megabytes", type=int, default=200)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lattice.data.corpus import corpus_text, load_data_corpus

    work = Path(tempfile.mkdtemp(prefix="lattice-own-data-"))
    path = work / "corpus.txt"
    paragraphs = corpus_text().split("\n\n")
    rng = random.Random(0)
    with open(path, "w") as f:
        while f.tell() < args.megabytes * 2 ** 20:
            rng.shuffle(paragraphs)
            f.write("\n\n".join(paragraphs))
    size = path.stat().st_size / 2 ** 20
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    os.environ["LATTICE_CACHE"] = str(work / "cache")
    corpus = load_data_corpus(str(path), args.vocab_size)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = len(corpus.train) + len(corpus.val)
    print(f"text {size:.0f} MiB -> {tokens / 1e6:.1f} M tokens ({tokens * 2 / 2 ** 20:.0f} MiB of uint16) in {dt:.0f} s: "
          f"{size / dt:.2f} MiB/s, {tokens / dt / 1e6:.2f} M tokens/s (BPE training included); peak RSS "
          f"{peak:.0f} MiB ({peak - base:.0f} MiB above the start)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LATTICE_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "lattice", "train", "--data", str(path), "--vocab-size", str(args.vocab_size),
           "--model", "tiny", "--steps", str(args.steps), "--eval-interval", str(args.steps), "--no-progress",
           "--out-dir", str(work / "run")]
    # through a small intermediary: a child's ru_maxrss starts from its parent's at fork, and this
    # process is large after tokenizing; the intermediary reports its own child's true peak
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True, text=True)
    if run.returncode:
        print(run.stderr[-2000:])
        return 1
    child_peak = int(run.stderr.strip().splitlines()[-1]) / 1024
    print(f"lattice train --data ({args.steps} steps, tiny model, cached tokens): {time.perf_counter() - t0:.0f} s, "
          f"peak RSS {child_peak:.0f} MiB for a {size:.0f} MiB corpus")
    print(run.stdout.strip().splitlines()[-2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
