"""`lattice convert`: the weights in the form asked for (lattice.checkpoint.convert), then the
tokenizer and the special-token and label metadata beside them (lattice.data.tokenizer_files),
which the checkpoint room cannot import; an HF export is moved into place once all of it is
written."""

from __future__ import annotations

import shutil
from pathlib import Path

from lattice.checkpoint.convert import add_convert_arguments  # noqa: F401 (the command's arguments)


def run_convert(args) -> int:
    from lattice import checkpoint
    from lattice.checkpoint.convert import convert, publish_hf
    from lattice.data.tokenizer_files import carry_tokenizer, describe_export

    meta = convert(args)
    from_hf = args.source == "hf"
    run = Path(args.src) if from_hf else checkpoint.run_of(args.src)
    dst = Path(args.dst)
    if meta["to"] != "hf":
        carry_tokenizer(Path(args.src), dst, to=meta["to"], from_hf=from_hf, meta=meta, run=run)
        return 0
    staging = meta["staging"]
    try:
        carry_tokenizer(Path(args.src), staging, to="hf", from_hf=False, meta=meta, run=run, shown=dst)
        describe_export(run, staging, meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    removed, kept = publish_hf(staging, dst)
    if removed or kept:
        print(f"--overwrite: in {dst}, removed the earlier {', '.join(removed) or 'nothing'}; kept "
              f"{', '.join(kept) or 'nothing else'}")
    return 0
