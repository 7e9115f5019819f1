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
import os
import shutil
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig

from tinylm.checkpoint import CheckpointNotWritten
from tinylm.cli import command, run_or_exit, run_schema, run_schemas
from tinylm.corpus import HubError
from tinylm.train.run_config import RunConfig
from tinylm.train.runtime import TrainingInterrupted, init_distributed
from tinylm.train.trainer import TrainingDiverged, train

PROG = "tinylm-train"
HYDRA_FILES = {".hydra", "train.log"}  # what Hydra writes into a run directory before the task


def run_config(values: dict) -> RunConfig:
    """Every dataclass of the run, checked, writing to Hydra's run directory (rank 0's under
    torchrun)."""
    return RunConfig.from_config(values, shared_run_dir(HydraConfig.get().runtime.output_dir))


def remove_what_hydra_wrote() -> None:
    """A run refused before it starts leaves nothing behind: its run directory goes if it holds
    only what Hydra wrote into it, and so do the parents left empty (runs/<date>/), up to the
    current directory."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if run_dir.resolve() != Path.cwd().resolve() and \
            {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)
        cwd = Path.cwd().resolve()
        for parent in run_dir.resolve().parents:
            if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
                break
            parent.rmdir()


def shared_run_dir(output_dir: str) -> str:
    """Under torchrun, rank 0's run directory for every rank: ${now:...} may differ by a second
    between ranks, and a rank's own directory, empty (see main), is removed."""
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
    try:
        metrics = run_or_exit(PROG, lambda: train(cfg), errors=(
            ValueError, FileNotFoundError, HubError, TrainingDiverged, CheckpointNotWritten))
    except TrainingInterrupted as err:
        if err.checkpoint is not None:
            print(f"\n{PROG}: stopped by {signal.Signals(err.signum).name} at step {err.step}; "
                  f"saved {err.checkpoint}\ncontinue with:\n  {PROG} train.resume=true "
                  f"hydra.run.dir={cfg.run_dir}", file=sys.stderr)
        sys.exit(128 + err.signum)
    finally:
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
          f"  tinylm-generate checkpoint={run_dir} 'prompt=\"{cfg.train.sample_prompt}\"'\n"
          f"  tensorboard --logdir {run_dir}")


compose_and_train = command(PROG, "config", run_schema(), run_training, build=run_config,
                            schemas=run_schemas(), groups=("experiment",),
                            refused=remove_what_hydra_wrote)


def main() -> None:
    """Console entry: under torchrun only rank 0 keeps Hydra's logs and .hydra/."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    compose_and_train()


if __name__ == "__main__":
    main()
