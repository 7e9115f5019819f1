"""tinylm-train under torchrun: two CPU processes (gloo) share one run directory and one log."""

import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tinylm.checkpoint import load_checkpoint
from tinylm.files import project_root

pytestmark = pytest.mark.slow


def test_two_processes_lower_the_loss_and_rank_0_alone_writes(tmp_path):
    lines = [f"Tom saw a big dog. He ran to {name} and said hello. {name} was happy."
             for name in ("Lily", "Mia", "Sue", "Anna") * 60]
    (tmp_path / "stories.txt").write_text("\n\n".join(lines))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(project_root() / "scripts" / "train.py"), "data=text", "data.files=[stories.txt]",
         "data.cache_dir=cache", "tokenizer.vocab_size=280", "model.n_layer=1", "model.n_head=2",
         "model.n_embd=32", "model.block_size=16", "train.batch_size=8", "train.max_steps=30",
         "train.eval_interval=10", "train.eval_batches=2", "train.checkpoint_interval=10",
         "train.log_interval=1", "train.sample_tokens=0", "train.probe_prompt=''",
         "train.device=cpu", "optim.lr=1e-2", "optim.warmup_steps=5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    # one run directory (rank 0 picked its time stamp for both), one log, one checkpoint series,
    # and the lock file rank 0 held it with (released: its pid file is gone)
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra", ".lock", "checkpoints", "tensorboard", "train.log"]
    assert len(list((run_dir / "tensorboard").iterdir())) == 1
    assert done.stdout.count("Done: 30 steps") == 1
    ckpt = load_checkpoint(run_dir, prefer="last")
    assert ckpt.directory.name == "step-0000030"
    assert ckpt.run_config["train"]["batch_size"] == 8

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]) - 1.0
    val = [e.value for e in events.Scalars("val/loss")]
    assert val[-1] < val[0]
