"""Small builders the test files share: a tiny model, a saved run, a command-line run."""

import contextlib
import os
import socket
import subprocess
import sys

import torch

from tinylm.checkpoint import save_checkpoint
from tinylm.model import ModelConfig, TinyLM


def tiny_model(vocab_size, seed=0, **overrides):
    """An untrained TinyLM in eval mode: 2 layers, 2 heads, n_embd 16, block_size 64 by default."""
    torch.manual_seed(seed)
    values = dict(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=16)
    return TinyLM(ModelConfig(**{**values, **overrides})).eval()


def save_run(run_dir, model, tokenizer):
    """A run directory whose `last` and `best` checkpoint is `model`."""
    save_checkpoint(run_dir, model, tokenizer, {"model": model.config.to_dict()}, step=1,
                    tags=("last", "best"))
    return run_dir


def run_cli(module, *args, cwd, timeout=300):
    """Run `python -m <module> args...` in `cwd`, as a user would from a shell."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tensorboard_server(logdir, log_path, *flags):
    """`tensorboard --logdir logdir` on a free port of 127.0.0.1: yields (process, base URL).

    Its output goes to log_path, a file rather than a pipe: a full pipe would block the server.
    """
    port = free_port()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
