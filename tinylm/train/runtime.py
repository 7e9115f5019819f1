"""Where and how a training process runs: the process group under torchrun, the precision, the
matmul rate (for MFU), and Ctrl-C / SIGTERM turned into a clean stop."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from tinylm.config import ConfigError, bad
from tinylm.device import has_fast_bf16
from tinylm.model import ModelConfig, TinyLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("auto", *DTYPES)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM that stops the process at once (`signum` says which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StoppedAgain(Stopped):
    """A second Ctrl-C or SIGTERM in the training loop: stop at once, without the checkpoint."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the run after a checkpoint was saved."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int):
        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        where = f"saved {checkpoint}" if checkpoint else "nothing to save yet"
        super().__init__(f"{signal.Signals(signum).name} at step {step}: {where}")


class StopSignals:
    """What SIGINT (Ctrl-C) and SIGTERM do in this process (one instance, STOP), installed by a
    command for its whole life.

    Outside `deferring()` the first signal stops at once (Stopped). Inside, the first sets
    `signum`, which the loop checks between steps to save a checkpoint and stop, and a second
    stops at once (StoppedAgain; a checkpoint being written stays invisible until complete),
    except under torchrun, where Ctrl-C reaches each worker twice (from the terminal and from
    torchrun, which kills workers that take too long). Once stopping, later signals are ignored:
    the way out (closing the logs, releasing the lock, the last line) is never cut short.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.aborted = self.deferred = False
        self.abort_on_second = True

    def _handle(self, signum, frame):
        if self.aborted or (self.signum is not None and
                            not (self.deferred and self.abort_on_second)):
            return  # on the way out already
        first, self.signum = self.signum is None, self.signum or signum
        if first and self.deferred:
            return  # the loop saves a checkpoint after this step, then stops
        self.aborted = True
        raise (Stopped if first else StoppedAgain)(signum)

    def install(self) -> bool:
        """Handle the signals from now on, afresh; False off the main thread, where Python
        delivers no signals."""
        self.signum, self.aborted = None, False
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        return True

    def ignore(self) -> None:
        """Ignore the signals from now on, at the OS, where this handles them: a command that
        ends is not cut short, not even by Python's own ending, which resets its handlers."""
        if signal.getsignal(signal.SIGINT) == self._handle:
            for signum in self.SIGNALS:
                signal.signal(signum, signal.SIG_IGN)

    @contextlib.contextmanager
    def deferring(self, abort_on_second: bool = True) -> Iterator[StopSignals]:
        """The training loop's stretch; where no command installed the handlers (train() called
        as a library), they are installed for this stretch only."""
        previous = {signum: signal.getsignal(signum) for signum in self.SIGNALS}
        ours = previous[signal.SIGINT] == self._handle
        installed = self.install() and not ours
        self.deferred, self.abort_on_second = True, abort_on_second
        try:
            yield self
        finally:
            self.deferred = False
            for signum, handler in previous.items() if installed else ():
                signal.signal(signum, handler)


STOP = StopSignals()


# ------------------------------------------------------------------------------- torchrun


def init_distributed() -> tuple[int, int, int]:
    """(rank, local_rank, world_size); under torchrun, joins the process group (once)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 0, 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        # gloo for CPU tensors, NCCL for CUDA tensors: one group serves either device
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), local_rank, dist.get_world_size()


def gather(obj: Any, world_size: int) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce(values: list[float], world_size: int) -> list[float]:
    """The sum of `values` over all ranks, on every rank."""
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


# ------------------------------------------------------------------------------ precision


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for train.precision; `auto`: bf16 where the hardware has it, else fp16
    on CUDA (with a gradient scaler) and fp32 on a CPU, where bf16 is emulated and slow."""
    if precision == "auto":
        if has_fast_bf16(device):
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    if precision == "fp16" and device.type != "cuda":
        raise bad("train.precision", precision, "fp16 needs CUDA; use bf16 or fp32 on the CPU")
    return DTYPES[precision]


def mixed_precision(precision: str, device: torch.device
                    ) -> tuple[torch.dtype, torch.autocast, torch.amp.GradScaler]:
    """(dtype, the forward passes' autocast, the gradient scaler): the scaler works only in fp16,
    whose small gradients would otherwise round to zero."""
    dtype = resolve_precision(precision, device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    return dtype, autocast, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


@lru_cache(maxsize=8)
def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """This machine's matmul FLOP/s in `dtype`, measured once per process (well under a second)."""
    n = 4096 if device.type == "cuda" else 1024
    # its own generator: the global RNG (dropout) must not depend on whether this ran
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(device, dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    best = math.inf
    for _ in range(4):  # the first product also pays for kernel selection; keep the best
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(model: TinyLM, seq_len: int | None = None) -> float:
    """Training FLOPs per token at context `seq_len` (default block_size): 6 per parameter, plus
    12 per layer, head dim and key for attention's q·kᵀ and weights·v (fwd + bwd), every key
    counted as in the PaLM appendix, so that MFU compares with nanoGPT's."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_embd * (seq_len or c.block_size)


def check_fits_in_memory(model_cfg: ModelConfig, vocab_size: int, batch_size: int,
                         device: torch.device) -> None:
    """Refuse, before anything is allocated, a run that cannot fit in the memory free on `device`.
    A floor: fp32 weights, gradients and one optimizer state (12 bytes a parameter, counted on
    the meta device), and one batch's residual stream per layer and logits."""
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyLM(replace(model_cfg, vocab_size=vocab_size))
                     .parameters())
    T, C = model_cfg.block_size, model_cfg.n_embd
    needed = 12 * params + 4 * batch_size * T * (model_cfg.n_layer * C + vocab_size)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else \
        psutil.virtual_memory().available
    if needed > free:
        raise ConfigError(
            f"the model does not fit in memory: {params:,} parameters (model.n_layer="
            f"{model_cfg.n_layer}, model.n_embd={C}, vocab {vocab_size:,}) and a batch of "
            f"train.batch_size={batch_size} x model.block_size={T} need at least "
            f"{needed / 2**30:,.1f} GiB, but {free / 2**30:,.1f} GiB are free on {device}; "
            "choose a smaller model or batch")
