"""The built-in corpus, tokenizer cache, batches and the unigram baseline, each checked against a
direct computation on the token ids."""

import math
from collections import Counter

import pytest
import torch

from lattice.data.batches import global_batch, train_batch, val_batches
from lattice.data.corpus import corpus_text, load_corpus, unigram_baseline
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, Topology

VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LATTICE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return load_corpus(VOCAB)


def _ctx(dp: int, tp: int, rank: int) -> ParallelContext:
    """A layout with a data-parallel and a tensor-parallel axis, without processes."""
    topo = Topology(mode="serial", axes=((MeshAxis.DP, dp), (MeshAxis.TP, tp)),
                    rank_grid=tuple(range(dp * tp)), ranks_per_node=dp * tp)
    return ParallelContext(topology=topo, rank=rank)


def test_corpus_is_real_english_text():
    """Catches an empty or wrongly assembled corpus (e.g. joining topic names instead of texts)."""
    text = corpus_text()
    assert len(text) > 300_000
    assert "The \"assert\" statement" in text and text.count(" the ") > 1000


def test_tokenizer_round_trips_any_text(corpus):
    """Catches a tokenizer without all 256 bytes in its alphabet: text the corpus never contains
    (emoji, CJK, control bytes) would be lost or mapped to an unknown token."""
    for text in ["def f(x):\n    return x ** 2\n", "naïve café — 東京 🙂\x00\x07", corpus_text()[:2000]]:
        ids = corpus.encode(text)
        assert all(0 <= i < VOCAB for i in ids)
        assert corpus.decode(ids) == text
    assert corpus.tokenizer.get_vocab_size() == VOCAB


def test_cache_is_reused_and_keyed_by_vocab_size(tmp_path, monkeypatch):
    """Catches a cache that is ignored, or one that serves ids of another vocabulary size."""
    monkeypatch.setenv("LATTICE_CACHE", str(tmp_path))
    first = load_corpus(300)
    entries = sorted(p.name for p in tmp_path.iterdir())
    again = load_corpus(300)
    assert sorted(p.name for p in tmp_path.iterdir()) == entries and len(entries) == 1
    assert torch.equal(first.train, again.train) and torch.equal(first.val, again.val)
    ids = torch.tensor(_documents_ids(again))  # the cached ids are the tokenizer's encoding of the text
    assert torch.equal(torch.cat([again.train, again.val]), ids)
    other = load_corpus(400)
    assert len(list(tmp_path.iterdir())) == 2
    assert len(other.train) + len(other.val) < len(ids)  # more merges, fewer tokens


def _documents_ids(corpus) -> list[int]:
    """The built-in corpus as its documents (pydoc's topics) each encoded and followed by the
    tokenizer's own end-of-text token, computed here topic by topic."""
    from pydoc_data.topics import topics

    eos = corpus.tokenizer.token_to_id("<|endoftext|>")
    return [i for k in sorted(topics) for i in corpus.encode(topics[k].strip() + "\n") + [eos]]


def test_split_is_the_last_tenth_of_whole_documents(corpus):
    """Catches a split that overlaps, drops tokens, is not the tail of the corpus, or cuts a
    document in two: the validation split starts right after an end-of-text token and holds
    about a tenth of the tokens; every topic ends with <|endoftext|>, which is the tokenizer's
    own special token (id 0), so generation can stop at it."""
    from pydoc_data.topics import topics

    ids = torch.tensor(_documents_ids(corpus))
    n, eos = len(ids), corpus.tokenizer.token_to_id("<|endoftext|>")
    assert torch.equal(torch.cat([corpus.train, corpus.val]), ids)
    assert eos == 0 and corpus.specials == {"eos": 0} and int((ids == eos).sum()) == len(topics)
    assert int(corpus.train[-1]) == eos and 0.05 * n < len(corpus.val) < 0.2 * n


def test_batches_are_windows_with_shifted_targets_and_depend_only_on_seed_and_step(corpus):
    """Catches targets not shifted by one, windows that are not contiguous corpus text, and
    batches that depend on anything but (seed, step) (which would break exact resume)."""
    x, y = global_batch(corpus.train, 7, seed=3, batch_size=6, seq_len=32)
    x2, y2 = global_batch(corpus.train, 7, seed=3, batch_size=6, seq_len=32)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, global_batch(corpus.train, 8, seed=3, batch_size=6, seq_len=32)[0])
    assert not torch.equal(x, global_batch(corpus.train, 7, seed=4, batch_size=6, seq_len=32)[0])
    windows = corpus.train.unfold(0, 33, 1)  # every (T+1)-window of the training split
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])
        assert (windows == full).all(1).any()
        assert torch.equal(row_x[1:], row_y[:-1])


def test_replica_batches_split_the_global_batch_by_dp_coordinate(corpus):
    """Catches replicas that train on the same rows (or miss rows), and tensor-parallel ranks of
    one replica that get different data."""
    dp, tp, B, T = 2, 2, 8, 16
    x, y = global_batch(corpus.train, 5, seed=0, batch_size=B, seq_len=T)
    per_rank = [train_batch(corpus, 5, _ctx(dp, tp, r), seed=0, batch_size=B, seq_len=T) for r in range(dp * tp)]
    for r, (xr, yr) in enumerate(per_rank):
        d = r // tp  # natural placement: dp is the outer axis
        assert torch.equal(xr, x[d * B // dp:(d + 1) * B // dp]) and torch.equal(yr, y[d * B // dp:(d + 1) * B // dp])
    val = [val_batches(corpus, _ctx(dp, tp, r), batch_size=B, seq_len=T, num_batches=3) for r in range(dp * tp)]
    for b in range(3):
        assert torch.equal(val[0][b][0], val[1][b][0])  # same replica
        assert not torch.equal(val[0][b][0], val[2][b][0])  # other replica
        whole = val_batches(corpus, _ctx(1, 1, 0), batch_size=B, seq_len=T, num_batches=3)[b][0]
        assert torch.equal(torch.cat([val[0][b][0], val[2][b][0]]), whole)


def test_batch_that_does_not_split_over_dp_is_refused(corpus):
    """Catches silently dropped rows when the global batch does not divide by dp."""
    with pytest.raises(LatticeConfigError, match="batch size 6 is not divisible by dp = 4"):
        train_batch(corpus, 0, _ctx(4, 1, 0), seed=0, batch_size=6, seq_len=16)


def test_unigram_baseline_matches_direct_count(corpus):
    """Catches a baseline measured on the wrong split, without smoothing, or in bits."""
    counts = Counter(corpus.train.tolist())
    total = len(corpus.train) + VOCAB
    expect = -sum(math.log((counts[t] + 1) / total) for t in corpus.val.tolist()) / len(corpus.val)
    assert unigram_baseline(corpus) == pytest.approx(expect, rel=1e-9)


def test_own_data_is_a_memory_mapped_token_file_read_by_windows(tmp_path, monkeypatch):
    """Catches own data loaded into memory whole (no bounded memory for large corpora), tokens
    that differ from encoding the text directly, and batches built from other windows than the
    (seed, step) ones."""
    import numpy as np

    from lattice.data.batches import global_batch
    from lattice.data.corpus import load_data_corpus

    (tmp_path / "a.txt").write_text("Sphinx of black quartz, judge my vow. " * 200)
    (tmp_path / "b.txt").write_text("How vexingly quick daft zebras jump! " * 200)
    monkeypatch.setenv("LATTICE_CACHE", str(tmp_path / "cache"))
    corpus = load_data_corpus(str(tmp_path / "*.txt"), 300)
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint16
    eos = corpus.tokenizer.token_to_id("<|endoftext|>")  # each file is a document, ended by it
    direct = corpus.tokenizer.encode((tmp_path / "a.txt").read_text()).ids + [eos] \
        + corpus.tokenizer.encode((tmp_path / "b.txt").read_text()).ids + [eos]
    assert np.concatenate([corpus.train, corpus.val]).tolist() == direct
    x, y = global_batch(corpus.train, 3, seed=1, batch_size=4, seq_len=8, rows=slice(2, 4))
    gen = torch.Generator().manual_seed(1 * 1_000_003 + 3)
    starts = torch.randint(0, len(corpus.train) - 8, (4,), generator=gen)[2:]
    for row, s in enumerate(starts.tolist()):
        assert x[row].tolist() == direct[s:s + 8] and y[row].tolist() == direct[s + 1:s + 9]


def test_jsonl_data_takes_the_text_field_and_refuses_other_lines(tmp_path):
    """Catches JSON lines read as raw text (keys and quotes would be trained on), and a malformed
    line that fails deep inside the tokenizer instead of naming the file and line."""
    import json

    from lattice.data.text_files import Piece, documents

    rows = [{"text": "first document", "id": 1}, {"text": "second one", "id": 2}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(documents(str(path), "jsonl", "text")) == [Piece("first document"), Piece("second one")]
    path.write_text(json.dumps(rows[0]) + "\n{\"body\": \"no text\"}\n")
    with pytest.raises(LatticeConfigError, match=r"docs.jsonl:2 is not a JSON object with a 'text' field"):
        list(documents(str(path), "jsonl", "text"))


def _bad_inputs(root) -> dict[str, tuple[list[str], str]]:
    root.mkdir()
    """case -> (train flags, what the one line must say), for data and tokenizers a user mistypes."""
    (root / "empty.txt").write_bytes(b"")
    (root / "empties").mkdir()
    (root / "empties" / "a.txt").write_bytes(b"")
    (root / "nothing").mkdir()
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)  # NUL bytes, as in a shared library
    (root / "latin1.txt").write_bytes("déjà vu à l'été, ".encode("latin-1") * 200)  # another encoding
    (root / "good.txt").write_text("some text to train on\n" * 50)
    (root / "notes.json").write_text("step=10 loss=3.2\n")
    (root / "tok_dir").mkdir()
    (root / "binaries").mkdir()
    (root / "binaries" / "lib.so").write_bytes(bytes(range(256)) * 64)
    good = ["--data", str(root / "good.txt")]
    return {
        "empty file": (["--data", str(root / "empty.txt")], "holds no text (1 empty file)"),
        "directory of empty files": (["--data", str(root / "empties")], "holds no text"),
        "directory without files": (["--data", str(root / "nothing")], "names no file"),
        "binary file": (["--data", str(root / "binary.bin")], "is not text (NUL bytes)"),
        "other encoding": (["--data", str(root / "latin1.txt")], "not UTF-8"),
        "directory of binaries only": (["--data", str(root / "binaries")], "holds no text file (1 file, none UTF-8"),
        "tokenizer that does not parse": (good + ["--tokenizer", str(root / "notes.json")],
                                          "is not a tokenizer the tokenizers library reads"),
        "binary tokenizer": (good + ["--tokenizer", str(root / "binary.bin")], "is not a tokenizer"),
        "directory without tokenizer.json": (good + ["--tokenizer", str(root / "tok_dir")], "has no tokenizer.json"),
    }


def test_data_and_tokenizers_that_cannot_train_are_refused_in_one_line(tmp_path, capsys):
    """Catches an empty file ending in `cannot mmap an empty file`, a binary file trained on as
    byte soup, and a tokenizer file ending in the tokenizers library's bare `Exception`: each is
    one line naming the file and the fix, exit code 2, before any process group or "config:"."""
    from lattice.cli import main as cli

    cases = _bad_inputs(tmp_path / "in")
    for case, (flags, expect) in cases.items():
        code = cli.main(["train", "--model", "tiny", "--steps", "1", "--out-dir", str(tmp_path / "run"), *flags])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expect in err, (case, err)
        assert "config:" not in out, case
    assert len(cases) == 9


def test_a_source_tree_trains_on_its_text_and_says_what_it_skipped(tmp_path, capsys):
    """Catches `--data DIR` refusing a source tree because of its __pycache__/*.pyc (or training
    on them as byte soup, or skipping them without a word): the run trains on the text files, one
    line names how many files were skipped and of which kinds, and the run's data.json lists only
    the text files. A binary named explicitly is still refused."""
    import json

    from lattice.cli import main as cli

    tree = tmp_path / "src"
    (tree / "pkg" / "__pycache__").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("def f(x):\n    return x + 1\n" * 400)
    (tree / "README.md").write_text("A small package that adds one.\n" * 200)
    for name in ("mod.cpython-312.pyc", "other.cpython-312.pyc"):
        (tree / "pkg" / "__pycache__" / name).write_bytes(b"\xcb\r\r\n\0\0\0\0" + bytes(range(256)) * 8)
    (tree / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(200))
    out = tmp_path / "run"
    assert cli.main(["train", "--model", "tiny", "--vocab-size", "300", "--batch-size", "4", "--eval-batches", "1",
                     "--steps", "1", "--no-progress", "--data", str(tree), "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--data {tree}: skipped 3 files that are not text (.pyc x2, .png x1)" in printed
    assert sorted(json.loads((out / "data.json").read_text())["files"]) == [str(tree / "README.md"),
                                                                           str(tree / "pkg" / "mod.py")]
    named = ["train", "--model", "tiny", "--data", str(tree / "logo.png"), "--out-dir", str(tmp_path / "b")]
    assert cli.main(named) == 2
    assert "logo.png is not text (NUL bytes)" in capsys.readouterr().err


def test_the_token_file_holds_each_pieces_own_ids_in_order(tmp_path, capsys, monkeypatch):
    """Catches batched encoding that reorders pieces, drops the last partial batch, merges tokens
    across piece boundaries, or puts a document's separators anywhere but around it: 19 pieces
    (encoded in batches of 4: four full and three) of 7 documents through write_token_file hold
    exactly bos + encode() of each piece + eos, and the summary line counts them."""
    import numpy as np

    from lattice.data import token_files
    from lattice.data.corpus import train_tokenizer
    from lattice.data.text_files import Piece

    monkeypatch.setattr(token_files, "BATCH_PIECES", 4)
    text = corpus_text()
    tokenizer = train_tokenizer(text[:200_000], 600)
    step = len(text) // 19
    cuts = {0, 3, 4, 9, 10, 15, 16}  # the first piece of each document
    pieces = [Piece(text[k * step:(k + 1) * step], k in cuts, k + 1 in cuts | {19}) for k in range(19)]
    separators = token_files.Separators(bos=(7,), eos=(5, 6), how="test")
    done = token_files.write_token_file(tmp_path / "tokens.bin", tokenizer, iter(pieces), np.uint16,
                                        separators=separators)
    expected, starts = [], []
    for p in pieces:
        starts += [len(expected)] if p.first else []
        expected += [7] * p.first + tokenizer.encode(p.text).ids + [5, 6] * p.last
    assert np.fromfile(tmp_path / "tokens.bin", dtype=np.uint16).tolist() == expected
    assert (done.chars, done.tokens, done.starts.tolist()) == (sum(len(p.text) for p in pieces), len(expected), starts)
    assert f"(7 documents) into {len(expected):,} tokens" in capsys.readouterr().out
