"""The command line's round trip through HuggingFace that the family tests share: a transformers
model of sizes no preset has, with its own byte-level BPE, saved as `save_pretrained` writes it,
`lattice convert --from hf`, trained further with the given flags and no size flag, `convert --to
hf`, and what transformers generates greedily from the export beside what `lattice generate`
prints."""

import torch


def lattice_cli(args, capfd) -> str:
    """`lattice ARGS` in this process (a layout's workers are processes; capfd sees their output)."""
    from lattice.cli import main as cli

    assert cli.main(args) == 0, capfd.readouterr()
    return capfd.readouterr().out


def through_lattice(hf_model, root, capfd, train_flags: list[str], prompt: str = "def main(", new_tokens: int = 10):
    """(the export as transformers loads it, what `lattice generate` printed, transformers' greedy
    text from the export) after the round trip of `hf_model` (vocabulary 1000) in `root`, which is
    the working directory."""
    from tokenizers import ByteLevelBPETokenizer

    from lattice.data.corpus import corpus_text

    hf_model.save_pretrained(root / "hf")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([corpus_text()[:200_000]], vocab_size=1000, min_frequency=2, show_progress=False)
    bpe.save(str(root / "hf" / "tokenizer.json"))
    lattice_cli(["convert", "--from", "hf", "hf", "run"], capfd)
    lattice_cli(["train", "--resume", "run", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
                 "--allow-config-change", *train_flags], capfd)
    lattice_cli(["convert", "run", "--to", "hf", "exported"], capfd)
    printed = lattice_cli(["generate", "run", "--prompt", prompt, "--max-new-tokens", str(new_tokens)], capfd)
    loaded = type(hf_model).from_pretrained(root / "exported", local_files_only=True).eval()
    ids = torch.tensor([bpe.encode(prompt).ids])
    expected = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
    return loaded, printed, bpe.decode(expected[0].tolist())
