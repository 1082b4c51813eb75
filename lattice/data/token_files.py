"""Token files: the flat token file lattice writes from text (with each document's beginning- and
end-of-text tokens, and where each document starts), and the two that pretraining brings already
tokenized: nanoGPT's flat `.bin` (uint16 ids, uint32 beyond 65,536 tokens) and Megatron-LM's
indexed `.bin`/`.idx` pair (its documents kept). Every one is memory-mapped: a batch reads only
its windows.

Megatron's `.idx` (version 1): the 9 bytes b"MMIDIDX\\x00\\x00", then little-endian u64 version,
u8 dtype code, u64 sequence count S, u64 document-index count D; then S int32 sequence lengths,
S int64 byte offsets of the sequences in the `.bin`, and D int64 document indices (the first
sequence of each document, 0 first and S last).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lattice.parallel.context import LatticeConfigError

ENCODE_BATCH = 8  # a batch for encode_batch holds about this many CHUNK_CHARS pieces (on every core)
BATCH_PIECES = 4096  # and at most this many pieces (many short JSON-line documents)


@dataclass(frozen=True)
class Separators:
    """The ids written before and after each document: the tokenizer's beginning-of-text token
    where the tokenizer itself adds one (Llama's <|begin_of_text|>), and its end-of-text token
    (GPT-2's <|endoftext|>, Llama-3's <|end_of_text|>; an encoder's [SEP] where it has no other),
    else a blank line's ids, named in `how`."""

    bos: tuple[int, ...]
    eos: tuple[int, ...]
    how: str

    @classmethod
    def of(cls, tokenizer, specials: dict, adds_bos: bool | None = None) -> "Separators":
        """`adds_bos`: the tokenizer_config.json's add_bos_token where it says; else whether the
        tokenizer's post-processor puts its bos before a text."""
        bos = specials.get("bos")
        if adds_bos is None and bos is not None:
            adds_bos = tokenizer.encode("a").ids[:1] == [bos] != tokenizer.encode("a", add_special_tokens=False).ids[:1]
        before = (bos,) if adds_bos and bos is not None else ()
        end = specials.get("eos", specials.get("sep"))
        named = "".join(f"{tokenizer.id_to_token(i)} " for i in before) + "document"
        if end is None:
            blank = tuple(tokenizer.encode("\n\n", add_special_tokens=False).ids)
            return cls(before, blank, f"{named} + a blank line (the tokenizer has no end-of-text token)")
        return cls(before, (end,), f"{named} {tokenizer.id_to_token(end)}")


class Tokenized(NamedTuple):
    chars: int
    tokens: int
    seconds: float
    starts: np.ndarray  # (documents,) int64: the first token of each document


def write_token_file(path, tokenizer, pieces, dtype, *, separators: Separators | None = None,
                     total: int = 0) -> Tokenized:
    """Encode the documents' `pieces` (lattice.data.text_files.Piece) with `tokenizer` into the flat
    token file `path`: each piece's ids as `encode(text, add_special_tokens=False)` gives them, the
    separators' bos before a document's first piece and eos after its last. Encoded in batches
    through `encode_batch` (every core), streamed; a progress bar on a terminal, else (a log) a line
    at every tenth of `total` (about how many characters there are), and one line at the end with
    the throughput."""
    from tqdm.auto import tqdm

    bos, eos = (separators.bos, separators.eos) if separators else ((), ())
    start, chars, tokens, starts, reported = time.perf_counter(), 0, 0, [], 0
    shown = sys.stderr is not None and sys.stderr.isatty()
    with open(path, "wb") as f, tqdm(total=total or None, unit="char", unit_scale=True, desc="tokenizing",
                                     disable=not shown, leave=False) as bar:
        batch, size = [], 0
        for piece in itertools.chain(pieces, [None]):  # streamed: None ends the last batch
            if piece is not None:
                batch.append(piece)
                size += len(piece.text)
            if batch and (piece is None or size >= ENCODE_BATCH * (1 << 20) or len(batch) >= BATCH_PIECES):
                encoded = tokenizer.encode_batch([p.text for p in batch], add_special_tokens=False)
                for p, e in zip(batch, encoded):
                    ids = (bos if p.first else ()) + tuple(e.ids) + (eos if p.last else ())
                    if p.first:
                        starts.append(tokens)
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
                    tokens += len(ids)
                chars += size
                bar.update(size)
                batch, size = [], 0
                if not shown and total and chars * 10 // total > reported:  # a log: a line every tenth
                    reported = chars * 10 // total
                    elapsed = time.perf_counter() - start
                    print(f"tokenizing: {chars / 1e6:,.1f} of about {total / 1e6:,.1f} M characters "
                          f"({min(chars / total, 1):.0%}) in {elapsed:.1f} s", flush=True)
    seconds = time.perf_counter() - start
    print(f"tokenized {chars / 1e6:,.1f} M characters ({len(starts):,} document{'s' * (len(starts) != 1)}) into {tokens:,} tokens in "
          f"{seconds:.1f} s ({chars / 1e6 / max(seconds, 1e-9):,.1f} M characters/s)", flush=True)
    return Tokenized(chars, tokens, seconds, np.asarray(starts, dtype=np.int64))


def token_dtype(vocab_size: int):
    """The ids' type in a flat token file: uint16 up to 65,536 tokens (nanoGPT's), else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def check_ids(tokens: np.ndarray, vocab_size: int, named: str) -> None:
    """Refuse ids at or beyond the vocabulary (read in pieces), naming the largest and the fix."""
    high = max((int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24)), default=0)
    if high >= vocab_size:
        raise LatticeConfigError(f"{named} holds token id {high}, beyond --vocab-size {vocab_size}; pass --vocab-size "
                                 f"{high + 1} or more (the tokenizer's vocabulary)")


def flat_tokens(path: Path, vocab_size: int) -> np.ndarray:
    """nanoGPT's flat token file (uint16, or uint32 beyond 65,536 tokens), memory-mapped."""
    dtype = token_dtype(vocab_size)
    size = token_files_present(str(path), "tokens")[0].stat().st_size
    if size == 0 or size % np.dtype(dtype).itemsize:
        raise LatticeConfigError(f"--data {path} holds {size} bytes, not a whole number of {np.dtype(dtype).name} "
                                 f"token ids (--vocab-size {vocab_size}); check the file and --vocab-size")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    check_ids(tokens, vocab_size, f"--data {path}")
    return tokens


MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}


def megatron_paths(spec: str) -> tuple[Path, Path]:
    """(`.bin`, `.idx`) of a Megatron dataset named by its prefix or either file."""
    prefix = spec[:-4] if spec.endswith((".bin", ".idx")) else spec
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def token_files_present(spec: str, data_format: str) -> tuple[Path, ...]:
    """The files of a token source (`tokens`: the file; `megatron`: its .bin and .idx), refused in
    one line where one is missing."""
    if data_format == "tokens":
        if not Path(spec).is_file():
            raise LatticeConfigError(f"--data {spec} is not a file; --data-format tokens reads a flat token file "
                                     f"(nanoGPT's train.bin)")
        return (Path(spec),)
    for p in megatron_paths(spec):
        if not p.is_file():
            raise LatticeConfigError(f"--data {spec}: {p} is missing; --data-format megatron reads a .bin and its "
                                     f".idx (Megatron's preprocess_data.py output), named by their common prefix")
    return megatron_paths(spec)


def megatron_tokens(spec: str, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, the first token of each document) of Megatron's indexed `.bin`/`.idx`, refused in
    one line where the index does not parse or does not match its `.bin`."""
    bin_path, idx_path = token_files_present(spec, "megatron")
    bad = f"--data {spec}: {idx_path} is not a Megatron index"
    with open(idx_path, "rb") as f:
        head = f.read(34)
    if head[:9] != MEGATRON_HEADER or len(head) < 34:
        raise LatticeConfigError(f"{bad} (it does not start with MMIDIDX); rebuild it with preprocess_data.py")
    version, code, count, doc_count = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code] in (np.float32, np.float64):
        raise LatticeConfigError(f"{bad} lattice reads (version {version}, dtype code {code}; version 1 with integer "
                                 f"ids is read)")
    if idx_path.stat().st_size < 34 + 12 * count + 8 * doc_count:
        raise LatticeConfigError(f"{bad}: it lists {count} sequences and {doc_count} document indices but holds "
                                 f"{idx_path.stat().st_size} bytes (truncated?); rebuild it")
    # memory-mapped: an index of 10^8 sequences is gigabytes
    lengths = np.memmap(idx_path, np.int32, "r", 34, (count,)) if count else np.zeros(0, np.int32)
    pointers = np.memmap(idx_path, np.int64, "r", 34 + 4 * count, (count,)) if count else np.zeros(0, np.int64)
    doc_index = np.memmap(idx_path, np.int64, "r", 34 + 12 * count, (doc_count,)) if doc_count else np.zeros(0)
    dtype = MEGATRON_DTYPES[code]
    item, size = np.dtype(dtype).itemsize, bin_path.stat().st_size
    if not _contiguous(lengths, pointers, item, size):
        raise LatticeConfigError(f"--data {spec}: {idx_path} does not match {bin_path} (its sequences do not cover "
                                 f"the .bin's {size} bytes one after another); rebuild the pair together")
    if doc_count < 2 or doc_index[0] != 0 or doc_index[-1] != count or np.any(np.diff(doc_index) < 0):
        raise LatticeConfigError(f"{bad}: its document indices do not run from 0 to the {count} sequences; "
                                 f"rebuild it")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    check_ids(tokens, vocab_size, f"--data {spec}")
    first = np.asarray(doc_index[:-1])
    starts = np.unique(np.where(first < count, np.asarray(pointers)[np.minimum(first, count - 1)] // item, len(tokens)))
    return tokens, starts[starts < len(tokens)]


def _contiguous(lengths, pointers, item: int, size: int) -> bool:
    """Whether the sequences lie one after another from byte 0 and end at the .bin's last byte
    (checked in pieces)."""
    if not len(lengths):
        return size == 0
    end = 0
    for i in range(0, len(lengths), 1 << 24):
        length = np.asarray(lengths[i:i + (1 << 24)], dtype=np.int64) * item
        at = np.asarray(pointers[i:i + (1 << 24)])
        if at[0] != end or np.any(at[1:] != at[:-1] + length[:-1]):
            return False
        end = int(at[-1] + length[-1])
    return end == size


def file_identity(*paths: Path) -> str:
    """An identity of large binary files without reading them whole: their sizes and 64 blocks of
    64 KiB spread evenly over each (a file rewritten with other tokens changes it)."""
    h = hashlib.sha256()
    for path in paths:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for k in range(64):
                f.seek(size * k // 64)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def document_split(length: int, starts: np.ndarray | None, fraction: float) -> tuple[int, str]:
    """Where the validation split begins: the document start nearest the last `fraction` of the
    tokens (among those leaving between half and twice that share), so no document is cut in two;
    without documents (a flat token file) or without such a start (a few long documents), at the
    tokens themselves. Returns (the split's first token, one line saying which)."""
    target = length - int(length * fraction)
    inner = starts[(starts > 0) & (starts < length)] if starts is not None else np.empty(0, np.int64)
    share = (length - inner) / max(length, 1)
    inner = inner[(share >= fraction / 2) & (share <= fraction * 2)]
    if len(inner) == 0:
        why = ("a flat token file marks no documents" if starts is None else "the data hold one document"
               if len(starts) == 1 else f"no document boundary lies near it among the {len(starts):,} documents")
        return target, f"validation: the last {length - target:,} tokens ({why}, so the split is by tokens)"
    at = int(inner[np.argmin(np.abs(inner - target))])
    held = int(np.count_nonzero(starts >= at))
    return at, (f"validation: the last {held:,} of {len(starts):,} documents ({length - at:,} of {length:,} tokens, "
                f"{(length - at) / length:.1%})")


def windows(tokens, starts: torch.Tensor, length: int) -> torch.Tensor:
    """(n, length) int64 windows of `tokens` (a tensor, or a memory-mapped array of which only
    these windows are read)."""
    if isinstance(tokens, np.ndarray):
        return torch.from_numpy(np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in starts.tolist()]))
    return tokens[starts[:, None] + torch.arange(length)]
