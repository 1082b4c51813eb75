"""The built-in corpus or your data as token ids, and the tokenizer (the batches drawn from them are
lattice.data.batches').

The corpus is real English that ships with Python itself: the help topics of `pydoc_data.topics`
(about 0.5 MB), so training needs no download. The tokenizer is a byte-level BPE trained on it
with `tokenizers` (every byte is in the initial alphabet, so any text encodes); it and the token
ids are cached under `$LATTICE_CACHE` (default `~/.cache/lattice`), keyed by a hash of the
corpus and the vocabulary size.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


import numpy as np
import torch

from lattice.checkpoint.files import atomic_write
from lattice.parallel.context import LatticeConfigError

DEFAULT_VOCAB = 2048
VAL_FRACTION = 0.1


def corpus_text() -> str:
    """The built-in corpus: pydoc's help topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"


def cache_dir() -> Path:
    return Path(os.environ.get("LATTICE_CACHE") or Path.home() / ".cache" / "lattice")


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy does not append ".npy" to the name
        np.save(f, array)


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text` (all 256 bytes in the initial alphabet)."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise LatticeConfigError(f"vocab_size = {vocab_size} is below the 256 byte symbols plus one merge; "
                                 f"use at least 257 (default {DEFAULT_VOCAB})")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return tok


# the usual spellings of each role of a special token, where no tokenizer_config.json names it
SPECIAL_SPELLINGS = {"cls": ("[CLS]",), "sep": ("[SEP]",), "pad": ("[PAD]", "<pad>"), "mask": ("[MASK]", "<mask>"),
                     "bos": ("<s>", "<|begin_of_text|>"), "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>"),
                     "unk": ("[UNK]", "<unk>")}
SPECIALS_FILE = "special_tokens_map.json"  # transformers' name; a run writes it beside its tokenizer.json


def tokenizer_specials(tokenizer, directory: Path | None = None) -> dict[str, int]:
    """The id of each role (cls, sep, pad, mask, bos, eos, unk) a tokenizer has a token for: those
    its special_tokens_map.json or tokenizer_config.json in `directory` name (`cls_token`, ...),
    else the usual spellings among its special tokens. {} for lattice's own BPE (it has none)."""
    import json

    found: dict[str, int] = {}
    for name in (SPECIALS_FILE, "tokenizer_config.json"):
        path = directory / name if directory is not None else None
        if path is None or not path.is_file():
            continue
        try:
            named = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LatticeConfigError(f"{path} is not a JSON file ({e}); repair it or remove it") from None
        for role in SPECIAL_SPELLINGS:
            token = named.get(f"{role}_token") if isinstance(named, dict) else None
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
                found.setdefault(role, tokenizer.token_to_id(token))
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for role, spellings in SPECIAL_SPELLINGS.items():
        spelled = next((s for s in spellings if s in special), None)
        if role not in found and spelled is not None:
            found[role] = tokenizer.token_to_id(spelled)
    return found


def write_specials(corpus: "Corpus", directory: Path) -> None:
    """The corpus tokenizer's special tokens as special_tokens_map.json in `directory` (beside the
    tokenizer.json a run keeps), so that the run, its exports and transformers read the same."""
    import json

    if corpus.specials:
        named = {f"{role}_token": corpus.tokenizer.id_to_token(i) for role, i in corpus.specials.items()}
        atomic_write(directory / SPECIALS_FILE, lambda tmp: Path(tmp).write_text(json.dumps(named, indent=1)))


@dataclass
class Corpus:
    """Token ids of the built-in corpus split into train and validation, plus the tokenizer."""

    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64
    vocab_size: int
    tokenizer: object
    key: str  # cache key: hash of the corpus text and vocabulary size
    content_hash: str | None = None  # identity of own data (`data_hash`), None for the built-in corpus
    specials: dict = field(default_factory=dict)  # role -> id of the tokenizer's own special tokens

    def encode(self, text: str) -> list[int]:
        """The text's token ids, without the special tokens a pretrained tokenizer's post-processor
        adds ([CLS] .. [SEP]): the tasks place their own."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


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


def _check_texts(spec: str) -> None:
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


def data_chunks(spec: str, data_format: str = "text", text_key: str | tuple[str, ...] = "text"):
    """The text of `--data` in pieces of about CHUNK_CHARS ending at a line break (files
    separated by a blank line; JSON lines contribute their `text_key`, or each of several keys:
    both sides of translation pairs), never all in memory."""
    keys = (text_key,) if isinstance(text_key, str) else tuple(text_key)
    flags = "--text-key" if len(keys) == 1 else "--source-key / --target-key"
    for i, path in enumerate(data_files(spec)):
        if i:
            yield "\n\n"
        if data_format == "jsonl":
            for _, _, values in _json_rows(path, keys, flags):
                yield "".join(str(v) + "\n\n" for v in values)
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            while True:
                piece = f.read(CHUNK_CHARS)
                if not piece:
                    break
                yield piece + f.readline()  # end at a line break, so no word is cut


ENCODE_BATCH = 8  # pieces encoded at once, on every core (the tokenizers library's threads)


def write_token_file(path, tokenizer, pieces, dtype, *, total: int = 0) -> tuple[int, int, float]:
    """Encode the text `pieces` with `tokenizer`, ENCODE_BATCH pieces at a time through its
    `encode_batch` (which runs on every core; the ids are those `encode` gives each piece), into
    the flat token file `path`; a progress bar on a terminal (`total`: about how many characters
    there are) and one line at the end with the throughput. Returns (characters, tokens, seconds)."""
    import sys
    import time

    from tqdm.auto import tqdm

    start, chars, tokens = time.perf_counter(), 0, 0
    shown = sys.stderr is not None and sys.stderr.isatty()
    with open(path, "wb") as f, tqdm(total=total or None, unit="char", unit_scale=True, desc="tokenizing",
                                     disable=not shown, leave=False) as bar:
        batch = []
        for piece in itertools.chain(pieces, [None]):  # streamed: None ends the last batch
            if piece is not None:
                batch.append(piece)
            if batch and (piece is None or len(batch) == ENCODE_BATCH):
                for encoded in tokenizer.encode_batch(batch):
                    f.write(np.asarray(encoded.ids, dtype=dtype).tobytes())
                    tokens += len(encoded.ids)
                size = sum(map(len, batch))
                chars += size
                bar.update(size)
                batch = []
    seconds = time.perf_counter() - start
    print(f"tokenized {chars / 1e6:,.1f} M characters into {tokens:,} tokens in {seconds:.1f} s "
          f"({chars / 1e6 / max(seconds, 1e-9):,.1f} M characters/s)", flush=True)
    return chars, tokens, seconds


def data_hash(spec: str, data_format: str = "text", text_key: str | tuple[str, ...] = "text") -> str:
    """Identity of `--data`'s content (read in pieces)."""
    named = text_key if isinstance(text_key, str) else "\0".join(text_key)
    h = hashlib.sha256(f"{data_format}\0{named}\0".encode())
    for piece in data_chunks(spec, data_format, text_key):
        h.update(piece.encode())
    return h.hexdigest()[:16]


def load_data_corpus(spec: str, vocab_size: int, *, data_format: str = "text",
                     text_key: str | tuple[str, ...] = "text", tokenizer_path: str | None = None) -> Corpus:
    """Your own text, tokenized once (in pieces) into a memory-mapped token file (uint16, or
    uint32 beyond 65536 tokens) cached by content hash, so that a corpus larger than memory
    trains with bounded memory: batches read only their windows. A byte-level BPE is trained on
    the text (streamed) unless `tokenizer_path` gives one."""
    from tokenizers import Tokenizer

    _check_texts(spec)
    given = _given_tokenizer(tokenizer_path)
    salt = hashlib.sha256(given.read_bytes()).hexdigest()[:16] if given else "bpe"
    content = data_hash(spec, data_format, text_key)
    key = f"{content}-{salt}"
    root = cache_dir() / f"data-{vocab_size}-{key}"
    tok_path, ids_path = root / "tokenizer.json", root / "tokens.bin"
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    if not (tok_path.exists() and ids_path.exists()):
        if given:
            bpe = _checked_tokenizer(given, vocab_size, tokenizer_path)
        else:
            from tokenizers import ByteLevelBPETokenizer

            train_tokenizer("", vocab_size)  # the vocabulary-size check
            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator(data_chunks(spec, data_format, text_key), vocab_size=vocab_size,
                                    min_frequency=2, show_progress=False)

        def write_tokens(tmp):
            write_token_file(tmp, bpe, data_chunks(spec, data_format, text_key), dtype,
                             total=sum(f.stat().st_size for f in data_files(spec)))

        atomic_write(tok_path, lambda tmp: bpe.save(tmp))
        atomic_write(ids_path, write_tokens)
    ids = np.memmap(ids_path, dtype=dtype, mode="r")
    if len(ids) < 2:
        raise LatticeConfigError(f"--data {spec} holds {len(ids)} tokens; give it some text")
    split = len(ids) - int(len(ids) * VAL_FRACTION)
    tokenizer = Tokenizer.from_file(str(tok_path))
    return Corpus(train=ids[:split], val=ids[split:], vocab_size=vocab_size, tokenizer=tokenizer, key=key,
                  content_hash=content, specials=tokenizer_specials(tokenizer, given.parent) if given else {})


def check_data(data: str | None, tokenizer_path: str | None, vocab_size: int | None = None) -> None:
    """`--data` and `--tokenizer` refused in one line if they cannot be trained on: no file, no
    text, a file that is not text, a tokenizer that does not parse or whose vocabulary does not
    fit `vocab_size` (before any process group)."""
    if data is not None:
        _check_texts(data)
    given = _given_tokenizer(tokenizer_path)
    if given is not None and vocab_size is not None:
        _checked_tokenizer(given, vocab_size, tokenizer_path)


def read_tokenizer(path: Path, named: str, fix: str):
    """The tokenizer in `path`, or one line naming it (`named`: how the user knows the file) and
    `fix`, when the tokenizers library cannot read it."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception for a file it cannot parse
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise LatticeConfigError(f"{named} {path} is not a tokenizer the tokenizers library reads ({reason}); "
                                 f"{fix}") from None


def _given_tokenizer(tokenizer_path: str | None) -> Path | None:
    """The tokenizer.json `--tokenizer` names, refused in one line unless the tokenizers library
    reads it."""
    if not tokenizer_path:
        return None
    given = Path(tokenizer_path) / "tokenizer.json" if Path(tokenizer_path).is_dir() else Path(tokenizer_path)
    if not given.is_file():
        raise LatticeConfigError(f"--tokenizer {tokenizer_path} has no tokenizer.json; pass a tokenizer.json or a "
                                 f"directory holding one")
    read_tokenizer(given, "--tokenizer", "pass the tokenizer.json of a lattice run or of a HuggingFace tokenizer")
    return given


def _checked_tokenizer(given: Path, vocab_size: int, tokenizer_path: str):
    bpe = read_tokenizer(given, "--tokenizer", "pass the tokenizer.json of a lattice run or of a HuggingFace tokenizer")
    if bpe.get_vocab_size() > vocab_size:
        raise LatticeConfigError(f"--tokenizer {tokenizer_path} has {bpe.get_vocab_size()} tokens but --vocab-size is "
                                 f"{vocab_size}; pass --vocab-size {bpe.get_vocab_size()}")
    return bpe


def load_corpus(vocab_size: int = DEFAULT_VOCAB, *, tokenizer_path: str | None = None) -> Corpus:
    """Tokenize the built-in corpus, from the cache (`cache_dir()`) when possible, with a
    byte-level BPE trained on it or the tokenizer at `tokenizer_path` (a tokenizer.json, or a
    directory holding one, e.g. a local HF tokenizer or a lattice run directory).

    The last VAL_FRACTION of the tokens is the validation split (contiguous, so no validation
    window overlaps training text)."""
    from tokenizers import Tokenizer

    text = corpus_text()
    given = _given_tokenizer(tokenizer_path)
    salt = given.read_text() if given else ""
    key = hashlib.sha256(f"{vocab_size}\0{salt}\0{text}".encode()).hexdigest()[:16]
    root = cache_dir() / f"bpe-{vocab_size}-{key}"
    tok_path, ids_path = root / "tokenizer.json", root / "ids.npy"
    if not (tok_path.exists() and ids_path.exists()):
        bpe = _checked_tokenizer(given, vocab_size, tokenizer_path) if given else train_tokenizer(text, vocab_size)
        atomic_write(tok_path, lambda tmp: bpe.save(tmp))
        ids = np.asarray(bpe.encode(text).ids, dtype=np.int32)
        atomic_write(ids_path, lambda tmp: _save_npy(tmp, ids))
    tokenizer = Tokenizer.from_file(str(tok_path))
    ids = np.load(ids_path)
    ids = torch.from_numpy(ids.astype(np.int64))
    split = len(ids) - int(len(ids) * VAL_FRACTION)
    return Corpus(train=ids[:split], val=ids[split:], vocab_size=vocab_size, tokenizer=tokenizer, key=key,
                  specials=tokenizer_specials(tokenizer, given.parent) if given else {})


def unigram_baseline(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) of the validation tokens under the training split's unigram
    frequencies with add-one smoothing: what a model that ignores context can reach."""
    counts = np.ones(corpus.vocab_size, dtype=np.float64)
    val_total, val_count = 0.0, 0
    for start in range(0, len(corpus.train), 1 << 22):  # in pieces: the splits may be memory-mapped
        counts += np.bincount(np.asarray(corpus.train[start:start + (1 << 22)]), minlength=corpus.vocab_size)
    log_p = np.log(counts) - np.log(counts.sum())
    for start in range(0, len(corpus.val), 1 << 22):
        piece = np.asarray(corpus.val[start:start + (1 << 22)], dtype=np.int64)
        val_total += float(-log_p[piece].sum())
        val_count += len(piece)
    return val_total / val_count
