"""tinylm-train: train a model from the command line (Hydra over conf/config.yaml).

    tinylm-train                                        # TinyStories sample, BPE, a few minutes
    tinylm-train experiment=shakespeare_char            # nanoGPT's CPU Shakespeare settings
    tinylm-train model.n_layer=2 train.max_steps=200 hydra.run.dir=runs/small
    tinylm-train train.resume=true hydra.run.dir=runs/small
    tinylm-train -m optim.lr=1e-3,3e-3                  # a sweep: one run directory each
    torchrun --standalone --nproc_per_node=2 scripts/train.py train.max_steps=500
    (options: conf/{model,data,tokenizer,optim,train,experiment}/*.yaml)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import logging.handlers
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tinylm.checkpoint import CHECKPOINTS_DIR, tagged_checkpoint
from tinylm.checkpoint_configs import yaml_in
from tinylm.cli import (
    command,
    config_dir,
    given,
    key_and_value,
    one_line,
    refuse_loose_bools,
    refuse_schema_choice,
    register,
    run_or_exit,
    run_schema,
    run_schemas,
    same_command_again,
    shell_word,
)
from tinylm.config import ConfigError
from tinylm.corpus import HubError, data_root, resolve_files
from tinylm.files import nearest_folder, write_text_atomic
from tinylm.train.run_config import RunConfig, TrainConfig
from tinylm.train.runtime import TrainingInterrupted, init_distributed
from tinylm.train.trainer import TrainingDiverged, train

PROG = "tinylm-train"
RUN_DIR_KEY = "hydra.run.dir"
GROUPS = ("experiment",)  # the config groups without a key of their own
SWEEP_RECORD = "multirun.yaml"  # what Hydra writes into a sweep's directory before its runs
RECORDED_OVERRIDES = Path(".hydra") / "overrides.yaml"  # a run's command line (start_record)
# What a resume may give other values than the run was started with: how long and where it
# runs and how often it logs and saves, not what it computes (train.max_steps rebuilds the
# learning-rate schedule: resume.py)
RESUME_MAY_CHANGE = ("train.max_steps", "train.threads", "train.device", "train.compile",
                     "train.log_interval", "train.checkpoint_interval")
NOT_RECORDED = object()  # a key the run's record has no value for
PROMPT_WORDS = 4  # a data=text run samples from this many words of its corpus's first line
# Whether the run directory named on the command line was there before this command: a run that
# is refused removes only a directory it made.
named_run_dir_existed = False


def run_config(values: dict) -> RunConfig:
    """Every dataclass of the run, checked, writing to Hydra's run directory (rank 0's under
    torchrun); a data=text run samples from its own corpus's opening words."""
    hydra = HydraConfig.get()
    cfg = RunConfig.from_config(values, shared_run_dir(hydra.runtime.output_dir))
    given_prompt = any(key_and_value(o)[0] == "train.sample_prompt" for o in hydra.overrides.task)
    # the default is TinyStories' opening, which would make no sense of another corpus
    if hydra.runtime.choices.get("data") == "text" and not given_prompt and \
            cfg.train.sample_prompt == TrainConfig.sample_prompt:
        opening = corpus_opening(cfg)
        if opening:
            cfg.train = dataclasses.replace(cfg.train, sample_prompt=opening)
    return cfg


def corpus_opening(cfg: RunConfig) -> str | None:
    """The first words of the first non-empty line of a local corpus's first file (where its
    training text starts); None if the files cannot be read (preparing the data says why)."""
    root, why = data_root(cfg.data.data_root)
    try:
        first = resolve_files(root, cfg.data.files, cfg.data.name, why)[0]
        with open(first, "rb") as f:
            head = f.read(1 << 16).decode("utf-8", errors="ignore")  # a line, not the corpus
    except (OSError, ValueError, IndexError):
        return None
    line = next((line for line in head.splitlines() if line.strip()), "")
    return " ".join(line.split()[:PROMPT_WORDS])[:100] or None


def remove_new_run_dir(run_dir: str | Path) -> None:
    """A run that ended before its first checkpoint, in a directory this command made, leaves
    nothing behind: the directory goes, and so do the parents left empty (runs/<date>/), up to
    the current directory. Rank 0 only: the directory is every rank's."""
    run_dir, cwd = Path(run_dir).resolve(), Path.cwd().resolve()
    if int(os.environ.get("RANK", "0")) > 0 or run_dir == cwd or not run_dir.is_dir() or \
            named_run_dir_existed or tagged_checkpoint(run_dir / CHECKPOINTS_DIR, "last"):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:
        if parent == cwd or not parent.is_relative_to(cwd) or os.path.ismount(parent) or \
                {p.name for p in parent.iterdir()} - {SWEEP_RECORD}:
            break
        with contextlib.suppress(OSError):  # another process may have written there meanwhile
            (parent / SWEEP_RECORD).unlink(missing_ok=True)
            parent.rmdir()


class LogFile(logging.FileHandler):
    """<run dir>/train.log. A line the disk refuses ends the run in one line, as a checkpoint
    the disk refuses does (logging would print a traceback per line and go on)."""

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 (called inside emit's `except`: the write's own error)


def start_record(cfg: RunConfig, held: logging.handlers.MemoryHandler) -> None:
    """Once nothing can refuse the run any more, write its record: .hydra/ (the composed
    config, Hydra's settings, the overrides: what a resume repeats) and train.log, which starts
    with the lines `held` kept since the command began."""
    hydra = HydraConfig.get()
    record = Path(cfg.run_dir) / ".hydra"
    write_text_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg.to_dict()))
    write_text_atomic(record / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra}))
    write_text_atomic(record / "overrides.yaml", OmegaConf.to_yaml(hydra.overrides.task))
    log_file = LogFile(Path(cfg.run_dir) / f"{hydra.job.name}.log", encoding="utf-8")
    root = logging.getLogger()
    log_file.setFormatter(next((h.formatter for h in root.handlers
                                if isinstance(h, logging.StreamHandler)), None))
    held.setTarget(log_file)
    held.flush()
    root.removeHandler(held)
    root.addHandler(log_file)


def what_is_intact(cfg: RunConfig, when: str) -> str:
    """After a write the disk refused: the checkpoint a resume starts from, and its command."""
    last = tagged_checkpoint(Path(cfg.run_dir) / CHECKPOINTS_DIR, "last")
    if last is None:
        return same_command_again(PROG)(when)
    return (f"the last good checkpoint, {last}, is intact; {when}, continue with: "
            f"{resume_command(cfg)}")


def resume_command(cfg: RunConfig) -> str:
    """The command that continues this run, to paste into a shell."""
    return f"{PROG} train.resume=true {shell_word(RUN_DIR_KEY, cfg.run_dir)}"


def shared_run_dir(output_dir: str) -> str:
    """Under torchrun, rank 0's run directory for every rank: ${now:...} may differ by a second
    between ranks, and a rank's own directory, left empty, is removed."""
    rank, _, world_size = init_distributed()
    if world_size == 1:
        return output_dir
    dirs = [output_dir]
    dist.broadcast_object_list(dirs, src=0)
    if rank > 0 and dirs[0] != output_dir:
        with contextlib.suppress(OSError):  # only while empty: nothing of anybody else's goes
            Path(output_dir).rmdir()
    return dirs[0]


def run_training(cfg: RunConfig) -> float | None:
    """Train; say where the checkpoints are and what to run next. The return value (the final
    val loss) feeds Hydra's sweepers."""
    held = logging.handlers.MemoryHandler(capacity=sys.maxsize)  # train.log's first lines
    logging.getLogger().addHandler(held)
    try:
        metrics = run_or_exit(
            PROG, lambda: train(cfg, on_start=lambda: start_record(cfg, held)),
            errors=(ValueError, FileNotFoundError, HubError, TrainingDiverged),
            intact=lambda when: what_is_intact(cfg, when))
    except TrainingInterrupted as err:
        if err.checkpoint is not None:
            print(f"\n{PROG}: stopped by {signal.Signals(err.signum).name} at step {err.step}; "
                  f"saved {err.checkpoint}\ncontinue with:\n  {resume_command(cfg)}",
                  file=sys.stderr)
        sys.exit(128 + err.signum)
    except BaseException:
        remove_new_run_dir(cfg.run_dir)
        raise
    finally:
        root = logging.getLogger()
        root.removeHandler(held)  # a refused run's lines are dropped with it
        for handler in root.handlers[:]:
            if isinstance(handler, LogFile):  # a sweep's next run writes its own
                root.removeHandler(handler)
                handler.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if "checkpoint" in metrics:  # rank 0
        print_next_steps(metrics, cfg)
    return metrics["val_loss"]


def print_next_steps(metrics: dict, cfg: RunConfig) -> None:
    """Where the checkpoints and logs are, and the commands to look at them."""
    run_dir = metrics["run_dir"]
    # inside the current directory (os.path.relpath raises across two Windows drives)
    if Path(os.path.abspath(run_dir)).is_relative_to(Path.cwd()):
        run_dir = os.path.relpath(run_dir)
    val = metrics["val_loss"]
    speed = f" ({metrics['tokens_per_sec']:,.0f} tokens/s)" if metrics["tokens_per_sec"] else ""
    loss = f"val loss {val:.4f} (perplexity {metrics['val_perplexity']:.2f}), " if val else ""
    best, last = (os.path.basename(metrics[k]) for k in ("best_checkpoint", "checkpoint"))
    print(f"\nDone: {metrics['step']} steps in {metrics['seconds']:.0f} s{speed}; {loss}"
          f"best {metrics['best_val_loss']:.4f}\n"
          f"  checkpoints: {run_dir}/checkpoints/best -> {best}, last -> {last}\n"
          f"  TensorBoard logs: {run_dir}/tensorboard\n"
          f"Next:\n"
          f"  tinylm-generate {shell_word('checkpoint', run_dir)} "
          f"{shell_word('prompt', cfg.train.sample_prompt, quoted=True)}\n"
          f"  tensorboard --logdir {shlex.quote(run_dir)}")


def resume_as_started(run_dir: Path) -> None:
    """Make `train.resume=true hydra.run.dir=<run>` continue the run as it was started: the
    overrides it recorded go first on the command line that Hydra reads (sys.argv), then those
    given now. One given now must repeat the run's value (RESUME_MAY_CHANGE aside), else the
    command is refused in one line naming each that differs."""
    args = sys.argv[1:]
    if {"-m", "--multirun"} & set(args):
        return  # a sweep's jobs record their own overrides; a resume is of one run
    try:
        now = OverridesParser.create().parse_overrides([a for a in args if a[:1] != "-"])
    except HydraException:
        return  # Hydra refuses it in one line
    if not any(o.key_or_group == "train.resume" and o.value() is True for o in now) or \
            not (run_dir / RECORDED_OVERRIDES).exists():
        return
    base = {(o.key_or_group, o.package): o for o in recorded_overrides(run_dir)
            if o.key_or_group != "train.resume"}
    started = started_values(run_dir)
    added, differing = [], []  # one given again with the run's value adds nothing: dropped
    for o in now:
        key = (o.key_or_group, o.package)
        recorded = base.get(key)
        if o.key_or_group in (*RESUME_MAY_CHANGE, "train.resume") or o.is_hydra_override():
            base.pop(key, None)
            added.append(o)
        elif (recorded.type != o.type or recorded.value() != o.value()) if recorded else \
                started(o.key_or_group) != o.value():
            was = value_text(recorded) if recorded else shown(started(o.key_or_group))
            differing.append(f"{o.get_key_element()}: {was} when the run started, "
                             f"{value_text(o)} now")
    if differing:
        given_keys = {(o.key_or_group, o.package) for o in now}
        kept = [o.input_line for key, o in base.items() if key not in given_keys]
        changed = [o.input_line for o in now if o.key_or_group not in ("train.resume",
                                                                         RUN_DIR_KEY)]
        new_run = " ".join([PROG, shell_word("train.resume", str(run_dir)),
                            *map(shlex.quote, kept + changed)])
        n = len(differing)
        raise ConfigError(
            f"train.resume=true continues {run_dir} as it was started "
            f"({run_dir / RECORDED_OVERRIDES}), and {n} override{'s' if n > 1 else ''} given "
            f"now {'differ' if n > 1 else 'differs'}: {'; '.join(differing)}; drop "
            f"{'them' if n > 1 else 'it'} to continue that run (only "
            f"{', '.join(RESUME_MAY_CHANGE)} may change), or start a new run from its last "
            f"checkpoint: {new_run}")
    flags = [arg for arg in args if arg[:1] == "-"]
    sys.argv[1:] = [*flags, *(o.input_line for o in base.values()),
                    *(o.input_line for o in added)]


def value_text(override: Override) -> str:
    """The value of `override` as typed (key=value), or the whole of a deletion (~key)."""
    key, equals, value = override.input_line.partition("=")
    return value if equals else key


def shown(value: object) -> str:
    """A value of the run's record as the message says it."""
    return "not set" if value is NOT_RECORDED else "null" if value is None else str(value)


def read_record(file: Path) -> object:
    """A YAML file of a run's .hydra/ record, parsed; ValueError if it cannot be one."""
    if not file.is_file() or file.stat().st_size > 1 << 20:  # a FIFO would block the read
        raise ValueError(f"{file} is not a file of a few KB")
    try:
        return yaml_in(file)  # ValueError where it is not YAML
    except OSError as err:
        raise ValueError(f"{file}: {err.strerror}") from None


def recorded_overrides(run_dir: Path) -> list[Override]:
    """The overrides a run was started with, as .hydra/overrides.yaml records them (a YAML list
    of strings, none of Hydra's own settings); anything else is refused in one line naming the
    file: a crafted one could set Hydra's callbacks, which run code."""
    file = run_dir / RECORDED_OVERRIDES
    try:
        lines = read_record(file)
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
            raise ValueError(file)
        overrides = OverridesParser.create().parse_overrides(lines)
        if any(o.is_hydra_override() or o.key_or_group == "hydra" for o in overrides):
            raise ValueError(file)  # Hydra records those in hydra.yaml, never here
        return overrides
    except (ValueError, HydraException):
        raise ConfigError(f"{file} is not the list of overrides a run records; restore it, or "
                          "remove it and give the run's overrides again with train.resume=true"
                          ) from None


def started_values(run_dir: Path) -> Callable[[str], object]:
    """What a key was when the run started, as its .hydra/ record says: a group's choice
    (hydra.yaml: data -> tinystories), else a config value (config.yaml); NOT_RECORDED where
    neither says."""
    def record(name: str) -> object:
        with contextlib.suppress(ValueError):
            return read_record(run_dir / ".hydra" / name)
        return None

    config, choices = record("config.yaml"), dig(record("hydra.yaml"), "hydra.runtime.choices")
    choices = choices if isinstance(choices, dict) else {}
    return lambda key: choices[key] if key in choices else dig(config, key)


def dig(tree: object, key: str) -> object:
    """tree["a"]["b"] for the key "a.b"; NOT_RECORDED where there is no such entry."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return NOT_RECORDED
        tree = tree[part]
    return tree


def refuse_a_bad_sweep_job() -> None:
    """A sweep (-m) checks every job's values before its first job trains: a bad value in a
    later job would stop the sweep there, and the jobs after it would never run. (Hydra
    composes every job first, but the values are checked only as each job builds its config.)"""
    flags = {arg for arg in sys.argv[1:] if arg.startswith("-")}
    if not flags & {"-m", "--multirun"} or flags - {"-m", "--multirun"}:
        return  # not a sweep, or one with Hydra's other flags (--config-name): Hydra checks it
    overrides = [arg for arg in sys.argv[1:] if arg not in flags]
    try:
        jobs = sweep_jobs(overrides)
    except HydraException:
        return  # a sweep Hydra's basic sweeper refuses too (interval(...)): it says so
    register(run_schemas())
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for number, job in enumerate(jobs):
            try:
                cfg = compose("config", overrides=job)
                refuse_loose_bools(run_schema(), job)
                refuse_schema_choice(job)
                RunConfig.from_config(OmegaConf.to_container(cfg, resolve=True), run_dir="")
            except ConfigError as err:
                refused = str(err)
            except (HydraException, OmegaConfBaseException) as err:
                refused = one_line(err, run_schema(), GROUPS)
            else:
                continue
            sys.exit(f"{PROG}: error: {refused} (job {number} of the sweep's {len(jobs)}); no "
                     "job was run")


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, numbered as Hydra's basic sweeper runs them: every value of each
    swept key (a,b or range(...)) with every value of the others."""
    choices = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        values = override.sweep_string_iterator() if override.is_sweep_override() else \
            [override.get_value_element_as_str()]
        choices[key] = [f"{key}={value}" for value in values]
    return [list(job) for job in itertools.product(*choices.values())]


compose_and_train = command(
    PROG, "config", run_schema(), run_training, build=run_config, schemas=run_schemas(),
    groups=GROUPS,
    refused=lambda: remove_new_run_dir(HydraConfig.get().runtime.output_dir))


def main() -> None:
    """Console entry."""
    global named_run_dir_existed
    named = given(RUN_DIR_KEY)
    named_run_dir_existed = named is not None and Path(named).exists()
    if named is not None:
        run_or_exit(PROG, lambda: nearest_folder(Path(named), RUN_DIR_KEY, named,
                                                 "cannot hold the run"))
        run_or_exit(PROG, lambda: resume_as_started(Path(named)))
    refuse_a_bad_sweep_job()
    compose_and_train()


if __name__ == "__main__":
    main()
