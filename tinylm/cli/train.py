"""tinylm-train: train a model from the command line (Hydra over conf/config.yaml; examples there).
Under torchrun: torchrun --standalone --nproc_per_node=2 scripts/train.py train.max_steps=500
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tinylm.checkpoint import CHECKPOINTS_DIR, tagged_checkpoint
from tinylm.checkpoint_configs import yaml_in
from tinylm.cli import (
    check_overrides,
    command,
    given,
    key_and_value,
    one_line,
    run_schema,
    run_schemas,
    same_command_again,
    shell_word,
)
from tinylm.config import ConfigError
from tinylm.corpus import HubError, data_root, resolve_files
from tinylm.files import nearest_folder, read_regular_file, write_text_atomic
from tinylm.train.run_config import RunConfig, TrainConfig
from tinylm.train.runtime import TrainingInterrupted, init_distributed
from tinylm.train.trainer import TrainingDiverged, train

PROG = "tinylm-train"
RUN_DIR_KEY = "hydra.run.dir"
GROUPS = ("experiment",)  # the config groups without a key of their own
SWEEP_RECORD = "multirun.yaml"  # what Hydra writes into a sweep's directory before its runs
RECORD = ".hydra"  # a run's record (start_record): config.yaml, hydra.yaml, overrides.yaml
RECORD_BYTES = 1 << 20  # a record file is a few KB
# What a resume may change: how long and where it runs, how often it logs and saves, not what it
# computes (train.max_steps rebuilds the learning-rate schedule: resume.py)
RESUME_MAY_CHANGE = ("train.max_steps", "train.threads", "train.device", "train.compile",
                     "train.log_interval", "train.checkpoint_interval")
NOT_RECORDED = "not set"  # what the record holds for a key it has no value for
PROMPT_WORDS = 4  # a data=text run samples from this many words of its corpus's first line
# Whether hydra.run.dir was there before this command: a refused run removes only what it made
named_run_dir_existed = False


def run_config(values: dict) -> RunConfig:
    """The run's config, checked, in Hydra's run directory (rank 0's under torchrun): the run's
    own record for train.resume=true; a fresh data=text run samples from its corpus's opening."""
    hydra = HydraConfig.get()
    run_dir = shared_run_dir(hydra.runtime.output_dir)
    if values["train"]["resume"] is True:
        return as_recorded(Path(run_dir), values, hydra.overrides.task, hydra.runtime.choices)
    cfg = RunConfig.from_config(values, run_dir)
    given_prompt = any(key_and_value(o)[0] == "train.sample_prompt" for o in hydra.overrides.task)
    # the default is TinyStories' opening, which would make no sense of another corpus
    if hydra.runtime.choices.get("data") == "text" and not given_prompt and \
            cfg.train.sample_prompt == TrainConfig.sample_prompt:
        opening = corpus_opening(cfg)
        if opening:
            cfg.train = dataclasses.replace(cfg.train, sample_prompt=opening)
    return cfg


def corpus_opening(cfg: RunConfig) -> str | None:
    """The first words of the first non-empty line of a local corpus's first file; None if it
    cannot be read (preparing the data says why)."""
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
    """Remove a run directory this command made, with the parents left empty (runs/<date>/) up to
    the current directory, unless it holds a checkpoint. Rank 0 only: it is every rank's."""
    run_dir, cwd = Path(run_dir).resolve(), Path.cwd().resolve()
    if int(os.environ.get("RANK", "0")) > 0 or run_dir == cwd or not run_dir.is_dir() or \
            named_run_dir_existed or last_checkpoint(run_dir):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:
        if parent == cwd or not parent.is_relative_to(cwd) or os.path.ismount(parent) or \
                {p.name for p in parent.iterdir()} - {SWEEP_RECORD}:
            break
        with contextlib.suppress(OSError):  # another process may have written there meanwhile
            (parent / SWEEP_RECORD).unlink(missing_ok=True)
            parent.rmdir()


def last_checkpoint(run_dir: str | Path) -> Path | None:
    return tagged_checkpoint(Path(run_dir) / CHECKPOINTS_DIR, "last")


class LogFile(logging.FileHandler):
    """<run dir>/train.log. A line the disk refuses ends the run in one line, as a checkpoint
    the disk refuses does (logging would print a traceback per line and go on)."""

    def handleError(self, record: logging.LogRecord) -> None:
        raise  # noqa: PLE0704 (called inside emit's `except`: the write's own error)


def start_record(cfg: RunConfig, held: logging.handlers.MemoryHandler) -> None:
    """Once nothing can refuse the run, write .hydra/ and train.log (from the lines `held` kept).
    A resume updates the config, adds what was given now to the run's overrides, and keeps
    Hydra's settings of its start."""
    hydra, record = HydraConfig.get(), Path(cfg.run_dir) / RECORD
    overrides = list(hydra.overrides.task)
    if cfg.train.resume is True:
        now = {key_and_value(o)[0] for o in overrides}
        overrides = [o for o in recorded_overrides(Path(cfg.run_dir))
                     if key_and_value(o)[0] not in now] + overrides
    else:
        write_text_atomic(record / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra}))
    write_text_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg.to_dict()))
    write_text_atomic(record / "overrides.yaml", OmegaConf.to_yaml(overrides))
    log_file = LogFile(Path(cfg.run_dir) / f"{hydra.job.name}.log", encoding="utf-8")
    root = logging.getLogger()
    log_file.setFormatter(next((h.formatter for h in root.handlers
                                if isinstance(h, logging.StreamHandler)), None))
    held.setTarget(log_file)
    held.flush()
    root.removeHandler(held)
    root.addHandler(log_file)


def what_is_intact(when: str, cfg: RunConfig | None) -> str:
    """After a write the disk refused: the checkpoint a resume starts from, and its command."""
    last = last_checkpoint(cfg.run_dir) if cfg else None
    if last is None:
        return same_command_again(PROG)(when)
    return (f"the last good checkpoint, {last}, is intact; {when}, continue with: "
            f"{resume_command(cfg)}")


def stopped(err: KeyboardInterrupt, cfg: RunConfig | None) -> str:
    """What Ctrl-C or SIGTERM left, and the command that continues. The run folder stays."""
    if isinstance(err, TrainingInterrupted):  # rank 0 says it, the one that saved
        return f"stopped by {signal.Signals(err.signum).name} at step {err.step}; saved " \
               f"{err.checkpoint}\ncontinue with:\n  {resume_command(cfg)}" \
            if err.checkpoint else ""
    run_dir = Path(cfg.run_dir) if cfg else None
    if run_dir is None or not (run_dir / RECORD).is_dir():
        return "interrupted"  # before the run started: nothing of it was written
    last = last_checkpoint(run_dir)
    if last is None:
        return (f"interrupted before the run's first checkpoint; {run_dir} keeps its train.log "
                "and TensorBoard logs")
    return f"interrupted; the last checkpoint, {last}, is intact; continue with: " \
           f"{resume_command(cfg)}"


def resume_command(cfg: RunConfig) -> str:
    """The command that continues this run, to paste into a shell."""
    return f"{PROG} train.resume=true {shell_word(RUN_DIR_KEY, cfg.run_dir)}"


def shared_run_dir(output_dir: str) -> str:
    """Under torchrun, rank 0's run directory for every rank (${now:...} may differ by a second
    between ranks); a rank's own, left empty, is removed."""
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
    """Train; say where the checkpoints are and what to run next. Returns the final val loss,
    for Hydra's sweepers."""
    held = logging.handlers.MemoryHandler(capacity=sys.maxsize)  # train.log's first lines
    logging.getLogger().addHandler(held)
    try:
        metrics = train(cfg, on_start=lambda: start_record(cfg, held))
    except BaseException as err:  # an interrupt once the run wrote its record leaves it as it is
        if not isinstance(err, KeyboardInterrupt) or not (Path(cfg.run_dir) / RECORD).exists():
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


# ----------------------------------------------------------------------------------- resume


def as_recorded(run_dir: Path, values: dict, overrides: list[str], choices) -> RunConfig:
    """train.resume=true: the run as it recorded itself (.hydra/config.yaml), with what may
    change (RESUME_MAY_CHANGE) taken from `values`, the composed command line; any other
    override given now must agree with the record, else it is refused in one line naming each.
    A run with no checkpoint is left to checkpoint_to_resume, which says so."""
    last = last_checkpoint(run_dir)
    if last is None:
        return RunConfig.from_config(values, run_dir)
    record = run_dir / RECORD / "config.yaml"
    now = {}  # the last of a key given twice, Hydra's value, where it was given
    for o in OverridesParser.create().parse_overrides(overrides):
        now.pop(o.key_or_group, None)
        now[o.key_or_group] = o
    now.pop("train.resume", None)
    kept = [o for o in recorded_overrides(run_dir)
            if key_and_value(o)[0] not in {*now, "train.resume"}]
    new_run = " ".join([PROG, shell_word("train.resume", str(run_dir)),
                        *map(shlex.quote, [*kept, *(o.input_line for o in now.values())])])
    try:
        recorded = read_record(record)
        if not isinstance(recorded, dict):
            raise ValueError("it holds no mapping of config groups")
        cfg = RunConfig.from_config(recorded, run_dir)
    except FileNotFoundError:
        copy = f"{shlex.join(['mkdir', '-p', str(record.parent)])} && " \
               f"{shlex.join(['cp', str(last / 'config.yaml'), str(record)])}"
        raise ConfigError(
            f"train.resume=true continues {run_dir} as it recorded itself, in {record}, which is "
            f"missing; restore it (its last checkpoint holds the same values: {copy}), or start "
            f"a new run from that checkpoint with the values given here: {new_run}") from None
    except ValueError as err:
        raise ConfigError(f"{record} is not the record of a run ({err}); restore it, or start a "
                          f"new run from its last checkpoint: {new_run}") from None
    try:  # the config groups it chose (hydra.yaml); a choice unrecorded differs from any
        chosen = dig(read_record(run_dir / RECORD / "hydra.yaml"), "hydra.runtime.choices")
    except (FileNotFoundError, ValueError):
        chosen = None
    recorded, differing = cfg.to_dict(), []
    for key, o in now.items():
        then, given_now = (dig(chosen, key), choices[key]) if key in choices else \
            (dig(recorded, key), dig(values, key))
        if key not in RESUME_MAY_CHANGE and then != given_now:
            was = "null" if then is None else then
            differing.append(f"{o.get_key_element()}: {was} when the run started, "
                             f"{o.input_line.partition('=')[2] or o.input_line} now")
    if differing:
        n = len(differing)
        raise ConfigError(
            f"train.resume=true continues {run_dir} as it was started ({record}), and {n} "
            f"override{'s' if n > 1 else ''} given now {'differ' if n > 1 else 'differs'}: "
            f"{'; '.join(differing)}; drop {'them' if n > 1 else 'it'} to continue that run "
            f"(only {', '.join(RESUME_MAY_CHANGE)} may change), or start a new run from its last "
            f"checkpoint: {new_run}")
    may_change = {key.partition(".")[2]: dig(values, key) for key in now
                  if key in RESUME_MAY_CHANGE}
    cfg.train = dataclasses.replace(cfg.train, resume=True, **may_change)
    return cfg


def read_record(file: Path) -> object:
    """A YAML file of a run's .hydra/, parsed; FileNotFoundError where it is missing, ValueError
    where it is not a regular file of a few KB holding YAML."""
    return yaml_in(read_regular_file(file, RECORD_BYTES, "the run's record"))


def recorded_overrides(run_dir: Path) -> list[str]:
    """The overrides a run was started with (.hydra/overrides.yaml; [] where there is none).
    Anything but a list of overrides without Hydra's own settings is refused: a crafted one could
    set Hydra's callbacks, which run code, in a command this one suggests."""
    file = run_dir / RECORD / "overrides.yaml"
    try:
        lines = read_record(file)
    except FileNotFoundError:
        return []
    except ValueError:
        lines = None
    try:
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines) or any(
                o.is_hydra_override() or o.key_or_group == "hydra"
                for o in OverridesParser.create().parse_overrides(lines)):
            raise ValueError(file)
        return lines
    except (ValueError, HydraException):
        raise ConfigError(f"{file} is not the list of overrides a run records; restore it, or "
                          "remove it and give the run's overrides again with train.resume=true"
                          ) from None


def dig(tree: object, key: str) -> object:
    """tree["a"]["b"] for the key "a.b"; NOT_RECORDED where there is no such entry."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return NOT_RECORDED
        tree = tree[part]
    return tree


# ----------------------------------------------------------------------------------- sweeps


def check_sweep(jobs: list[list[str]], compose: Callable[[list[str]], DictConfig]) -> None:
    """Check every job of a sweep (-m) before the first trains (conf/hydra/sweeper/checked.yaml):
    a bad value in a later job would otherwise stop the sweep there."""
    schema = run_schema()
    for number, job in enumerate(jobs):
        try:
            check_overrides(schema, job)
            cfg = compose(job)
            values = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
            RunConfig.from_config(OmegaConf.to_container(values, resolve=True), run_dir="")
        except (ConfigError, HydraException, OmegaConfBaseException) as err:
            said = str(err) if isinstance(err, ConfigError) else one_line(err, schema, GROUPS)
            raise ConfigError(f"{said} (job {number} of the sweep's {len(jobs)}); no job was "
                              "run") from None


def refuse_a_run_dir_that_is_a_file() -> None:
    """Refuse hydra.run.dir naming a file (or a folder under one) before Hydra makes it, and
    note whether it was there."""
    global named_run_dir_existed
    named = given(RUN_DIR_KEY)
    named_run_dir_existed = named is not None and Path(named).exists()
    if named is not None:
        nearest_folder(Path(named), RUN_DIR_KEY, named, "cannot hold the run")


main = command(
    PROG, "config", run_schema(), run_training, build=run_config, schemas=run_schemas(),
    groups=GROUPS, errors=(ValueError, FileNotFoundError, HubError, TrainingDiverged),
    before=refuse_a_run_dir_that_is_a_file, intact=what_is_intact, interrupted=stopped,
    refused=lambda: remove_new_run_dir(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
