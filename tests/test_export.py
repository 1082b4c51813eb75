"""`lattice convert` exports as a user meets them: a destination that already holds something
is left alone unless --overwrite (which replaces only what an export writes), and an HF export
carries what transformers needs beyond the weights (the end-of-text token its generate stops at, a
classifier's label names)."""

import hashlib
import json
import random

import pytest
import torch

from lattice.cli import main as cli

transformers = pytest.importorskip("transformers")

TRAIN = ["--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--no-progress"]


def _listing(directory) -> dict:
    """{name: sha256} of every file in `directory`."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_exports_refuse_a_used_destination_and_overwrite_replaces_only_what_they_write(tmp_path, capsys):
    """Catches an export that overwrites an HF directory it did not write (deleting a sharded
    model's files, leaving another model's generation config behind) or an existing .pt file,
    and an --overwrite that removes more than an export's own files or leaves a stale shard: the
    refusal is one line naming the way out, the destination byte for byte as it was, and with
    --overwrite the export loads in transformers, the user's other file kept."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert cli.main(["train", "--model", "tiny", *TRAIN, "--out-dir", str(run)]) == 0
    hf.mkdir()
    for name in ("config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors", "model.safetensors.index.json", "README.md"):
        (hf / name).write_text(f"an earlier model's {name}")
    before = _listing(hf)
    capsys.readouterr()
    assert cli.main(["convert", str(run), "--to", "hf", str(hf)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a HuggingFace model directory holding 6 entries" in err and "--overwrite" in err
    assert _listing(hf) == before

    single = tmp_path / "model.pt"
    single.write_bytes(b"the user's own file")
    assert cli.main(["convert", str(run), str(single)]) == 2
    err = capsys.readouterr().err
    assert f"destination {single} already exists (19 bytes)" in err and err.count("\n") == 1
    assert single.read_bytes() == b"the user's own file"
    assert cli.main(["convert", str(run), str(single), "--overwrite"]) == 0 and single.stat().st_size > 1000

    assert cli.main(["convert", str(run), "--to", "hf", str(hf), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "removed the earlier config.json, generation_config.json, model-00001-of-00002.safetensors" in out
    assert sorted(_listing(hf)) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                    "tokenizer.json", "tokenizer_config.json"]
    assert (hf / "README.md").read_text() == "an earlier model's README.md"
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0  # the run's <|endoftext|>
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    transformers.AutoModelForCausalLM.from_pretrained(hf)


def _documents_with_end_of_text(directory):
    """Text of short documents each ended by <|endoftext|> and a byte-level BPE with that special
    token (id 0), as a user brings a pretrained tokenizer and data; returns (data, tokenizer)."""
    from tokenizers import ByteLevelBPETokenizer

    rng = random.Random(0)
    text = "".join(f"x = {rng.randint(0, 9)}<|endoftext|>" for _ in range(3000))
    (directory / "data.txt").write_text(text)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text.replace("<|endoftext|>", "\n")], vocab_size=300, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "data.txt", directory / "tokenizer.json"


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_transformers_generate_on_an_export_stops_at_end_of_text_as_lattice_does(arch, tmp_path, capsys):
    """Catches an export whose config has no eos_token_id (or no generation_config.json), so that
    transformers' generate runs past the end of the document, and a `lattice generate` that does
    not stop there: trained on documents each ended by <|endoftext|>, the export's eos is that
    token's id, and transformers' greedy generate ends with it after the same tokens lattice
    prints, well before max_new_tokens."""
    from tokenizers import Tokenizer

    data, tokenizer = _documents_with_end_of_text(tmp_path)
    run, hf, prompt = tmp_path / "run", tmp_path / "hf", "x = 3<|endoftext|>x"
    assert cli.main(["train", "--arch", arch, "--model", "tiny", "--data", str(data), "--tokenizer", str(tokenizer),
                     "--steps", "80", "--lr", "1e-2", "--eval-interval", "80", "--eval-batches", "1", "--seq-len", "32",
                     "--batch-size", "8", "--no-progress", "--out-dir", str(run)]) == 0
    assert cli.main(["convert", str(run), "--to", "hf", str(hf)]) == 0
    eos = Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == eos
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == eos
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    ours = capsys.readouterr().out[:-1]

    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    # the run's ids of the prompt: transformers 5 loads any qwen2 model's tokenizer as its
    # Qwen2Tokenizer, whose own pre-tokenizer splits numbers digit by digit (" 3" -> " ", "3")
    ids = torch.tensor([Tokenizer.from_file(str(tokenizer)).encode(prompt).ids])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    made = generated[0, ids.shape[1]:].tolist()
    assert made[-1] == eos and 1 < len(made) < 12, made  # stopped at the end of the document, by itself
    assert ours == prompt + theirs.decode(made[:-1]), (ours, made)


def test_a_classifier_export_names_its_labels(tmp_path, capsys):
    """Catches an exported classifier whose config says LABEL_0, LABEL_1 (transformers' default)
    instead of the labels of the data it was trained on: its id2label is the data's labels in
    class-id order, and a text-classification pipeline answers with them."""
    data, run, hf = tmp_path / "d.jsonl", tmp_path / "run", tmp_path / "hf"
    rows = [{"text": " ".join(["good"] * (i % 7 + 1)), "label": "pos"} if i % 2 else
            {"text": " ".join(["bad"] * (i % 5 + 1)), "label": "neg"} for i in range(80)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["train", "--arch", "bert", "--model", "tiny", "--task", "classify", "--data", str(data),
                     "--data-format", "jsonl", "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4",
                     *TRAIN, "--out-dir", str(run)]) == 0
    assert cli.main(["convert", str(run), "--to", "hf", str(hf)]) == 0
    config = json.loads((hf / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}
    assert json.loads((hf / "config.json").read_text())["pad_token_id"] is not None
    classify = transformers.pipeline("text-classification", model=str(hf), tokenizer=str(hf))
    assert classify("good good")[0]["label"] in ("neg", "pos")
