"""The training tasks of lattice.data.tasks: BERT's masking, labelled JSON lines, and the encoder path
through the command line (pre-train, fine-tune from its weights with --init-from, eval)."""

import re

import torch

from lattice.cli import main as cli
from lattice.data.corpus import load_corpus
from lattice.data.tasks import Classify, MaskedLM, special_id
from lattice.modes.kernels.loss import IGNORE_INDEX

VOCAB = 300


def test_masking_predicts_a_fixed_count_per_sequence_with_bert_proportions():
    """Catches masking that labels the wrong tokens, a count that varies per sequence (the loss
    would then depend on how the batch is split), or proportions other than 80% [MASK], 10%
    random, 10% kept (binomial: 20,000 picks, so 0.02 is over 6 standard deviations)."""
    task = MaskedLM(load_corpus(VOCAB))
    window = torch.randint(0, VOCAB, (2000, 64), generator=torch.Generator().manual_seed(1))
    x, y = task.mask(window, torch.Generator().manual_seed(2))
    labelled = y != IGNORE_INDEX
    assert (labelled.sum(dim=1) == round(0.15 * 64)).all()
    assert torch.equal(y[labelled], window[labelled]) and torch.equal(x[~labelled], window[~labelled])
    picked = x[labelled]
    masked = (picked == special_id("[MASK]", VOCAB)).float().mean()
    kept = (picked == window[labelled]).float().mean()  # includes random draws of the same token (1/300)
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1 - 0.1 / VOCAB) < 0.02
    assert picked.max() < special_id("[MASK]", VOCAB) + 1 and (picked < VOCAB).float().mean() > 0.15


def test_json_lines_classification_numbers_labels_and_builds_cls_sequences(tmp_path):
    """Catches labels numbered in file order instead of sorted, validation examples that also
    train, and sequences without [CLS] first, [SEP] after the text or [PAD] after that, or an
    attention mask that does not end where the padding starts."""
    lines = [f'{{"text": "example {i}", "label": "{"cab"[i % 3]}"}}' for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    task = Classify(load_corpus(VOCAB), data=str(tmp_path / "d.jsonl"), text_key="text", label_key="label")
    train, val, names = task.examples
    assert names == ["a", "b", "c"] and len(val) == 3 and len(train) == 27
    assert [label for _, label in val] == [2, 0, 1]  # lines 10, 20, 30: labels c, a, b
    tokens, inputs = task._sequences([val[0][0]], 16)
    seq, n = tokens[0], len(val[0][0])
    assert seq[0] == special_id("[CLS]", VOCAB) and seq[1 + n] == special_id("[SEP]", VOCAB)
    assert (seq[2 + n:] == special_id("[PAD]", VOCAB)).all() and seq[1:1 + n].tolist() == val[0][0]
    assert inputs["attention_mask"][0].tolist() == [1] * (2 + n) + [0] * (14 - n) and inputs["token_types"] is None


def test_pretrain_then_fine_tune_from_its_weights_and_eval(tmp_path, capsys):
    """Catches --init-from that does not load the encoder (the line must name exactly the new
    head as starting fresh), a classification run whose printed accuracy the eval command does
    not reproduce, and eval printing a loss without the accuracy and its baseline."""
    common = ["--arch", "bert", "--model", "tiny", "--vocab-size", str(VOCAB), "--batch-size", "6",
              "--eval-batches", "2", "--no-progress", "--d-model", "32", "--n-layers", "1"]
    assert cli.main(["train", *common, "--steps", "2", "--out-dir", str(tmp_path / "mlm")]) == 0
    assert cli.main(["train", *common, "--task", "classify", "--steps", "4", "--init-from", str(tmp_path / "mlm"),
                     "--out-dir", str(tmp_path / "cls")]) == 0
    out = capsys.readouterr().out
    assert "starting fresh: pooler.weight, pooler.bias, classifier.weight, classifier.bias\n" in out
    trained = re.search(r"val accuracy: ([\d.]+) \(majority-class baseline ([\d.]+)\)", out)
    assert cli.main(["eval", str(tmp_path / "cls")]) == 0
    evaluated = re.search(r"accuracy ([\d.]+) \(majority-class baseline ([\d.]+)\)", capsys.readouterr().out)
    assert trained and evaluated and trained.groups() == evaluated.groups()
    assert cli.main(["generate", str(tmp_path / "cls"), "--prompt", "x"]) == 2
    assert "an encoder: it does not continue text" in capsys.readouterr().err


def test_a_classification_run_says_how_many_texts_it_cut(tmp_path, capsys):
    """Catches long texts cut to seq_len without a word (188 of a user's 360 texts were): the run
    prints how many texts are longer than a sequence holds besides [CLS] and [SEP] and the longest, counted
    here with the run's own tokenizer; a file of short texts prints nothing of the kind."""
    from tokenizers import Tokenizer

    texts = [("a good film " * n, "pos" if n % 2 else "neg") for n in [1, 2, 3, 40, 4, 5, 60, 6, 7, 8] * 3]
    (tmp_path / "d.jsonl").write_text("".join(f'{{"text": "{t}", "label": "{y}"}}\n' for t, y in texts))
    common = ["--arch", "bert", "--model", "tiny", "--vocab-size", str(VOCAB), "--batch-size", "3", "--eval-batches",
              "1", "--no-progress", "--d-model", "32", "--n-layers", "1", "--seq-len", "24", "--task", "classify",
              "--data-format", "jsonl", "--steps", "1"]
    assert cli.main(["train", *common, "--data", str(tmp_path / "d.jsonl"), "--out-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    tokenizer = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    lengths = [len(tokenizer.encode(t).ids) for t, _ in texts]
    over = [n for n in lengths if n > 22]  # 24 positions less [CLS] and [SEP]
    assert 0 < len(over) < len(texts)
    assert f"{len(over)} of {len(texts)} texts are longer than the 22 tokens a batch holds (the longest " \
           f"{max(over)})" in out
    (tmp_path / "short.jsonl").write_text("".join(f'{{"text": "{t[:24]}", "label": "{y}"}}\n' for t, y in texts))
    assert cli.main(["train", *common, "--data", str(tmp_path / "short.jsonl"), "--out-dir", str(tmp_path / "b")]) == 0
    assert "longer than" not in capsys.readouterr().out
