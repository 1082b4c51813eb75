"""A pretrained tokenizer with its own special tokens, as a user brings one: a locally trained
WordPiece whose [PAD], [UNK], [CLS], [SEP], [MASK] are ids 0-4 (not after the vocabulary, where
lattice appends its own), beside a locally built HF BERT (random weights, nothing downloaded).

The batches lattice builds for classification equal what transformers' own tokenizer makes of
the same texts (input_ids, attention_mask, token_type_ids, single texts and sentence pairs, cut
and padded to the same length), the model's logits on them equal transformers' BERT with the same
mask, and the command line fine-tunes the imported checkpoint in 1d tp=2 past the baseline.
"""

import json
import random
import re

import pytest
import torch
from multiproc import cached_init, run_distributed
from numerics import rel_diff

import lattice
from lattice.cli import main as cli
from lattice.data.corpus import load_data_corpus
from lattice.data.tasks import Classify

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(60)] + ["good", "bad"]


def write_examples(path, pairs: bool, n: int = 240, seed: int = 1) -> None:
    """JSON lines of 3 to 200 words whose label the words say (w0-w29 "pos", w30-w59 "neg"; for
    pairs the second text's, the first drawn from all), so that a small model learns them in a
    few dozen steps."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        label = rng.choice(["pos", "neg"])
        words = WORDS[:30] if label == "pos" else WORDS[30:60]
        length = rng.randint(3, 200)
        if pairs:
            cut = rng.randint(1, min(length - 1, 30))
            row = {"text": " ".join(rng.choice(WORDS) for _ in range(cut)),
                   "other": " ".join(rng.choice(words) for _ in range(length - cut)), "label": label}
        else:
            row = {"text": " ".join(rng.choice(words) for _ in range(length)), "label": label}
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")


def make_hf_bert(directory, num_labels: int = 0):
    """A WordPiece tokenizer ([PAD]=0 .. [MASK]=4, BERT's post-processor) and a float64 HF BERT
    of its vocabulary in `directory`, as `save_pretrained` writes them; returns the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordPieceTrainer(vocab_size=100, special_tokens=SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    roles = {f"{r}_token": f"[{r.upper()}]" for r in ("pad", "unk", "cls", "sep", "mask")}
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **roles}))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=256,
                                     num_labels=max(num_labels, 2))
    cls = transformers.BertForSequenceClassification if num_labels else transformers.BertForMaskedLM
    model = cls(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("pairs", [False, True], ids=["texts", "pairs"])
def test_batches_equal_transformers_tokenizer_and_logits_equal_transformers_bert(pairs, tmp_path):
    """Catches lattice's own [CLS]/[SEP]/[PAD] appended after a tokenizer that has them (or the
    tokenizer's [CLS] doubled by its post-processor), a pair without its [SEP]s or token types,
    the longer text of a pair not the one cut, padding without its mask, and logits that differ
    from transformers' BERT fed by its own tokenizer: every id, mask and type equal, the logits
    in 1d tp=2 within 1e-10 (float64)."""
    hf = make_hf_bert(tmp_path / "hf", num_labels=2)
    write_examples(tmp_path / "d.jsonl", pairs)
    corpus = load_data_corpus(str(tmp_path / "d.jsonl"), hf.config.vocab_size, data_format="jsonl",
                              text_key=("text", "other") if pairs else "text", tokenizer_path=str(tmp_path / "hf"))
    assert corpus.specials == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    task = Classify(corpus, data=str(tmp_path / "d.jsonl"), text_key="text", label_key="label",
                    pair_key="other" if pairs else None)
    ctx = lattice.context("serial")
    T = 64  # shorter than many texts: both cut the same way
    tokens, targets, inputs, _ = task.train_batch(0, ctx, seed=0, batch_size=8, seq_len=T)
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    train = [r for i, r in enumerate(rows) if i % 10 != 9]
    picked = torch.randint(0, len(train), (8,), generator=torch.Generator().manual_seed(0)).tolist()
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    texts = [train[i]["text"] for i in picked]
    encoded = theirs(texts, [train[i]["other"] for i in picked] if pairs else None, padding="max_length",
                     truncation="longest_first", max_length=T, return_token_type_ids=True, return_tensors="pt")
    assert torch.equal(tokens, encoded["input_ids"])
    assert torch.equal(inputs["attention_mask"], encoded["attention_mask"])
    assert torch.equal(inputs.get("token_types", torch.zeros_like(tokens)), encoded["token_type_ids"])
    lengths = inputs["attention_mask"].sum(1)
    assert (lengths < T).any() and (lengths == T).any()  # some rows padded, some cut
    with torch.no_grad():
        reference = hf(**encoded).logits
    for ours in run_distributed(2, _logits_in_1d, str(tmp_path / "hf"), tokens, inputs):  # each rank's
        assert rel_diff(ours, reference) < 1e-10


def _logits_in_1d(hf_dir: str, tokens, inputs) -> torch.Tensor:
    """The class logits of the HF BERT in `hf_dir` imported under 1d tp=2 (float64, no dropout)."""
    hf = transformers.BertForSequenceClassification.from_pretrained(hf_dir).double().eval()
    model = lattice.from_hf(hf, cached_init(mode="1d", tp=2)).eval()
    with torch.no_grad():
        return model(tokens, **inputs)


def test_an_hf_bert_with_its_own_wordpiece_fine_tunes_on_texts_and_pairs_in_1d(tmp_path, capfd):
    """Catches an imported BERT that cannot be fine-tuned without size flags (--init-from must
    adopt its config and its tokenizer's vocabulary) or not on batches shorter than its 256
    positions, a run that appends its own special tokens though the tokenizer has them (the
    printed line names the tokenizer's ids 0-4), and a classifier that does not learn from
    padded, masked batches in 1d tp=2: the accuracy on texts and on sentence pairs ends above the
    majority baseline the run prints, and `lattice eval` of the run reproduces it."""
    make_hf_bert(tmp_path / "hf")
    assert cli.main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    for pairs in (False, True):
        data = tmp_path / f"{'pairs' if pairs else 'texts'}.jsonl"
        write_examples(data, pairs)
        args = ["train", "--arch", "bert", "--task", "classify", "--init-from", str(tmp_path / "imported"),
                "--data", str(data), "--data-format", "jsonl", "--mode", "1d", "--tp", "2", "--nproc", "2",
                "--steps", "80", "--batch-size", "8", "--seq-len", "128", "--lr", "2e-3", "--warmup", "10",
                "--eval-interval", "80", "--eval-batches", "3", "--no-progress", "--out-dir", str(tmp_path / data.stem)]
        assert cli.main(args + (["--pair-key", "other"] if pairs else [])) == 0
        out = capfd.readouterr().out
        assert "special tokens: [MASK] 4, [CLS] 2, [PAD] 0, [SEP] 3 (the tokenizer's)" in out
        accuracy, baseline = map(float, re.search(r"val accuracy: ([\d.]+) \(majority-class baseline ([\d.]+)\)",
                                                  out).groups())
        print(f"{data.stem}: val accuracy {accuracy:.3f}, baseline {baseline:.3f}")
        assert accuracy > baseline + 0.2, out
        assert cli.main(["eval", str(tmp_path / data.stem)]) == 0  # the 256-position model on its 128-token batches
        assert f"accuracy {accuracy:.3f} (majority-class baseline {baseline:.3f}) (3 batches of 8 x 128" in \
            capfd.readouterr().out
    args[args.index("--seq-len") + 1] = "300"
    args[args.index("--out-dir") + 1] = str(tmp_path / "longer")
    assert cli.main(args) == 2
    assert "--seq-len 300 exceeds the checkpoint model's seq_len = 256 (the longest sequence it takes); pass at " \
           "most 256" in capfd.readouterr().err


def test_an_exported_bert_tokenizer_builds_the_inputs_lattice_trained_on(tmp_path, capsys):
    """Catches an HF export of a BERT trained with lattice's own BPE whose tokenizer lacks the
    [CLS], [SEP], [PAD] lattice appended (or has them at other ids), or lacks BERT's
    post-processor: transformers' AutoTokenizer on the export must build exactly the sentence-
    pair batch lattice trained on (ids, mask, token types), and the exported model's logits on it
    equal lattice's."""
    from lattice import checkpoint
    from lattice.models import build_model
    from lattice.models.bert import BertConfig

    data, run, out, T = tmp_path / "d.jsonl", tmp_path / "run", tmp_path / "hf", 48
    write_examples(data, pairs=True, n=60)
    assert cli.main(["train", "--arch", "bert", "--model", "tiny", "--task", "classify", "--data", str(data),
                     "--data-format", "jsonl", "--pair-key", "other", "--vocab-size", "300", "--steps", "1",
                     "--batch-size", "4", "--eval-batches", "1", "--seq-len", str(T), "--d-model", "32",
                     "--n-layers", "1", "--no-progress", "--out-dir", str(run)]) == 0
    assert "[MASK] 300, [CLS] 301, [PAD] 302, [SEP] 303 (appended by lattice" in capsys.readouterr().out
    assert cli.main(["convert", str(run), "--to", "hf", str(out)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    corpus = load_data_corpus(str(data), 300, data_format="jsonl", text_key=("text", "other"),
                              tokenizer_path=str(run))
    task = Classify(corpus, data=str(data), text_key="text", label_key="label", pair_key="other")
    rows = [json.loads(line) for line in data.read_text().splitlines()][:6]
    tokens, inputs = task._sequences([(corpus.encode(r["text"]), corpus.encode(r["other"])) for r in rows], T)
    encoded = theirs([r["text"] for r in rows], [r["other"] for r in rows], padding="max_length",
                     truncation="longest_first", max_length=T, return_token_type_ids=True, return_tensors="pt")
    assert torch.equal(tokens, encoded["input_ids"])
    assert torch.equal(inputs["attention_mask"], encoded["attention_mask"])
    assert torch.equal(inputs["token_types"], encoded["token_type_ids"])
    ckpt = checkpoint.read(run)
    model = build_model(BertConfig.from_dict(ckpt["model_config"]), lattice.context("serial"))
    checkpoint.load_into(ckpt, model)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_diff(model.eval()(tokens, **inputs), hf(**encoded).logits) < 1e-5
