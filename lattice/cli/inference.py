"""`lattice generate` and `lattice eval`: a trained run's checkpoint loaded into any layout.

    lattice generate runs/a --prompt "def f(x):" --max-new-tokens 20
    lattice generate runs/t5 --prompt "reverse these words"   # an encoder-decoder: its output for the source
    lattice eval runs/a --mode 2d --tp 4 --nproc 4
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from lattice.cli.arguments import add_layout_arguments, layout_from_args
from lattice.modes.layout import check_process_count
from lattice.cli.launch import launch_local
from lattice.models import get_arch
from lattice.parallel.context import LatticeConfigError


def add_inference_arguments(p: argparse.ArgumentParser, generate: bool) -> None:
    from lattice.training.config import DATA_FORMATS

    p.add_argument("run", metavar="DIR", help="a run directory written by `lattice train` (or a checkpoint in it)")
    add_layout_arguments(p, arch_from_run=True, dp=None)  # (the processes' own, without --dp)
    p.add_argument("--nproc", type=int, default=None, help="start this many local processes")
    p.add_argument("--seed", type=int, default=0)
    if generate:
        p.add_argument("--prompt", required=True, help="the text to continue (an encoder-decoder's source)")
        p.add_argument("--max-new-tokens", type=int, default=None,
                       help="default 50 (an encoder-decoder's: its target_len)")
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
        p.add_argument("--top-k", type=int, default=None)
    else:
        p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
        p.add_argument("--data", default=None, metavar="PATH",
                       help="evaluate on this text instead (its last 10%%, tokenized with the run's tokenizer)")
        p.add_argument("--data-format", choices=DATA_FORMATS, default=DATA_FORMATS[0])
        p.add_argument("--text-key", default="text")


def load_for_inference(args, nproc: int | None = None):
    """The checkpoint, its model config, the tokenizer the run saved (generate; None if it saved
    none) and the layout, checked, with the processes it will run in when `nproc` is given."""
    from lattice import checkpoint
    from lattice.data.corpus import TOKENIZED, read_tokenizer
    from lattice.modes import get_mode

    ckpt = checkpoint.read(args.run)
    arch = checkpoint.arch_of(ckpt)
    if args.arch is not None and args.arch != arch:
        raise LatticeConfigError(f"{args.run} holds a {arch} model, not {args.arch}; drop --arch (the run's family is "
                                 f"read from it) or pass another run")
    cfg = get_arch(arch).config_class.from_dict(ckpt["model_config"])
    if args.command == "generate" and not {"lm", "seq2seq"} & set(get_arch(arch).tasks):
        raise LatticeConfigError(f"{args.run} holds a {arch} model, an encoder: it does not continue text; score it "
                                 f"with lattice eval {args.run}")
    tokenizer = None
    if args.command == "eval" and args.eval_batches is not None and args.eval_batches < 1:
        raise LatticeConfigError(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if args.command == "generate":
        longest = getattr(cfg, "target_len", None)  # an encoder-decoder's output fits its decoder
        if args.max_new_tokens is None:
            args.max_new_tokens = longest or 50
        if longest is not None and args.max_new_tokens > longest:
            raise LatticeConfigError(f"--max-new-tokens {args.max_new_tokens} exceeds the model's target_len = {longest}; "
                                     f"ask for at most {longest}")
        for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--temperature", args.temperature, 0),
                                   ("--top-k", 1 if args.top_k is None else args.top_k, 1)):
            if value < least:
                raise LatticeConfigError(f"{flag} must be at least {least}, got {value}")
        saved_tokenizer = checkpoint.run_of(args.run) / "tokenizer.json"
        if saved_tokenizer.is_file():  # the tokenizer the run was trained with
            tokenizer = read_tokenizer(saved_tokenizer, "the run's tokenizer", "restore it from a copy of the run")
        elif ckpt.get("train_config", {}).get("data_format") in TOKENIZED:
            fmt = ckpt["train_config"]["data_format"]
            raise LatticeConfigError(f"{args.run} was trained on token ids (--data-format {fmt}) without a tokenizer, so "
                                     f"no prompt can be encoded for it; train with --tokenizer to generate from text")
    layout = layout_from_args(args)
    if args.command == "generate" and layout.cp > 1:
        raise LatticeConfigError(f"generation runs with cp = 1 (each new token attends to every position before it); "
                                 f"drop --cp {layout.cp}, in any tensor layout")
    if args.command == "eval" and layout.cp > 1 and "seq2seq" in get_arch(arch).tasks:
        raise LatticeConfigError(f"lattice eval scores a {arch} model's exact match by greedy generation, which runs "
                                 f"with cp = 1; drop --cp {layout.cp} (any tensor layout serves)")
    get_mode(layout.mode).check_model(cfg, layout.context())  # the layout's size checks
    if nproc is not None:
        check_process_count(layout, nproc, args.command)
    return ckpt, cfg, tokenizer


def smallest_batch(model) -> int:
    """The fewest copies of one prompt that the layout can split (2d: q, 3d: q², ...)."""
    import torch

    for b in range(1, 513):
        try:
            model.mode.check_batch(model.mode.ctx, torch.zeros(b, 1, dtype=torch.int64))
            return b
        except LatticeConfigError:
            continue
    raise LatticeConfigError(f"mode {model.ctx.mode!r} accepts no batch of up to 512 sequences")


def run_inference(args, argv: list[str]) -> int:
    """`lattice generate` and `lattice eval`: load any checkpoint into any layout."""
    import time

    import torch
    import torch.distributed as dist

    from lattice import checkpoint
    from lattice.data.corpus import load_corpus, tokenizer_specials
    from lattice.models import build_model
    from lattice.modes.layout import init

    launched = "WORLD_SIZE" in os.environ
    if args.nproc and args.nproc > 1 and not launched:
        load_for_inference(args, nproc=args.nproc)  # the checkpoint and the layout, before any process starts
        return launch_local(args.nproc, argv)
    ckpt, cfg, tokenizer = load_for_inference(args, nproc=None if launched else 1)
    ctx = init(layout_from_args(args), seed=args.seed)
    try:
        if args.command == "eval":
            from lattice.training.config import TrainConfig
            from lattice.training.evaluation import evaluate, task_score
            from lattice.training.run_spec import model_and_batches

            saved = ckpt.get("train_config", {})
            other = {}
            if args.data:  # other text, read with the tokenizer the run was trained with
                run_dir = checkpoint.run_of(args.run)
                other = {"data": args.data, "data_format": args.data_format, "text_key": args.text_key,
                         "tokenizer": str(run_dir / "tokenizer.json") if (run_dir / "tokenizer.json").exists()
                         else saved.get("tokenizer")}
            # the checkpoint's model as it is, on batches of the lengths its run trained on
            tcfg = TrainConfig.from_dict({**saved, "arch": checkpoint.arch_of(ckpt), "out_dir": None, "progress": False,
                                          "model_from": ckpt["model_config"],
                                          **other,
                                          **({"eval_batches": args.eval_batches} if args.eval_batches else {})})
            _, model, batches, task = model_and_batches(tcfg, ctx, tcfg.corpus(), ckpt, checkpoint.resolve(args.run))
            checkpoint.load_into(ckpt, model)  # weights only
            loss = evaluate(model, batches, ctx, bf16=tcfg.bf16)
            scored = ""
            if task.metric:
                scored = (f", {task.metric} {task_score(task, model, batches, ctx, bf16=tcfg.bf16):.3f} "
                          f"({task.trivial_name} {task.trivial():.3f})")
            if ctx.rank == 0:
                data = tcfg.data or ("the built-in task" if task.metric else "the built-in corpus")
                print(f"val loss {loss:.4f} nats/{task.loss_unit}, perplexity {math.exp(loss):.2f}{scored} "
                      f"({len(batches)} batches of {tcfg.batch_size} x {tcfg.batch_lengths(cfg)[0]} tokens of {data}, "
                      f"{tcfg.task_name}, step {ckpt['step']})")
            return 0
        if tokenizer is not None:
            encode, decode = (lambda text: tokenizer.encode(text).ids), tokenizer.decode
        else:
            corpus = load_corpus(ckpt.get("train_config", {}).get("vocab_size", cfg.vocab_size))
            encode, decode = corpus.encode, corpus.decode
        model = build_model(cfg, ctx)
        checkpoint.load_into(ckpt, model)  # weights only
        ids = encode(args.prompt)
        if not ids:
            raise LatticeConfigError("--prompt encodes to no tokens; give some text")
        copies = smallest_batch(model)
        prompt = torch.tensor([ids] * copies, dtype=torch.int64, device=ctx.device)
        answers = "seq2seq" in model.family.tasks  # an encoder-decoder: its answer, up to the end token
        # a decoder stops at its tokenizer's end-of-text token, as transformers' generate on its export
        eos = None if answers or tokenizer is None else \
            tokenizer_specials(tokenizer, checkpoint.run_of(args.run)).get("eos")
        t0 = time.perf_counter()
        out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                             **({} if eos is None else {"eos_token_id": eos}))
        dt = time.perf_counter() - t0
        if ctx.rank == 0:
            if answers:
                answer = out[0, 1:].tolist()
                answer = answer[:answer.index(cfg.eos_token_id)] if cfg.eos_token_id in answer else answer
                print(decode([t for t in answer if t not in (cfg.pad_token_id, cfg.decoder_start_token_id)]))
            else:
                continuation = out[0, len(ids):].tolist()
                print(args.prompt + decode(continuation[:continuation.index(eos)] if eos in continuation
                                           else continuation))
            made = out.shape[1] - (1 if answers else len(ids))
            print(f"{made} tokens in {dt:.2f} s: {copies / dt:.2f} sequences/s, "
                  f"{copies * made / dt:.1f} tokens/s (batch {copies}, {args.mode} on "
                  f"{ctx.world_size} ranks)", file=sys.stderr)
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
