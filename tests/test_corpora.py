"""Pretraining data as people bring it: documents ended by the tokenizer's own end-of-text token
(and begun by its beginning-of-text token where the tokenizer adds one), a nanoGPT token file,
Megatron's indexed .bin/.idx written here by a writer of the test's own, a parquet file read
through HF datasets, and weighted blends; each checked against the ids computed here directly."""

import json
import struct

import numpy as np
import pytest
import torch

from lattice.cli import main as cli
from lattice.data.batches import global_batch, val_windows
from lattice.data.corpus import load_data_corpus
from lattice.parallel.context import LatticeConfigError

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = "the cat sat on a mat and dog ran to red blue hat".split()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTICE_CACHE", str(tmp_path / "cache"))


def llama_style_tokenizer(directory, *, adds_bos: bool = True):
    """A word-level tokenizer with Llama-3's <|begin_of_text|> (0) and <|end_of_text|> (1), whose
    post-processor puts <|begin_of_text|> before a text (as Llama-3's tokenizer.json does), and a
    tokenizer_config.json naming both, as save_pretrained writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(WORDS + [".", ","])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([BOS, EOS])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return tok


def test_json_lines_documents_hold_bos_and_eos_once_each(tmp_path):
    """Catches documents joined by a blank line instead of the tokenizer's <|end_of_text|> (a
    model that never learns to stop), a <|begin_of_text|> missing where the tokenizer adds one,
    or doubled by its post-processor: the stream is bos + the document's own ids + eos for every
    line, each special exactly once per document; without the post-processor, no bos."""
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, rng.integers(3, 30))) + " ." for _ in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for adds_bos in (True, False):
        tok = llama_style_tokenizer(tmp_path / f"tok{adds_bos}", adds_bos=adds_bos)
        corpus = load_data_corpus(str(tmp_path / "d.jsonl"), 64, data_format="jsonl",
                                  tokenizer_path=str(tmp_path / f"tok{adds_bos}"))
        stream = np.concatenate([corpus.train, corpus.val]).tolist()
        expected = [i for d in docs for i in [0] * adds_bos + tok.encode(d, add_special_tokens=False).ids + [1]]
        assert stream == expected
        assert stream.count(1) == len(docs) and stream.count(0) == len(docs) * adds_bos
        assert int(corpus.train[-1]) == 1 and 0.05 < len(corpus.val) / len(stream) < 0.2  # whole documents
        assert corpus.about[0] == f"documents: {BOS + ' ' if adds_bos else ''}document {EOS}"


def test_a_model_trained_on_short_documents_stops_at_end_of_text(tmp_path, capsys):
    """Catches a fine-tuned model that never sees <|end_of_text|> between documents (it would run
    on to --max-new-tokens), or generation that does not stop at it: a tiny Llama trained on
    JSON lines of short sentences ends its greedy continuation of a prompt with <|end_of_text|>,
    well before the tokens it was allowed."""
    llama_style_tokenizer(tmp_path / "tok")
    sentences = ["the cat sat on a mat .", "a dog ran to the red hat .", "the blue hat sat on a dog ."]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences * 60))
    out = tmp_path / "run"
    assert cli.main(["train", "--arch", "llama", "--model", "tiny", "--tokenizer", str(tmp_path / "tok"),
                     "--vocab-size", "64", "--data", str(tmp_path / "d.jsonl"), "--data-format", "jsonl",
                     "--seq-len", "32", "--batch-size", "8", "--steps", "120", "--lr", "3e-3", "--warmup", "10",
                     "--eval-interval", "120", "--eval-batches", "1", "--no-progress", "--out-dir", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "a dog ran", "--max-new-tokens", "20"]) == 0
    printed, timing = capsys.readouterr()
    made = int(timing.split(" tokens in ")[0].split()[-1])
    # (a word-level tokenizer has no decoder: its words come back without the spaces between them)
    assert "".join(printed.split()) == "adograntotheredhat." and made == 6  # 5 words, then <|end_of_text|>


def write_megatron(prefix, documents: list[list[list[int]]], dtype=np.uint16):
    """Megatron's indexed dataset written from its format's description (lattice.data.token_files):
    each document a list of sequences (sentences) of ids."""
    code = {np.uint8: 1, np.int32: 4, np.int64: 5, np.uint16: 8}[dtype]
    lengths, doc_index = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.asarray(seq, dtype=dtype).tobytes())
                lengths.append(len(seq))
            doc_index.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(doc_index)))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
                + np.asarray(doc_index, np.int64).tobytes())


def test_token_files_are_read_as_written_and_refused_in_one_line_when_wrong(tmp_path, capsys):
    """Catches a nanoGPT .bin read with the wrong width, Megatron's documents lost (the split
    cutting one in two), an .idx that does not match its .bin trained on anyway, and ids beyond
    the vocabulary that would index past the embedding: each refused in one line, exit 2."""
    rng = np.random.default_rng(1)
    flat = rng.integers(0, 1000, 5000).astype(np.uint16)
    flat.tofile(tmp_path / "train.bin")
    corpus = load_data_corpus(str(tmp_path / "train.bin"), 1000, data_format="tokens")
    assert np.concatenate([corpus.train, corpus.val]).tolist() == flat.tolist() and corpus.tokenizer is None
    assert len(corpus.val) == 500
    docs = [[rng.integers(2, 300, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))] for _ in range(80)]
    write_megatron(tmp_path / "m_text_document", docs)
    corpus = load_data_corpus(str(tmp_path / "m_text_document"), 300, data_format="megatron")
    stream = [i for d in docs for s in d for i in s]
    starts = np.cumsum([0] + [sum(map(len, d)) for d in docs[:-1]])
    assert np.concatenate([corpus.train, corpus.val]).tolist() == stream and len(corpus.train) in starts
    write_megatron(tmp_path / "wide", docs, np.int32)
    assert load_data_corpus(str(tmp_path / "wide.idx"), 300, data_format="megatron").train.tolist() == \
        stream[:len(corpus.train)]
    (tmp_path / "short.bin").write_bytes((tmp_path / "m_text_document.bin").read_bytes()[:-2])
    (tmp_path / "short.idx").write_bytes((tmp_path / "m_text_document.idx").read_bytes())
    (tmp_path / "cut.bin").write_bytes((tmp_path / "m_text_document.bin").read_bytes())
    (tmp_path / "cut.idx").write_bytes((tmp_path / "m_text_document.idx").read_bytes()[:60])
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    cases = {
        ("tokens", "train.bin", "512"): "holds token id 999, beyond --vocab-size 512; pass --vocab-size 1000",
        ("tokens", "odd.bin", "512"): "holds 3 bytes, not a whole number of uint16 token ids",
        ("megatron", "short", "300"): "does not match",
        ("megatron", "cut", "300"): "truncated",
        ("megatron", "nothing", "300"): "nothing.bin is missing",
        ("megatron", "m_text_document", "100"): "beyond --vocab-size 100",
        ("tokens", "0.7 train.bin 0.3", "2000"): "is not a blend of weighted sources",
        ("tokens", "0.7 train.bin -1 train.bin", "2000"): "every weight of a blend must be a positive number",
    }
    for (fmt, data, vocab), expect in cases.items():
        path = data if data.startswith("0.7") else str(tmp_path / data)
        if data.startswith("0.7"):
            path = " ".join(str(tmp_path / w) if w.endswith(".bin") else w for w in data.split())
        code = cli.main(["train", "--model", "tiny", "--steps", "1", "--data-format", fmt, "--data", path,
                         "--vocab-size", vocab, "--out-dir", str(tmp_path / "run")])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and expect in err, (data, err)
        assert "config:" not in out


def test_a_parquet_file_is_read_through_datasets(tmp_path, capsys):
    """Catches rows read from the wrong column, documents merged without their end-of-text token,
    and a missing or non-text column that fails deep inside the tokenizer instead of naming it."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    texts = [" ".join(WORDS[i % 7:i % 7 + 5]) + f" {i}" for i in range(300)]
    pq.write_table(pa.table({"id": list(range(300)), "content": texts}), tmp_path / "d.parquet")
    corpus = load_data_corpus(str(tmp_path / "d.parquet"), 300, data_format="hf", text_key="content")
    eos = corpus.tokenizer.token_to_id("<|endoftext|>")
    expected = [i for t in texts for i in corpus.tokenizer.encode(t).ids + [eos]]
    assert np.concatenate([corpus.train, corpus.val]).tolist() == expected
    for key, expect in (("text", "row 0 has no column 'text' (its columns: 'id', 'content')"),
                        ("id", "row 0's 'id' is int, not text")):
        code = cli.main(["train", "--model", "tiny", "--steps", "1", "--data-format", "hf", "--text-key", key,
                         "--data", str(tmp_path / "d.parquet"), "--vocab-size", "300", "--out-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expect in err, err


def test_a_blend_draws_each_source_by_its_weight_the_same_on_every_load(tmp_path):
    """Catches a blend whose sources are drawn in other shares than their weights (over 400 steps
    of 8 rows, each source's tokens within 2% of its weight), windows that cross from one source
    into another, batches that differ between two loads (a resume would see other data), a
    replica's rows that are not the global batch's, and validation that reads one source only."""
    a = np.full(3000, 5, np.uint16)  # every window of a source is recognisable by its ids
    b = np.full(2000, 9, np.uint16)
    a.tofile(tmp_path / "a.bin")
    b.tofile(tmp_path / "b.bin")
    spec = f"7 {tmp_path / 'a.bin'} 3 {tmp_path / 'b.bin'}"
    corpus = load_data_corpus(spec, 16, data_format="tokens")
    again = load_data_corpus(spec, 16, data_format="tokens")
    drawn = {5: 0, 9: 0}
    for step in range(400):
        x, y = global_batch(corpus.train, step, seed=3, batch_size=8, seq_len=32)
        assert torch.equal(x, global_batch(again.train, step, seed=3, batch_size=8, seq_len=32)[0])
        assert torch.equal(x[4:], global_batch(corpus.train, step, seed=3, batch_size=8, seq_len=32,
                                               rows=slice(4, 8))[0])
        for row in torch.cat([x, y[:, -1:]], dim=1):
            assert len(set(row.tolist())) == 1  # one source per window
            drawn[int(row[0])] += len(row)
    share = drawn[5] / (drawn[5] + drawn[9])
    assert abs(share - 0.7) < 0.02 * 0.7 and abs((1 - share) - 0.3) < 0.02 * 0.3
    val = val_windows(corpus, batch_size=10, seq_len=16, num_batches=1)
    assert int((val[0, :, 0] == 5).sum()) == 7 and int((val[0, :, 0] == 9).sum()) == 3
    with pytest.raises(LatticeConfigError, match="not a blend"):
        load_data_corpus(f"7 {tmp_path / 'a.bin'} 3", 16, data_format="tokens")


@pytest.mark.parametrize("kind", ["tokens", "megatron", "hf", "blend"])
def test_training_from_each_input_kind_resumes_with_the_same_batches(kind, tmp_path, capsys):
    """Catches an input kind the command line cannot train on, and a resume that draws other
    batches (a blend's sources, a token file's windows): 4 steps straight, and the same run
    resumed from its step-2 checkpoint, end at the same training loss, bit for bit; and a run
    on token ids without a tokenizer asked to generate from text, refused in one line (it fell
    back to the built-in corpus's tokenizer)."""
    import shutil

    rng = np.random.default_rng(2)
    if kind == "tokens" or kind == "blend":
        rng.integers(0, 256, 4000).astype(np.uint16).tofile(tmp_path / "a.bin")
        (rng.integers(0, 64, 3000) * 4).astype(np.uint16).tofile(tmp_path / "b.bin")
        data = str(tmp_path / "a.bin") if kind == "tokens" else f"0.7 {tmp_path / 'a.bin'} 0.3 {tmp_path / 'b.bin'}"
        flags = ["--data-format", "tokens", "--vocab-size", "256"]
    elif kind == "megatron":
        write_megatron(tmp_path / "m", [[rng.integers(0, 256, 50).tolist()] for _ in range(80)])
        data, flags = str(tmp_path / "m"), ["--data-format", "megatron", "--vocab-size", "256"]
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pytest.importorskip("datasets")
        texts = [" ".join(rng.choice(WORDS, 40)) for _ in range(200)]
        pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
        data, flags = str(tmp_path / "d.parquet"), ["--data-format", "hf", "--vocab-size", "300"]
    common = ["train", "--model", "tiny", "--data", data, *flags, "--batch-size", "4", "--eval-interval", "100",
              "--eval-batches", "1", "--no-progress", "--seed", "5"]

    def last_step(run) -> list[str]:  # step, train loss and gradient norm as metrics.csv holds them
        return (run / "metrics.csv").read_text().splitlines()[-1].split(",")[:5:2]

    run = tmp_path / "run"
    assert cli.main([*common, "--steps", "4", "--checkpoint-interval", "2", "--out-dir", str(run)]) == 0
    straight = last_step(run)
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # as if it stopped after step 2's checkpoint
    assert cli.main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "resuming from" in capsys.readouterr().out and last_step(run) == straight and straight[0] == "4"
    if kind in ("tokens", "megatron"):  # token ids without a tokenizer: no prompt can be encoded
        assert cli.main(["generate", str(run), "--prompt", "a prompt"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "without a tokenizer" in err, err


def test_packed_batches_restart_at_every_end_of_text(tmp_path, capsys):
    """Catches --pack-documents batches whose document ids, positions or ignored targets do not
    follow the documents (a boundary off by one, the first partial document not counted, a
    target across an end-of-text token kept), or that differ from the plain batch's windows:
    derived here from the windows alone, a new document after every <|endoftext|>. The command
    line trains with it, and refuses it in one line where the data mark no documents or the task
    is not next-token prediction."""
    import lattice
    from lattice.data.tasks import NextToken

    rng = np.random.default_rng(4)
    docs = [" ".join(rng.choice(WORDS, rng.integers(1, 12))) for _ in range(400)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = load_data_corpus(str(tmp_path / "d.jsonl"), 300, data_format="jsonl")
    eos = corpus.tokenizer.token_to_id("<|endoftext|>")
    task, ctx = NextToken(corpus, pack_documents=True), lattice.context("serial")
    for step in range(3):
        batch = task.train_batch(step, ctx, seed=2, batch_size=6, seq_len=24)
        x, y = global_batch(corpus.train, step, seed=2, batch_size=6, seq_len=24)
        ended = torch.cat([torch.zeros(6, 1, dtype=torch.long), (x[:, :-1] == eos).long()], dim=1)
        ids = 1 + ended.cumsum(1)
        positions = torch.stack([torch.tensor([t - max([0] + [s + 1 for s in range(t) if x[r, s] == eos])
                                               for t in range(24)]) for r in range(6)])
        assert torch.equal(batch.tokens, x) and torch.equal(batch.targets, y.masked_fill(x == eos, -100))
        assert torch.equal(batch.inputs["attention_mask"], ids) and torch.equal(batch.inputs["position_ids"], positions)
        assert batch.labelled == int((x != eos).sum()) and int(ids.max()) > 2
    run = ["train", "--model", "tiny", "--steps", "2", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
           "--pack-documents"]
    assert cli.main([*run, "--data", str(tmp_path / "d.jsonl"), "--data-format", "jsonl", "--vocab-size", "300",
                     "--out-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    np.full(2000, 7, np.uint16).tofile(tmp_path / "flat.bin")
    for flags, expect in (([f"--data={tmp_path / 'flat.bin'}", "--data-format", "tokens", "--vocab-size", "16"],
                           "a flat token file does not mark"),
                          (["--arch", "bert"], "--task mlm reads its examples one by one")):
        assert cli.main([*run, *flags, "--out-dir", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err, err
        assert not (tmp_path / "refused").exists()
