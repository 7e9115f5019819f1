"""tinylm-train: train a model from the command line (Hydra over conf/config.yaml).

    tinylm-train                                        # TinyStories sample, BPE, a few minutes
    tinylm-train experiment=shakespeare_char            # nanoGPT's CPU Shakespeare settings
    tinylm-train model.n_layer=2 train.max_steps=200 hydra.run.dir=runs/small
    tinylm-train train.resume=true hydra.run.dir=runs/small
    tinylm-train -m optim.lr=1e-3,3e-3                  # a sweep: one run directory each
    torchrun --standalone --nproc_per_node=2 scripts/train.py train.max_steps=500
    (options: conf/{model,data,tokenizer,optim,train,experiment}/*.yaml)

Bad input ends the command with one line naming the key, the value and what is allowed, before
any work starts: the command line is composed and every run dataclass built from it first
(check_command_line_or_exit in tinylm/cli/command_line.py), because Hydra's own errors span
several lines.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tinylm.cli import print_what_stdout_can, run_or_exit
from tinylm.config import config_dir
from tinylm.train.threads import wait_passively_if_cores_full

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Hydra, torch and the training modules are imported inside the functions (marked "lazy"): the
# helper process that draws the figures is spawned and imports this module again; without them
# it starts ~0.15 s sooner, and the end of a run waits for its first figure
PROG = "tinylm-train"


def _share_run_dir_across_ranks(cfg: DictConfig) -> None:
    """Under torchrun, make every rank use rank 0's hydra.run.dir (${now:...} may differ by a
    second between ranks), and keep logs and .hydra/ to rank 0."""
    import torch.distributed as dist  # lazy

    from tinylm.train.runtime import init_distributed

    rank, _, world_size = init_distributed()
    if world_size == 1:
        return
    dirs = [str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)]
    dist.broadcast_object_list(dirs, src=0)
    sys.argv += [f"hydra.run.dir='{dirs[0]}'", f"hydra.sweep.dir='{dirs[1]}'"]
    if rank > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def _train(cfg: DictConfig) -> float | None:
    """Hydra's task: turn the composed config into dataclasses and train; the return value
    feeds sweepers."""
    from hydra.core.hydra_config import HydraConfig  # lazy

    from tinylm.checkpoint import CheckpointNotWritten
    from tinylm.train.runtime import TrainingInterrupted
    from tinylm.sources import HubError
    from tinylm.train.trainer import TrainingDiverged, train
    from tinylm.train.run_config import RunConfig

    if not gc.isenabled():  # the first run of this command: its start-up ends here (see main)
        gc.freeze()
        gc.enable()
    run_cfg = run_or_exit(PROG, lambda: RunConfig.from_config(
        cfg, HydraConfig.get().runtime.output_dir))
    try:
        metrics = run_or_exit(PROG, lambda: train(run_cfg),
                              errors=(ValueError, FileNotFoundError, HubError,
                                      TrainingDiverged, CheckpointNotWritten))
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
          f"  tinylm-generate checkpoint={run_dir} 'prompt=\"{run_cfg.train.sample_prompt}\"'\n"
          f"  tensorboard --logdir {run_dir}")


def build_run_config(cfg: DictConfig) -> None:
    """Every dataclass of a run from the composed config: checks every value."""
    from tinylm.cli.command_line import without_hydra  # lazy
    from tinylm.train.run_config import RunConfig

    RunConfig.from_config(without_hydra(cfg), ".")


def main() -> None:
    """Console entry: check the command line, then hand it to Hydra."""
    # The garbage collector walks every object that lives long each time enough new ones pile
    # up, and importing torch and the training modules makes about a million: it stays off
    # while the command starts (0.3 s less to the first step) and comes back on in _train,
    # with what start-up built frozen, left out of its walks from then on.
    gc.disable()
    print_what_stdout_can()
    try:
        import hydra  # lazy

        from tinylm.cli.command_line import check_command_line_or_exit

        # torch loads while the command line is checked: how OpenMP's threads wait is read then
        wait_passively_if_cores_full()
        cfg = check_command_line_or_exit(PROG, "config", build_run_config)
        if cfg is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _share_run_dir_across_ranks(cfg)
        hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir(register=False)),
                                config_name="config")(_train)
        try:
            run_or_exit(PROG, hydra_main, errors=())  # a Ctrl-C while starting: 130
        finally:
            import torch.distributed as dist  # lazy

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    finally:
        gc.enable()  # --help, --cfg and bad input end before _train


if __name__ == "__main__":
    main()
