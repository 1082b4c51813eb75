"""`--data-format hf`: local datasets read through HF `datasets` (the optional `data` extra: `pip
install -e '.[data]'`), streamed: parquet, arrow, JSON lines or CSV files (a file, a directory of
them or a glob), or a directory written by `Dataset.save_to_disk`. Each row is one document: its
text field (`--text-key`)."""

from __future__ import annotations

import glob
from pathlib import Path

from lattice.parallel.context import LatticeConfigError

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _library():
    try:
        import datasets
    except ImportError:
        raise LatticeConfigError("--data-format hf reads through the datasets library, which is not installed: "
                                 "pip install -e '.[data]' in lattice's checkout (or pip install datasets)") from None
    return datasets


def dataset_files(spec: str) -> list[Path]:
    """The dataset files `--data` names (a save_to_disk directory: every file in it)."""
    path = Path(spec)
    found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else \
        [path] if path.is_file() else sorted(Path(p) for p in glob.glob(spec, recursive=True))
    return [p for p in found if p.suffix in BUILDERS]


def _saved(spec: str) -> bool:
    """Whether `spec` is a directory `save_to_disk` wrote (a Dataset's or a DatasetDict's)."""
    return any(Path(spec, name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def check_dataset(spec: str) -> None:
    """Refuse in one line a `--data` that holds no dataset files, or a missing library."""
    _library()
    if _saved(spec):
        return
    files = dataset_files(spec)
    if not files:
        raise LatticeConfigError(f"--data {spec} holds no dataset files ({', '.join(sorted(set(BUILDERS)))}) and no "
                                 f"save_to_disk directory; point --data-format hf at them")
    kinds = {BUILDERS[p.suffix] for p in files}
    if len(kinds) > 1:
        raise LatticeConfigError(f"--data {spec} mixes dataset files of kinds {', '.join(sorted(kinds))}; give one kind "
                                 f"(or blend them: --data \"0.5 A 0.5 B\")")


def open_dataset(spec: str):
    """The rows of the dataset at `spec`, streamed (a save_to_disk directory: its train split)."""
    datasets = _library()
    check_dataset(spec)
    if _saved(spec):
        loaded = datasets.load_from_disk(spec)
        return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    files = dataset_files(spec)
    return datasets.load_dataset(BUILDERS[files[0].suffix], data_files=[str(p) for p in files], split="train",
                                 streaming=True)


def dataset_texts(spec: str, keys: tuple[str, ...]):
    """Each row's text (`keys`' fields joined by a blank line), or one line naming the first row
    that lacks a field or holds something other than text."""
    for n, row in enumerate(open_dataset(spec)):
        missing = [k for k in keys if k not in row]
        if missing:
            raise LatticeConfigError(f"--data {spec}: row {n} has no column {missing[0]!r} (its columns: "
                                     f"{', '.join(map(repr, row))}); pass --text-key with the text column")
        values = [row[k] for k in keys]
        wrong = next((v for v in values if not isinstance(v, str)), None)
        if wrong is not None:
            raise LatticeConfigError(f"--data {spec}: row {n}'s {keys[values.index(wrong)]!r} is "
                                     f"{type(wrong).__name__}, not text; pass --text-key with the text column")
        yield "\n\n".join(values)
