"""The tokenizer travels with the weights (`lattice convert`): an HF directory's tokenizer.json,
with the files that name its special tokens, into the run an import writes; and a run's
tokenizer into an HF export, built so that `AutoTokenizer.from_pretrained(export)` makes the
inputs the run trained on: the special tokens its task read (the tokenizer's own named by role,
lattice's appended ones added at the ids the model learned them at) and, for an encoder, BERT's
[CLS] text [SEP] (pairs: [CLS] a [SEP] b [SEP], b of token type 1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lattice.data.corpus import SPECIALS_FILE, read_tokenizer, tokenizer_specials
from lattice.data.tasks import APPENDED, TaskTokens
from lattice.models import get_arch
from lattice.models.hf import transformers_module

ROLE_FILES = (SPECIALS_FILE, "tokenizer_config.json")  # which of a tokenizer's tokens are [CLS], <pad>, ...


def carry_tokenizer(src: Path, dst: Path, *, to: str, from_hf: bool, meta: dict, run: Path,
                    shown: Path | None = None) -> None:
    """After `lattice convert` wrote `dst`: the tokenizer beside the source (`run`: the run
    directory of a lattice checkpoint) into an HF export, or an HF directory's into the run an
    import writes (which generate, eval and train then use). Prints what it carried, naming
    `shown` (where `dst` will be moved) for `dst`."""
    if to == "hf":
        source = run / "tokenizer.json"
        if source.is_file():
            added = export_tokenizer(source, dst, meta)
            print(f"tokenizer: {source} -> {shown or dst}/tokenizer.json (AutoTokenizer.from_pretrained loads it"
                  f"{'; with ' + ', '.join(added) if added else ''})")
        else:
            print(f"tokenizer: none beside {src}; the export holds the model only")
    elif from_hf and to == "sharded":
        source = src / "tokenizer.json"
        if source.is_file():
            shutil.copyfile(source, dst / "tokenizer.json")
            for name in ROLE_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, dst / name)
            print(f"tokenizer: {source} -> {dst}/tokenizer.json")


def export_tokenizer(source: Path, dst: Path, meta: dict) -> list[str]:
    """A run's tokenizer.json as an HF tokenizer in `dst` with the special tokens of the run's
    task (`meta`: the checkpoint's train and model configs): the tokenizer's own named by role,
    lattice's appended ones added at their ids (placeholders [unused0], .. fill the ids between
    the tokenizer's last token and the vocabulary its run counted from), and an encoder's
    [CLS] .. [SEP] post-processor. Returns the tokens it added."""
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing

    tokenizer, specials, task, tokens = _run_tokens(source, meta)
    vocab = tokens.tokenizer_vocab
    added = [APPENDED[r] for r in tokens.appended]
    if added:
        filler = [f"[unused{i}]" for i in range(vocab - tokenizer.get_vocab_size())]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in filler + added])
        for role in tokens.appended:  # the ids the model learned them at
            assert tokenizer.token_to_id(APPENDED[role]) == tokens.ids[role], (role, tokens.ids)
    roles = {role: tokenizer.id_to_token(i) for role, i in {**specials, **tokens.ids}.items()}
    if task in ("mlm", "classify"):
        cls, sep = roles["cls"], roles["sep"]
        tokenizer.post_processor = TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, tokens.ids["cls"]), (sep, tokens.ids["sep"])])
    fast = transformers_module().PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **{f"{r}_token": t for r, t in roles.items()})
    fast.save_pretrained(dst)
    return added


def describe_export(run: Path, dst: Path, meta: dict) -> None:
    """An HF export's config.json given the run's special-token ids (bos, eos, pad: the
    tokenizer's own by role, and the tokens its task appended) and a classifier's label names (the
    run's data.json), with a generation_config.json of the same ids, so that transformers'
    generate stops at the run's end-of-text token and pipelines name the classes. Prints what it set."""
    import json

    transformers = transformers_module()
    config = transformers.AutoConfig.from_pretrained(dst, local_files_only=True)
    ids = _special_ids(run, meta)
    for key, value in ids.items():
        setattr(config, key, value)
    labels = json.loads((run / "data.json").read_text()).get("labels") if (run / "data.json").is_file() else None
    named = bool(labels) and bool(meta["model_config"].get("num_labels")) and config.num_labels == len(labels)
    if named:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}
    config.save_pretrained(dst)
    family = get_arch(meta["arch"])
    generates = bool({"lm", "seq2seq"} & set(family.tasks)) and getattr(config, "eos_token_id", None) is not None
    if generates:
        transformers.GenerationConfig.from_model_config(config).save_pretrained(dst)
    shown = ", ".join(f"{k} {v}" for k, v in ids.items())
    if shown or named:
        print(f"config: {shown}{'; ' if shown and named else ''}{'labels ' + ', '.join(labels) if named else ''}"
              f"{'; generation_config.json with them' if generates else ''}")


def _special_ids(run: Path, meta: dict) -> dict[str, int]:
    """{"bos_token_id" | "eos_token_id" | "pad_token_id": id} of the run's tokenizer and task; {}
    without the run's tokenizer.json (an encoder-decoder's own ids are in its model config)."""
    source = run / "tokenizer.json"
    if not source.is_file():
        return {}
    _, specials, _, tokens = _run_tokens(source, meta)
    found = {**specials, **tokens.ids}
    model = meta["model_config"]  # (an encoder-decoder's own ids win: its model was built with them)
    ids = {role: model[f"{role}_token_id"] if model.get(f"{role}_token_id") is not None else found.get(role)
           for role in ("bos", "eos", "pad")}
    return {f"{role}_token_id": i for role, i in ids.items() if i is not None}


def _run_tokens(source: Path, meta: dict) -> tuple:
    """(tokenizer, its special tokens by role, the run's task, the task's TaskTokens) of a run's
    tokenizer.json and its checkpoint's configs (`meta`): the vocabulary the run counted from."""
    tokenizer = read_tokenizer(source, "the run's tokenizer", "restore the run's tokenizer.json")
    specials = tokenizer_specials(tokenizer, source.parent)
    train = meta.get("train_config") or {}
    task = train.get("task") or get_arch(meta["arch"]).tasks[0]
    vocab = train.get("vocab_size") or tokenizer.get_vocab_size()
    return tokenizer, specials, task, TaskTokens.of(task, vocab, specials)
