"""The text of `--data` as documents: which files are text, JSON lines and their fields, and the
documents of either cut into pieces for the tokenizer (`documents`). A text file is one document;
a JSON line is one document (its text field, or the fields of a pair one after another)."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from lattice.parallel.context import LatticeConfigError


def data_files(spec: str) -> list[Path]:
    """The text files of `--data`: one file (refused later if it is not text), or every text file
    of a directory (recursively) or a glob; the others are skipped (`skipped_files`)."""
    return _data_files(spec)[0]


def skipped_files(spec: str) -> str | None:
    """One line on the files of a `--data` directory or glob that are not text and so are not
    trained on (how many, which kinds), or None when there are none."""
    skipped = _data_files(spec)[1]
    if not skipped:
        return None
    kinds = Counter(p.suffix or p.name for p in skipped)
    shown = ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common(6)) + (", ..." if len(kinds) > 6 else "")
    return f"--data {spec}: skipped {len(skipped)} file{'s' * (len(skipped) > 1)} that are not text ({shown})"


def _data_files(spec: str) -> tuple[list[Path], list[Path]]:
    """(text files, files that are not text) of `--data`."""
    import glob

    path = Path(spec)
    if path.is_file():
        return [path], []
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not found:
        raise LatticeConfigError(f"--data {spec} names no file (a file, a directory of files or a glob); "
                                 f"check the path")
    text, other = [], []
    for p in found:
        (text if _text_problem(p) is None else other).append(p)
    if not text:
        raise LatticeConfigError(f"--data {spec} holds no text file ({len(found)} file{'s' * (len(found) > 1)}, none "
                                 f"UTF-8 text); point it at text files")
    return text, other


def json_lines(spec: str, keys: tuple[str, ...], flags: str):
    """(path, line number, the `keys` fields) of every JSON line of `--data`, or one line naming
    the first that lacks them and the flags (`flags`) that name other keys."""
    for path in data_files(spec):
        yield from _json_rows(path, keys, flags)


def _json_rows(path: Path, keys: tuple[str, ...], flags: str):
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                values = tuple(row[k] for k in keys)
            except (ValueError, KeyError, TypeError):
                named = f"a {keys[0]!r} field" if len(keys) == 1 else " and ".join(map(repr, keys)) + " fields"
                raise LatticeConfigError(f"{path}:{n} is not a JSON object with {named}; fix it or pass "
                                         f"{flags}") from None
            yield path, n, values


TEXT_SAMPLE = 1 << 16  # bytes of each --data file looked at before training on it
MAX_UNDECODABLE = 0.01  # the share of a file's sample that may fail to decode as UTF-8


def check_texts(spec: str) -> None:
    """Refuse `--data` without text (every file empty) or with a file that is not text; read
    once per load, not on every pass over the files."""
    files = data_files(spec)
    if not any(p.stat().st_size for p in files):
        raise LatticeConfigError(f"--data {spec} holds no text ({len(files)} empty file{'s' * (len(files) > 1)}); "
                                 f"give it some text")
    for path in files:
        _check_text(path, spec)


def _check_text(path: Path, spec: str) -> None:
    """Refuse a file that is not text (`_text_problem`), naming the file."""
    what = _text_problem(path)
    if what is not None:
        where = f"--data {spec}" if Path(spec) == path else f"--data {spec}: {path}"
        raise LatticeConfigError(f"{where} is not text ({what}); pass text files (UTF-8), or leave that file out "
                                 f"of --data")


def _text_problem(path: Path) -> str | None:
    """Why a file is not text: a NUL byte, or more than 1% of its first 64 KiB not decodable as
    UTF-8 (a binary, an archive, another encoding); None for text."""
    stat = path.stat()
    return _sampled_text_problem(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1 << 16)  # a load lists --data's files several times: each file is sampled once
def _sampled_text_problem(path: Path, mtime_ns: int, size: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(TEXT_SAMPLE)
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - (1 if len(head) == TEXT_SAMPLE and text.endswith("\ufffd") else 0)
    if b"\0" in head:
        return "NUL bytes"
    if bad > MAX_UNDECODABLE * max(1, len(text)):
        return f"{bad} of its first {len(head):,} bytes not UTF-8"
    return None


CHUNK_CHARS = 1 << 20  # text is read, hashed, tokenized and written in pieces of about this size


class Piece(NamedTuple):
    """A piece of a document's text; `first` and `last`: whether it begins or ends the document
    (where the tokenizer's beginning- and end-of-text tokens go)."""

    text: str
    first: bool = True
    last: bool = True


def documents(spec: str, data_format: str = "text", text_key: str | tuple[str, ...] = "text"):
    """The documents of `--data` as Pieces of about CHUNK_CHARS characters ending at a line break,
    never all in memory: each text file one document, each JSON line one (its `text_key`, or each
    of several keys joined by a blank line: both sides of translation pairs), each row of a
    dataset (`hf`, lattice.data.hf_datasets) one."""
    keys = (text_key,) if isinstance(text_key, str) else tuple(text_key)
    if data_format == "hf":
        from lattice.data.hf_datasets import dataset_texts

        for text in dataset_texts(spec, keys):
            yield Piece(text)
        return
    flags = "--text-key" if len(keys) == 1 else "--source-key / --target-key"
    for path in data_files(spec):
        if data_format == "jsonl":
            for _, _, values in _json_rows(path, keys, flags):
                yield Piece("\n\n".join(str(v) for v in values))
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            piece, first = f.read(CHUNK_CHARS), True
            while piece:
                piece += f.readline()  # end at a line break, so no word is cut
                following = f.read(CHUNK_CHARS)
                yield Piece(piece, first, not following)
                piece, first = following, False
