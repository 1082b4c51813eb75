"""Tokenization throughput: lattice's token-file writer (`lattice.data.token_files.write_token_file`,
pieces of about 1 MB through `encode_batch`, streamed to disk) against the tokenizers library's
own `encode_batch` of the same pieces in one call, held in memory, on the same text; the lines the
writer prints into a log (a line at every tenth of the text, then the summary) are kept.

    python benchmarks/tokenize_throughput.py --mb 100 -o benchmarks/results/tokenize_throughput.json

The text is the built-in corpus repeated to --mb megabytes; the tokenizer is a 2048-token
byte-level BPE trained on the corpus once (what `lattice train --data` trains, at its default size).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lattice.bench.provenance import provenance  # noqa: E402
from lattice.data.corpus import corpus_text, train_tokenizer  # noqa: E402
from lattice.data.text_files import CHUNK_CHARS, Piece  # noqa: E402
from lattice.data.token_files import write_token_file  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="megabytes of text (default 100)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    corpus = corpus_text()
    tokenizer = train_tokenizer(corpus, args.vocab_size)
    text = corpus * max(1, int(args.mb * 1e6 / len(corpus.encode())))
    pieces = [text[k:k + CHUNK_CHARS] for k in range(0, len(text), CHUNK_CHARS)]
    log = io.StringIO()  # what a run's log shows (not a terminal): a line at every tenth, then the summary
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(log):
        chars, tokens, ours, _ = write_token_file(Path(tmp) / "tokens.bin", tokenizer, map(Piece, pieces), np.uint16,
                                                  total=len(text))
    print(log.getvalue(), end="")
    start = time.perf_counter()
    theirs_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(pieces, add_special_tokens=False))
    theirs = time.perf_counter() - start
    result = {"provenance": provenance(), "megabytes": len(text.encode()) / 1e6, "characters": chars,
              "tokens": tokens, "same_tokens": tokens == theirs_tokens, "write_token_file_s": ours,
              "encode_batch_s": theirs, "ratio_of_throughput": theirs / ours,
              "write_token_file_mb_per_s": len(text.encode()) / 1e6 / ours, "log": log.getvalue().splitlines()}
    text_out = json.dumps(result, indent=1)
    print(text_out)
    if args.output:
        Path(args.output).write_text(text_out + "\n")


if __name__ == "__main__":
    main()
