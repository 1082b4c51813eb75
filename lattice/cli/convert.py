"""`lattice convert`: the weights in the form asked for (lattice.checkpoint.convert), then the
tokenizer beside them (lattice.data.tokenizer_files), which the checkpoint room cannot import."""

from __future__ import annotations

from pathlib import Path

from lattice.checkpoint.convert import add_convert_arguments  # noqa: F401 (the command's arguments)


def run_convert(args) -> int:
    from lattice import checkpoint
    from lattice.checkpoint.convert import convert
    from lattice.data.tokenizer_files import carry_tokenizer

    meta = convert(args)
    from_hf = args.source == "hf"
    run = Path(args.src) if from_hf else checkpoint.run_of(args.src)
    carry_tokenizer(Path(args.src), Path(args.dst), to=meta["to"], from_hf=from_hf, meta=meta, run=run)
    return 0
