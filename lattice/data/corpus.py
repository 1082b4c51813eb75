"""The built-in corpus or your data as token ids, and the tokenizer (the batches drawn from them are
lattice.data.batches').

The corpus is real English that ships with Python itself: the help topics of `pydoc_data.topics`
(about 0.5 MB), so training needs no download. The tokenizer is a byte-level BPE trained on it
with `tokenizers` (every byte is in the initial alphabet, so any text encodes); it and the token
ids are cached under `$LATTICE_CACHE` (default `~/.cache/lattice`), keyed by a hash of the
corpus and the vocabulary size.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lattice.checkpoint.files import atomic_write
from lattice.data.blend import Blend, parse_blend
from lattice.data.text_files import check_texts, data_files, documents
from lattice.data.token_files import (Separators, document_split, file_identity, flat_tokens, megatron_paths,
                                      megatron_tokens, token_dtype, token_files_present, write_token_file)
from lattice.parallel.context import LatticeConfigError

DEFAULT_VOCAB = 2048
VAL_FRACTION = 0.1


def corpus_documents() -> list[str]:
    """The built-in corpus's documents: pydoc's help topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[k].strip() + "\n" for k in sorted(topics)]


def corpus_text() -> str:
    """The built-in corpus as one text (what its tokenizer is trained on)."""
    return "\n".join(corpus_documents())


def cache_dir() -> Path:
    return Path(os.environ.get("LATTICE_CACHE") or Path.home() / ".cache" / "lattice")


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy does not append ".npy" to the name
        np.save(f, array)


END_OF_TEXT = "<|endoftext|>"  # the end-of-text token of lattice's own BPE (GPT-2's spelling)


def _bpe():
    from tokenizers import ByteLevelBPETokenizer

    return ByteLevelBPETokenizer()


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text` (all 256 bytes in the initial alphabet), with its own
    end-of-text token END_OF_TEXT (id 0), which ends every document."""
    if vocab_size < 258:
        raise LatticeConfigError(f"vocab_size = {vocab_size} is below the 256 byte symbols, the end-of-text token "
                                 f"and one merge; use at least 258 (default {DEFAULT_VOCAB})")
    tok = _bpe()
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=[END_OF_TEXT])
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
    """Token ids split into train and validation, plus the tokenizer (None for token files read
    without one). A split is a tensor, a memory-mapped array, or a Blend of several."""

    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64
    vocab_size: int
    tokenizer: object
    key: str  # cache key: hash of the corpus text and vocabulary size
    content_hash: str | None = None  # identity of own data (`data_hash`), None for the built-in corpus
    specials: dict = field(default_factory=dict)  # role -> id of the tokenizer's own special tokens
    about: list = field(default_factory=list)  # lines on own data: its documents' separators, its split
    #: where the documents of each split start, one array per source (a Blend's parts), or None
    #: where the data mark no documents (a flat token file read without a tokenizer)
    train_documents: list | None = None
    val_documents: list | None = None

    def encode(self, text: str) -> list[int]:
        """The text's token ids, without the special tokens a pretrained tokenizer's post-processor
        adds ([CLS] .. [SEP]): the tasks place their own."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


#: --data-format: text files and JSON lines (tokenized here), a flat token file (nanoGPT's .bin),
#: Megatron's indexed .bin/.idx, and HF `datasets` (parquet, arrow, JSON; the `data` extra)
DATA_FORMATS = ("text", "jsonl", "tokens", "megatron", "hf")
TOKENIZED = ("tokens", "megatron")  # formats that hold token ids, read as they are


def sources_of(spec: str) -> list[tuple[float, str]]:
    """[(weight, path)] of `--data`: one source of weight 1, or a blend's (lattice.data.blend)."""
    return parse_blend(spec) or [(1.0, spec)]


def listed_files(spec: str, data_format: str) -> list[str]:
    """The files `--data` reads, as a run's data.json lists them."""
    files = []
    for _, path in sources_of(spec):
        if data_format == "megatron":
            files += [str(p) for p in megatron_paths(path)]
        elif data_format == "hf":
            from lattice.data.hf_datasets import dataset_files

            files += [str(p) for p in dataset_files(path)]
        elif data_format == "tokens":
            files.append(path)
        else:
            files += [str(p) for p in data_files(path)]
    return files


def _source_hash(path: str, data_format: str, text_key) -> str:
    if data_format in TOKENIZED:
        return file_identity(*token_files_present(path, data_format))
    named = text_key if isinstance(text_key, str) else "\0".join(text_key)
    h = hashlib.sha256(f"{data_format}\0{named}\0".encode())
    for piece in documents(path, data_format, text_key):
        h.update(f"{piece.first:d}{piece.last:d}".encode() + piece.text.encode())
    return h.hexdigest()[:16]


def data_hash(spec: str, data_format: str = "text", text_key: str | tuple[str, ...] = "text") -> str:
    """Identity of `--data`'s content (its documents read in pieces; a token file's sampled
    blocks, lattice.data.token_files.file_identity), and of a blend's weights."""
    return _blend_hash(sources_of(spec), {p: _source_hash(p, data_format, text_key) for _, p in sources_of(spec)})


def _blend_hash(blend: list[tuple[float, str]], hashes: dict[str, str]) -> str:
    """`data_hash` from each source's own (`hashes`, by path)."""
    if len(blend) == 1:
        return hashes[blend[0][1]]
    named = "\0".join(f"{w!r}:{hashes[p]}" for w, p in blend)
    return hashlib.sha256(named.encode()).hexdigest()[:16]


@dataclass
class _Source:
    tokens: np.ndarray
    starts: np.ndarray | None  # the first token of each document; None: a flat token file marks none
    name: str


def _data_tokenizer(hashes: dict[str, str], vocab_size: int, data_format: str, text_key, given: Path | None,
                    tokenizer_path: str | None):
    """The tokenizer of own data: the one given, else (text) a byte-level BPE trained on every
    source's documents (cached by their content: `hashes`, by path), else (token files) None."""
    if given:
        return _checked_tokenizer(given, vocab_size, tokenizer_path)
    if data_format in TOKENIZED:
        return None
    from tokenizers import Tokenizer

    key = hashlib.sha256("\0".join(hashes.values()).encode()).hexdigest()[:16]
    path = cache_dir() / f"bpe-data-{vocab_size}-{key}" / "tokenizer.json"
    if not path.exists():
        train_tokenizer("", vocab_size)  # the vocabulary-size check
        bpe = _bpe()
        texts = (piece.text for p in hashes for piece in documents(p, data_format, text_key))
        bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                special_tokens=[END_OF_TEXT])
        atomic_write(path, lambda tmp: bpe.save(tmp))
    return Tokenizer.from_file(str(path))


def _text_source(path: str, vocab_size: int, data_format: str, text_key, tokenizer, separators: Separators,
                 salt: str, content: str) -> _Source:
    """A text source tokenized once into a memory-mapped token file and its documents' starts,
    cached by its `content` hash and the tokenizer."""
    if data_format != "hf":
        check_texts(path)
    root = cache_dir() / f"data-{vocab_size}-{content}-{salt}"
    ids_path, starts_path = root / "tokens.bin", root / "documents.npy"
    dtype = token_dtype(vocab_size)
    if not (ids_path.exists() and starts_path.exists()):
        total = 0 if data_format == "hf" else sum(f.stat().st_size for f in data_files(path))
        written = {}

        def write_tokens(tmp):
            written["starts"] = write_token_file(tmp, tokenizer, documents(path, data_format, text_key), dtype,
                                                 separators=separators, total=total).starts

        atomic_write(ids_path, write_tokens)
        atomic_write(starts_path, lambda tmp: _save_npy(tmp, written["starts"]))
    tokens = np.memmap(ids_path, dtype=dtype, mode="r") if ids_path.stat().st_size else np.zeros(0, dtype)
    return _Source(tokens, np.load(starts_path), path)


def _token_source(path: str, vocab_size: int, data_format: str, separators: Separators | None) -> _Source:
    if data_format == "megatron":
        tokens, starts = megatron_tokens(path, vocab_size)
        return _Source(tokens, starts, path)
    tokens = flat_tokens(Path(path), vocab_size)
    if separators is None or len(separators.eos) != 1:
        return _Source(tokens, None, path)
    ends = np.concatenate([np.flatnonzero(np.asarray(tokens[i:i + (1 << 24)]) == separators.eos[0]) + i
                           for i in range(0, len(tokens), 1 << 24)] or [np.empty(0, np.int64)])
    return _Source(tokens, np.concatenate([[0], ends + 1]).astype(np.int64), path)  # a document after each eos


def _sources(spec: str, vocab_size: int, data_format: str, text_key, tokenizer, separators, salt,
             hashes: dict[str, str]) -> list[_Source]:
    out = []
    for _, path in sources_of(spec):
        if data_format in TOKENIZED:
            out.append(_token_source(path, vocab_size, data_format, separators))
        else:
            out.append(_text_source(path, vocab_size, data_format, text_key, tokenizer, separators, salt, hashes[path]))
        if len(out[-1].tokens) < 2:
            raise LatticeConfigError(f"--data {path} holds {len(out[-1].tokens)} tokens; give it some text")
    return out


def load_data_corpus(spec: str, vocab_size: int, *, data_format: str = "text",
                     text_key: str | tuple[str, ...] = "text", tokenizer_path: str | None = None,
                     val_data: str | None = None) -> Corpus:
    """Your own data: text (text files, JSON lines, a dataset) tokenized once into a memory-mapped
    token file (uint16, or uint32 beyond 65536 tokens) cached by content hash, each document
    followed by the tokenizer's end-of-text token (and preceded by its beginning-of-text token
    where the tokenizer adds one); or token files read as they are. A corpus larger than memory
    trains with bounded memory: batches read only their windows. A byte-level BPE (with its own
    <|endoftext|>) is trained on the text unless `tokenizer_path` gives one. The validation split
    is `val_data`, else the last VAL_FRACTION of each source's documents (whole documents)."""
    blend = sources_of(spec)
    validation = sources_of(val_data) if val_data else []
    given = _given_tokenizer(tokenizer_path)
    hashes = {p: _source_hash(p, data_format, text_key) for _, p in blend + validation}  # one pass over the data
    tokenizer = _data_tokenizer(hashes, vocab_size, data_format, text_key, given, tokenizer_path)
    specials = tokenizer_specials(tokenizer, given.parent if given else None) if tokenizer is not None else {}
    separators = None if tokenizer is None else Separators.of(tokenizer, specials, _adds_bos(given))
    salt = hashlib.sha256(given.read_bytes()).hexdigest()[:16] if given else "bpe"
    train = _sources(spec, vocab_size, data_format, text_key, tokenizer, separators, salt, hashes)
    if validation:
        val = _sources(val_data, vocab_size, data_format, text_key, tokenizer, separators, salt, hashes)
        about = [f"validation: --val-data {val_data}"]
        train_parts, val_parts = [s.tokens for s in train], [v.tokens for v in val]
        train_docs, val_docs = [s.starts for s in train], [v.starts for v in val]
    else:
        about, train_parts, val_parts, train_docs, val_docs = [], [], [], [], []
        for s in train:
            at, line = document_split(len(s.tokens), s.starts, VAL_FRACTION)
            train_parts.append(s.tokens[:at])
            val_parts.append(s.tokens[at:])
            train_docs.append(None if s.starts is None else s.starts[s.starts < at])
            val_docs.append(None if s.starts is None else s.starts[s.starts >= at] - at)
            about.append(line if len(train) == 1 else f"{s.name}: {line}")
    weights, names = [w for w, _ in blend], [p for _, p in blend]
    if separators is not None:
        about.insert(0, f"documents: {separators.how}")
    return Corpus(train=_blended(train_parts, weights, names), val=_blended(val_parts, [w for w, _ in validation]
                                                                             or weights, [p for _, p in validation] or names),
                  vocab_size=vocab_size, tokenizer=tokenizer, key=f"{_blend_hash(blend, hashes)}-{salt}",
                  content_hash=_blend_hash(blend, hashes), specials=specials, about=about,
                  train_documents=None if any(d is None for d in train_docs) else train_docs,
                  val_documents=None if any(d is None for d in val_docs) else val_docs)


def _blended(parts: list, weights: list[float], names: list[str]):
    return parts[0] if len(parts) == 1 else Blend(parts, weights, names)


def _adds_bos(given: Path | None) -> bool | None:
    """A tokenizer_config.json's add_bos_token beside the tokenizer, where it says."""
    import json

    config = given.parent / "tokenizer_config.json" if given else None
    if config is None or not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("add_bos_token")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def check_data(data: str | None, tokenizer_path: str | None, vocab_size: int | None = None,
               data_format: str = "text") -> None:
    """`--data` and `--tokenizer` refused in one line if they cannot be trained on: no file, no
    text, a file that is not text, a blend's weights that do not parse, a missing `datasets`, a
    tokenizer that does not parse or whose vocabulary does not fit `vocab_size` (before any
    process group; token files are checked as they are read, `load_data_corpus`)."""
    for _, path in sources_of(data) if data is not None else []:
        if data_format in ("text", "jsonl"):
            check_texts(path)
        elif data_format == "hf":
            from lattice.data.hf_datasets import check_dataset

            check_dataset(path)
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
    directory holding one, e.g. a local HF tokenizer or a lattice run directory); each topic is a
    document, followed by the end-of-text token as own data's are.

    The last VAL_FRACTION of the documents is the validation split (contiguous, so no validation
    window overlaps training text)."""
    from tokenizers import Tokenizer

    text = corpus_text()
    given = _given_tokenizer(tokenizer_path)
    salt = given.read_text() if given else ""
    key = hashlib.sha256(f"{vocab_size}\0{salt}\0documents\0{text}".encode()).hexdigest()[:16]
    root = cache_dir() / f"bpe-{vocab_size}-{key}"
    tok_path, ids_path, starts_path = root / "tokenizer.json", root / "ids.npy", root / "documents.npy"
    specials = {}
    if not (tok_path.exists() and ids_path.exists() and starts_path.exists()):
        bpe = _checked_tokenizer(given, vocab_size, tokenizer_path) if given else train_tokenizer(text, vocab_size)
        specials = tokenizer_specials(bpe, given.parent if given else None)
        separators = Separators.of(bpe, specials, _adds_bos(given))
        encoded = [list(separators.bos) + e.ids + list(separators.eos)
                   for e in bpe.encode_batch(corpus_documents(), add_special_tokens=False)]
        ids = np.asarray([i for e in encoded for i in e], dtype=np.int32)
        starts = np.cumsum([0] + [len(e) for e in encoded[:-1]]).astype(np.int64)
        atomic_write(tok_path, lambda tmp: bpe.save(tmp))
        atomic_write(ids_path, lambda tmp: _save_npy(tmp, ids))
        atomic_write(starts_path, lambda tmp: _save_npy(tmp, starts))
    tokenizer = Tokenizer.from_file(str(tok_path))
    ids = torch.from_numpy(np.load(ids_path).astype(np.int64))
    starts = np.load(starts_path)
    split, _ = document_split(len(ids), starts, VAL_FRACTION)
    return Corpus(train=ids[:split], val=ids[split:], vocab_size=vocab_size, tokenizer=tokenizer, key=key,
                  specials=tokenizer_specials(tokenizer, given.parent if given else None),
                  train_documents=[starts[starts < split]], val_documents=[starts[starts >= split] - split])


def unigram_baseline(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) of the validation tokens under the training split's unigram
    frequencies with add-one smoothing: what a model that ignores context can reach."""
    counts = np.ones(corpus.vocab_size, dtype=np.float64)
    val_total, val_count = 0.0, 0
    for part in parts_of(corpus.train):
        for start in range(0, len(part), 1 << 22):  # in pieces: the splits may be memory-mapped
            counts += np.bincount(np.asarray(part[start:start + (1 << 22)]), minlength=corpus.vocab_size)
    log_p = np.log(counts) - np.log(counts.sum())
    for part in parts_of(corpus.val):
        for start in range(0, len(part), 1 << 22):
            piece = np.asarray(part[start:start + (1 << 22)], dtype=np.int64)
            val_total += float(-log_p[piece].sum())
            val_count += len(piece)
    return val_total / val_count


def parts_of(tokens) -> list:
    """The token streams of a split: a Blend's sources, else the split itself."""
    return list(tokens.parts) if isinstance(tokens, Blend) else [tokens]
