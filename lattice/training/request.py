"""What a `lattice train` run starts from, decided in one place: a request as the person gave it
(`TrainRequest`: the layout, the flags given, the run-directory choices) becomes one run
specification (`prepare_run` -> `RunSpec`): the checkpoint it resumes (read, its family, data,
tokenizer and model kept, its schedule changes allowed or refused), the weights it starts from
(`--init-from`), the tokenizer and data it reads, the directory it writes into, and whether a
single-file checkpoint is converted first. The launcher runs it before starting processes and
every rank before any process group exists; the run directory is then written from the
specification (`write_run_files`) and the Trainer builds from it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from lattice import checkpoint
from lattice.checkpoint import run_dir
from lattice.checkpoint.files import check_out_dir
from lattice.data.corpus import check_data, data_hash, listed_files, read_tokenizer, write_specials
from lattice.models import DEFAULT_ARCH, get_arch
from lattice.modes.layout import Layout, check_process_count
from lattice.parallel.context import LatticeConfigError
from lattice.training import faults
from lattice.training.config import RESUMED_FIELDS, TrainConfig, flag_defaults
from lattice.training.run_spec import RunSpec, specify_run

class JobOver(Exception):
    """A launcher restarted the workers of a job whose run has ended: finished, or stopped by
    what a restart would meet again. Nothing to train; the message says which."""


@dataclasses.dataclass(frozen=True)
class Restart:
    """Workers a launcher (torchrun's agent) started again for the job their run belongs to:
    `run_id` (TORCHELASTIC_RUN_ID, recorded in the run's job record when it started), `count`
    (TORCHELASTIC_RESTART_COUNT: this node's restarts), the record's `state` and `reason`, the
    newest intact checkpoint to resume (None: start again) and the newer ones `skipped` with
    their reasons, and `failed_at`: the last heartbeat of the rank that stopped first."""

    run_id: str
    count: int
    state: str
    reason: str | None = None
    resume: Path | None = None
    skipped: tuple = ()
    failed_at: float | None = None


def elastic_restart(out_dir: str | None) -> Restart | None:
    """The Restart this process is part of, or None for a run a person started: the launcher's
    job id must be the one the run in `out_dir` recorded at its start (torchrun's default id
    "none" names no job, so there the restart count must say so too). Read-only, the same on
    every rank."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not out_dir or not run_id:
        return None
    record = run_dir.read_job(Path(out_dir))
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if record is None or record.get("run_id") != run_id or (run_id == "none" and count == 0):
        return None
    resume, skipped = run_dir.newest_intact(Path(out_dir))
    return Restart(run_id, count, record.get("state", "running"), record.get("reason"), resume, tuple(skipped),
                   faults.last_heartbeat(Path(out_dir)))


#: the TrainConfig fields that say how a run's data are read, kept by a resume without --data
DATA_FIELDS = ("data", "data_format", "val_data", "text_key", "pair_key", "source_key", "target_key", "tokenizer")


@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """A training request as given, nothing read or decided: the layout, every TrainConfig flag
    (None for a RESUMED_FIELDS flag not given: then the resumed run's value, else the default),
    the family's size fields given, and the checkpoint and run-directory choices."""

    layout: Layout
    given: dict
    sizes: dict = dataclasses.field(default_factory=dict)
    resume: str | None = None
    overwrite: bool = False
    allow_config_change: bool = False
    #: the mode's options given (the layout holds them with the rest chosen); None: all of them
    given_options: dict | None = None

    def config(self, resumed: dict | None = None, **changes) -> TrainConfig:
        """The TrainConfig asked for: a RESUMED_FIELDS flag not given takes `resumed`'s recorded
        value (a resumed run's train_config), else TrainConfig's default; `changes` replace fields."""
        given, defaults = dict(self.given), flag_defaults()
        for name in RESUMED_FIELDS:
            if given.get(name) is None:
                given[name] = (resumed or {}).get(name, defaults[name])
        given["arch"] = given["arch"] or DEFAULT_ARCH
        given["model_sizes"] = dict(self.sizes)
        return TrainConfig(**{**given, **changes})


def prepare_run(request: TrainRequest, nproc: int | None = None, choose_options: bool = True) -> RunSpec:
    """The run `request` asks for, checked whole and decided without processes (and, with
    `nproc`, against the processes the launcher is about to start): every refusal of a bad
    request is made here, once, in one line. The mode's options not given take the planner's
    choice (`options_for_run`; not with `choose_options` False). Changes nothing but the token
    cache (an explicit out-dir is created if missing, once everything else passed, so that a
    refused request leaves no directory behind)."""
    layout = request.layout
    restart = elastic_restart(request.given['out_dir'])
    if restart is not None and restart.state != "running":
        raise JobOver(f"{request.given['out_dir']}: the run of job {restart.run_id} has "
                      + ("finished" if restart.state == "finished" else f"stopped ({restart.reason})")
                      + f"; nothing to run on restart {restart.count}")
    if restart is not None and restart.resume is not None:  # the run's own newest intact checkpoint, whatever
        request = dataclasses.replace(request, resume=str(restart.resume))  # the command resumed first
    elif os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and not request.given['out_dir']:
        raise LatticeConfigError("the launcher restarts failed workers (--max-restarts), and restarted workers "
                                 "resume their run's newest checkpoint: give the run its directory with --out-dir")
    ckpt = checkpoint.read(request.resume) if request.resume else None
    where = checkpoint.resolve(request.resume) if ckpt is not None else None
    resumed_run = checkpoint.run_of(where) if ckpt is not None and checkpoint.is_sharded(ckpt) else None
    if restart is not None:  # the job's own directory, as it is (what a restart skipped is set aside later)
        run = run_dir.RunDir(Path(request.given['out_dir']))
    else:
        run = run_dir.choose(request.given['out_dir'], resumed_run, int(ckpt["step"]) if ckpt is not None else None,
                             request.overwrite)
    saved = ckpt.get("train_config", {}) if ckpt is not None else {}
    asked_arch = request.given['arch']
    if ckpt is not None and asked_arch is not None and checkpoint.arch_of(ckpt) != asked_arch:
        raise LatticeConfigError(f"--resume {where} holds a {checkpoint.arch_of(ckpt)} model, and --arch {asked_arch} "
                                 f"asks for another family; drop --arch (a resumed run continues its own family)")
    init = None
    if ckpt is None and request.given['init_from'] and Path(request.given['init_from']).exists():
        init = checkpoint.read(request.given['init_from'])  # read once: the specification takes it as it is
    # the family: --arch, else the checkpoint's that the run resumes or starts from
    arch = asked_arch or next((checkpoint.arch_of(c) for c in (ckpt, init) if c is not None), DEFAULT_ARCH)
    recorded = {}
    if ckpt is not None:  # the run continues as it was: its data, tokenizer and model
        recorded = {**_recorded_data(request, saved, where), **_resumed_tokenizer(request, where, saved),
                    "model_from": _resumed_model(request, ckpt, arch)}
    if init is not None:
        recorded = _init_from_model(request, init, arch)
    tcfg = request.config(saved if ckpt is not None else None, arch=arch, out_dir=str(run.out), **recorded)
    check_data(tcfg.data, tcfg.tokenizer, tcfg.vocab_size, tcfg.data_format)
    corpus = tcfg.corpus()
    chosen = options_for_run(request, tcfg, corpus) if choose_options else None
    if chosen is not None:
        layout = layout.replace(options=chosen.options)
    spec = specify_run(tcfg, layout.context(), corpus, resume=ckpt, resume_from=where,
                       allow_config_change=request.allow_config_change, init_from=init)
    if nproc is not None:  # after the layout's own refusals, which say more about the request
        check_process_count(layout, nproc, "train")
    # last, as these create directories: a request refused above leaves none behind
    if run.fresh:  # created later, by one process: here only its parent
        check_out_dir(run.out.parent, checkpoint.FILENAME)
    else:
        check_out_dir(run.out, checkpoint.FILENAME)
        faults.RunLock(run.out).probe()
    return dataclasses.replace(spec, layout=layout, corpus=corpus, run=run, restart=restart, options=chosen,
                               resume_path=where, single_file=ckpt is not None and not checkpoint.is_sharded(ckpt))


def options_for_run(request: TrainRequest, tcfg: TrainConfig, corpus):
    """The planner's choice of the options of the request's mode that were not given
    (lattice.planner.options.choose_options) for this model, global batch, ZeRO stage, precision
    and checkpointing, on the rates of this device (lattice.cost.machines.machine_of_device) and
    within its memory (a GPU's; on CPU no limit), or None where all are given. The same on
    every rank: it reads nothing that differs between them."""
    if request.given_options is None:
        return None
    import torch

    from lattice.cost.machines import machine_of_device
    from lattice.planner.options import choose_options
    from lattice.planner.search import USABLE_MEMORY

    cuda = torch.cuda.is_available()
    device = int(os.environ.get("LOCAL_RANK", "0"))  # this rank's own GPU, not every rank's first
    machine, name = machine_of_device(torch.cuda.get_device_name(device) if cuda else None)
    limit = USABLE_MEMORY * torch.cuda.get_device_properties(device).total_memory if cuda else None
    choice = choose_options(tcfg.model_config(corpus.vocab_size, corpus.specials), request.layout,
                            given=request.given_options, batch=tcfg.batch_size, machine=machine, memory_limit=limit,
                            zero=tcfg.zero, precision=tcfg.precision, checkpointing=tcfg.activation_checkpointing,
                            selective=tcfg.selective_checkpointing)
    return None if choice is None else dataclasses.replace(choice, machine=name)


def sharded_resume(spec: RunSpec, ctx) -> RunSpec:
    """`spec` resuming the sharded form of its checkpoint: a single-file checkpoint (`lattice
    convert`'s export, or OUT/ckpt.pt of an older run) converted by rank 0 into
    OUT/checkpoints/step-N, as `lattice convert` does; every rank then resumes that."""
    if not spec.single_file:
        return spec
    import torch.distributed as dist

    from lattice.checkpoint import sharded
    from lattice.checkpoint.convert import import_single

    out = spec.run.out
    target = out / sharded.SUBDIR / sharded.step_name(int(spec.resume["step"]))
    alone = dist.new_group([0]) if ctx.world_size > 1 else None  # (every rank creates every group)
    if ctx.rank == 0:
        import_single(spec.resume, out, group=alone)
        print(f"converted the single-file checkpoint {spec.resume_path} into {target} (as `lattice convert` does); "
              f"resuming from it", flush=True)
    if ctx.world_size > 1:
        dist.barrier()
    return dataclasses.replace(spec, resume=checkpoint.read(target), single_file=False)


def write_run_config(spec: RunSpec, config_toml: str) -> None:
    """The run's resolved flags (`config_toml`) into its directory's config.toml, which `lattice
    train --config` reads back."""
    (spec.run.out / "config.toml").write_text(config_toml)


def write_run_files(spec: RunSpec, corpus, labels: list[str] | None) -> None:
    """The run directory describes what its run reads: the tokenizer and its special tokens, and
    data.json (the data's identity and the class names of a classifier). A resumed run's own
    tokenizer file stays as it is, byte for byte."""
    out, tcfg = spec.run.out, spec.cfg
    own = tcfg.tokenizer and Path(tcfg.tokenizer).resolve() == (out / "tokenizer.json").resolve()
    if corpus.tokenizer is not None and not own:  # (token files read without --tokenizer have none)
        corpus.tokenizer.save(str(out / "tokenizer.json"))
        write_specials(corpus, out)
    files = listed_files(tcfg.data, tcfg.data_format) if tcfg.data else ["built-in corpus (pydoc_data.topics)"]
    (out / "data.json").write_text(json.dumps({
        "data": tcfg.data, "files": files, "format": tcfg.data_format, "val_data": tcfg.val_data,
        "text_key": tcfg.text_key,
        "content_hash": tcfg.data_hash, "tokenizer": tcfg.tokenizer, **({"labels": labels} if labels else {})},
        indent=1) + "\n")


def _recorded_data(request: TrainRequest, saved: dict, where) -> dict:
    """Without --data, a resumed run continues on the data it was trained on (and refuses it if
    the files changed since): the TrainConfig fields that say so. --data given explicitly trains
    on that instead."""
    if request.given['data'] is not None or not saved.get("data"):
        return {}
    data = {k: saved[k] for k in DATA_FIELDS if k in saved}
    now = data_hash(data["data"], saved.get("data_format", "text"), TrainConfig.from_dict(saved).data_keys())
    if saved.get("data_hash") and now != saved["data_hash"]:
        raise LatticeConfigError(f"the data {data['data']} changed since {where} was saved (content hash "
                                 f"{saved['data_hash']} then, {now} now); pass --data {data['data']} to train on it as "
                                 f"it is, or restore the original files")
    return data


def _resumed_model(request: TrainRequest, ckpt: dict, arch: str) -> dict:
    """The model a resumed run continues: its checkpoint's whole config (an imported HF model's
    sizes included), with the fields of a --model preset given in the request (a mismatch is
    then refused by name, as for any size flag)."""
    model = dict(ckpt["model_config"])
    if request.given['model'] is not None:
        config_class = get_arch(arch).config_class
        if request.given['model'] not in config_class.presets:
            config_class.preset(request.given['model'])  # refuses the unknown name, listing the family's presets
        model.update(config_class.presets[request.given['model']])
    return model


def _init_from_model(request: TrainRequest, init: dict, arch: str) -> dict:
    """A run started --init-from a checkpoint of its family trains the checkpoint's model (its
    whole config, an imported HF model's sizes included; a --model preset or size flags replace
    their fields, and the task sets the heads it adds), reading text as those weights were
    trained to: with the checkpoint run's tokenizer (TrainConfig takes it) and its vocabulary
    size, unless --tokenizer or --vocab-size say otherwise."""
    if checkpoint.arch_of(init) != arch or "model_config" not in init:
        return {}  # refused with its reason when the run is specified
    model = {k: v for k, v in _resumed_model(request, init, arch).items() if k not in ("num_labels", "dropout")}
    out = {"model_from": model}
    run_tokenizer = checkpoint.run_of(checkpoint.resolve(request.given['init_from'])) / "tokenizer.json"
    if request.given['vocab_size'] is None and request.given['tokenizer'] is None and run_tokenizer.is_file():
        saved = init.get("train_config", {}).get("vocab_size")
        out["vocab_size"] = saved or read_tokenizer(run_tokenizer, "the checkpoint's tokenizer",
                                                    "restore its file or pass --tokenizer").get_vocab_size()
    return out


def _resumed_tokenizer(request: TrainRequest, where: Path, saved: dict) -> dict:
    """A resumed run reads text with the tokenizer its weights were trained with, the run's
    tokenizer.json, on its recorded data or on new --data alike: the TrainConfig field that says
    so. An explicit --tokenizer is refused when its ids differ from that one's."""
    run_tokenizer = checkpoint.run_of(where) / "tokenizer.json"
    if not run_tokenizer.is_file():  # a single file exported elsewhere: the data decide
        return {}
    tokenizer, vocab_size = request.given['tokenizer'], request.given['vocab_size']
    if tokenizer is None:
        size = read_tokenizer(run_tokenizer, "the run's tokenizer", "restore the run's file").get_vocab_size()
        if vocab_size is not None and vocab_size != size:
            raise LatticeConfigError(f"--vocab-size {vocab_size} asks for a new BPE, and {where} reads its text "
                                     f"with its own tokenizer.json of {size} tokens (vocab_size {size} vs "
                                     f"{vocab_size}); drop --vocab-size to continue the run, or start a new "
                                     f"one with --init-from {where}")
        # the vocabulary the run counted from (an import records none: its tokenizer's)
        return {"tokenizer": str(run_tokenizer), "vocab_size": saved.get("vocab_size") or size}
    given = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    if given.is_file() and given.resolve() != run_tokenizer.resolve():
        theirs = read_tokenizer(run_tokenizer, "the run's tokenizer", "restore the run's file").get_vocab()
        ours = read_tokenizer(given, "--tokenizer", "pass a tokenizer.json, or drop --tokenizer").get_vocab()
        if theirs != ours:
            moved = sum(ours.get(token) != i for token, i in theirs.items())
            raise LatticeConfigError(f"--tokenizer {tokenizer} gives {moved} of the {len(theirs)} tokens of "
                                     f"{run_tokenizer} other ids, and the resumed weights were trained on those ids; "
                                     f"drop --tokenizer to keep the run's, or start a new run (--init-from {where})")
    return {}
