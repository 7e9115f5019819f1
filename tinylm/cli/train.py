"""tinylm-train: train a model from the command line (Hydra over conf/config.yaml).

    tinylm-train                                        # TinyStories sample, BPE, a few minutes
    tinylm-train experiment=shakespeare_char            # nanoGPT's CPU Shakespeare settings
    tinylm-train model.n_layer=2 train.max_steps=200 hydra.run.dir=runs/small
    tinylm-train train.resume=true hydra.run.dir=runs/small
    tinylm-train -m optim.lr=1e-3,3e-3                  # a sweep: one run directory each
    torchrun --standalone --nproc_per_node=2 scripts/train.py train.max_steps=500
    (options: conf/{model,data,tokenizer,optim,train,experiment}/*.yaml)

Bad input ends the command with one line naming the key, the value and what is allowed, before
any work starts: the command line is composed and checked here first, because Hydra's own errors
span several lines.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys

import hydra
from omegaconf import DictConfig

from tinylm.cli import run_or_exit
from tinylm.config import ConfigError, config_dir

PROG = "tinylm-train"


def _condense(err: Exception, override: str | None) -> str:
    """One line out of Hydra's multi-line composition errors."""
    from hydra.errors import MissingConfigException

    from tinylm.train import RunConfig

    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").split("/")[0]
        return (f"{override or err.missing_cfg_file}: there is no {err.missing_cfg_file}.yaml; "
                f"allowed {group} options: {', '.join(sorted(err.options)) or 'none'}")
    text = f"{err} {err.__cause__ or ''}"
    found = re.search(r"Could not (?:override|delete|append to) '([^']+)'", text) or \
        re.search(r"Key '([^']+)' is not in struct", text)
    if found:
        key = found.group(1)
        group = key.split(".")[0]
        kind = RunConfig.GROUPS.get(group)
        if kind is not None and "." in key:
            allowed = ", ".join(f.name for f in dataclasses.fields(kind))
            return f"unknown config key {key} (in {override}); allowed under {group}: {allowed}"
        return (f"unknown config key or group {key} (in {override}); allowed: "
                f"{', '.join(RunConfig.GROUPS)}, experiment")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{override}: {lines[0] if lines else type(err).__name__}" if override else \
        (lines[0] if lines else type(err).__name__)


def check_command_line(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose conf/ with `overrides` and build every dataclass; ConfigError on bad input.

    A sweep (`-m key=a,b`) is checked value by value. Returns the composition of the first
    value of each sweep, with the hydra node (for hydra.run.dir).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tinylm.train import RunConfig

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(_condense(err, None)) from None
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = []
    for o in parsed:
        if o.is_sweep_override():
            try:
                values = list(o.sweep_string_iterator())
            except Exception:  # e.g. interval(...) for an optimizing sweeper: nothing to list
                continue
            sweeps.append([f"{o.get_key_element()}={v}" for v in values])
    # each sweep value once, next to the first value of the other sweeps
    firsts = [values[0] for values in sweeps]
    candidates = [firsts] + [firsts[:i] + [v] + firsts[i + 1:]
                             for i, values in enumerate(sweeps) for v in values[1:]]
    composed = []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3",
                               job_name="train"):
        for overrides_now in (fixed + extra for extra in candidates):
            try:
                cfg = compose(config_name, overrides_now, return_hydra_config=True)
                RunConfig.from_config({k: v for k, v in cfg.items() if k != "hydra"}, ".")
            except (HydraException, OmegaConfBaseException) as err:
                # name the override to blame: the first one that fails on its own
                culprit = next((o for o in overrides_now if _fails(config_name, o)), None)
                raise ConfigError(_condense(err, culprit)) from None
            composed.append(cfg)
    return composed[0]


def _fails(config_name: str, override: str) -> bool:
    from hydra import compose

    try:
        compose(config_name, [override])
    except Exception:
        return True
    return False


def _share_run_dir_across_ranks(cfg: DictConfig) -> None:
    """Under torchrun, make every rank use rank 0's hydra.run.dir (${now:...} may differ by a
    second between ranks), and keep logs and .hydra/ to rank 0."""
    import torch.distributed as dist

    from tinylm.train import init_distributed

    rank, _, world_size = init_distributed()
    if world_size == 1:
        return
    dirs = [str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)]
    dist.broadcast_object_list(dirs, src=0)
    sys.argv += [f"hydra.run.dir='{dirs[0]}'", f"hydra.sweep.dir='{dirs[1]}'"]
    if rank > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _train(cfg: DictConfig) -> float | None:
    """Turn the composed config into dataclasses and train; the return value feeds sweepers."""
    from hydra.core.hydra_config import HydraConfig

    from tinylm.train import RunConfig, TrainingDiverged, TrainingInterrupted, train

    run_cfg = run_or_exit(PROG, lambda: RunConfig.from_config(
        cfg, HydraConfig.get().runtime.output_dir))
    try:
        metrics = run_or_exit(PROG, lambda: train(run_cfg),
                              errors=(ValueError, FileNotFoundError, TrainingDiverged))
    except TrainingInterrupted as err:
        if err.checkpoint is not None:
            print(f"\n{PROG}: stopped by {signal.Signals(err.signum).name} at step {err.step}; "
                  f"saved {err.checkpoint}\ncontinue with:\n  {PROG} train.resume=true "
                  f"hydra.run.dir={run_cfg.run_dir}", file=sys.stderr)
        sys.exit(128 + err.signum)
    if "checkpoint" in metrics:  # rank 0
        _print_next_steps(metrics, run_cfg)
    return metrics["val_loss"]


def _print_next_steps(metrics: dict, run_cfg) -> None:
    """Where the checkpoints and logs are, and the commands to look at them."""
    run_dir = metrics["run_dir"]
    if not os.path.relpath(run_dir).startswith(".."):  # inside the current directory
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
          f"  tinylm-generate checkpoint={run_dir} 'prompt=\"{run_cfg.train.sample_prompt}\"'\n"
          f"  tensorboard --logdir {run_dir}")


def main() -> None:
    """Console entry: check the command line, then hand it to Hydra."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(sys.argv[1:])
    if not (args.help or args.hydra_help or args.info or args.shell_completion):
        cfg = run_or_exit(PROG, lambda: check_command_line(args.overrides,
                                                           args.config_name or "config"))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _share_run_dir_across_ranks(cfg)
    try:
        _train()
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
