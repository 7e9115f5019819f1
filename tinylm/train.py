"""Training: AdamW with warmup and cosine decay, evaluation, TensorBoard, safe checkpoints, resume.

From the command line (Hydra composes conf/; see tinylm/cli/train.py):

    tinylm-train                                      # TinyStories sample, BPE, a few minutes
    tinylm-train experiment=shakespeare_char          # nanoGPT's CPU Shakespeare settings
    tinylm-train model.n_layer=2 train.max_steps=200 hydra.run.dir=runs/small
    tinylm-train train.resume=true hydra.run.dir=runs/small    # continue where it stopped
    torchrun --standalone --nproc_per_node=2 scripts/train.py  # DistributedDataParallel

From Python, without Hydra:

    from tinylm.train import RunConfig, TrainConfig, train
    metrics = train(RunConfig(run_dir="runs/mine", train=TrainConfig(max_steps=100)))

A run directory holds checkpoints/ (see tinylm/checkpoint.py) and tensorboard/ (scalars, samples,
attention maps, hyperparameters). On CPU a run stopped and resumed reaches bit for bit the
weights and losses of the same run uninterrupted: everything random is saved with the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tinylm.checkpoint import (
    CHECKPOINTS_DIR,
    TOKENIZER_FILE,
    TRAINER_STATE_FILE,
    CheckpointNotWritten,
    NonFiniteWeights,
    load_checkpoint,
    load_trainer_state,
    resolve_checkpoint_dir,
    run_dir_lock,
    save_checkpoint,
)
from tinylm.config import ConfigError, bad, flag, integer, number, one_of, to_dataclass
from tinylm.data import BatchSampler, DataConfig, check_enough_tokens, prepare_data
from tinylm.device import resolve_device
from tinylm.extras import Extras, attention_grid_summaries, layer_head_summaries
from tinylm.model import ModelConfig, TinyLM
from tinylm.threads import ThreadChoice, apply_threads, check_threads_setting, start_sample
from tinylm.tokenizer import TokenizerConfig

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "muon")
TENSORBOARD_DIR = "tensorboard"


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon + AdamW) and its learning-rate schedule; schema of
    conf/optim/*.yaml (defaults: here only)."""

    name: str = "adamw"  # adamw | muon (Muon for the blocks' matrices, AdamW for the rest)
    lr: float = 2e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 1e-4  # where the cosine ends
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # None: train.max_steps
    weight_decay: float = 0.1  # on Linear matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    muon_lr: float = 0.02  # optim=muon: peak learning rate of the matrices (scheduled like lr)
    muon_momentum: float = 0.95  # optim=muon: momentum of the matrices' updates (Nesterov)

    def __post_init__(self):
        one_of("optim.name", self.name, OPTIMIZERS)
        for key in ("lr", "min_lr", "weight_decay", "grad_clip", "muon_lr"):
            number(f"optim.{key}", getattr(self, key), low=0)
        number("optim.muon_momentum", self.muon_momentum, 0, 1, high_open=True)
        if self.min_lr > self.lr:
            raise bad("optim.min_lr", self.min_lr, f"must be <= optim.lr={self.lr}")
        for key in ("beta1", "beta2"):
            number(f"optim.{key}", getattr(self, key), 0, 1, high_open=True)
        integer("optim.warmup_steps", self.warmup_steps, least=0)
        integer("optim.lr_decay_steps", self.lr_decay_steps, least=1, null="for train.max_steps")


@dataclass
class TrainConfig:
    """The training loop, evaluation, logging, checkpoints.

    The schema of conf/train/*.yaml: each default is written here only.
    """

    max_steps: int = 2000  # the default run: ~5.5 minutes on 2 quiet CPU cores (bf16)
    batch_size: int = 16  # sequences per micro-batch (per process under torchrun)
    grad_accum_steps: int = 1  # micro-batches whose gradients add up to one optimizer step
    eval_interval: int = 250  # steps between evaluations
    eval_batches: int = 20  # validation batches per evaluation (the same windows each time)
    checkpoint_interval: int = 250  # steps between checkpoints; 0: only at evaluations and end
    log_interval: int = 10  # steps between TensorBoard scalars / progress-bar updates
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (see resolve_precision)
    compile: bool = False  # torch.compile the model
    resume: bool | str = False  # False | True (this run dir's last checkpoint) | a checkpoint path
    sample_prompt: str = "Once upon a time"  # continued at each evaluation, into TensorBoard
    sample_tokens: int = 64  # 0: no sample
    probe_prompt: str = "Lily and Tom went to the park. She"  # attention maps; "": none
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores (threads.py)

    def __post_init__(self):
        for key, least in (("max_steps", 1), ("batch_size", 1), ("grad_accum_steps", 1),
                           ("eval_interval", 1), ("eval_batches", 1), ("checkpoint_interval", 0),
                           ("log_interval", 1), ("sample_tokens", 0)):
            integer(f"train.{key}", getattr(self, key), least)
        integer("train.seed", self.seed)
        one_of("train.precision", self.precision, PRECISIONS)
        flag("train.compile", self.compile)
        check_threads_setting("train.threads", self.threads)
        if not isinstance(self.resume, bool) and not (isinstance(self.resume, str)
                                                      and self.resume):
            raise bad("train.resume", self.resume,
                      "must be false, true or the path of a checkpoint or run directory")


@dataclass
class RunConfig:
    """Everything one training run needs: one dataclass per config group, and where to write."""

    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    GROUPS = {"model": ModelConfig, "data": DataConfig, "tokenizer": TokenizerConfig,
              "optim": OptimConfig, "train": TrainConfig}

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | Path) -> RunConfig:
        """Build from a composed config (OmegaConf node or dict with one key per group)."""
        from omegaconf import DictConfig, OmegaConf

        values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        unknown = sorted(set(values) - set(cls.GROUPS))
        if unknown:
            raise ConfigError(f"unknown config key {', '.join(unknown)}; allowed top-level keys: "
                              f"{', '.join(cls.GROUPS)} (and experiment=<name>)")
        groups = {name: to_dataclass(kind, values.get(name, {}), name)
                  for name, kind in cls.GROUPS.items()}
        return cls(run_dir=str(run_dir), **groups)

    def to_dict(self) -> dict:
        """The run config as plain data (what checkpoints store as config.yaml)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.GROUPS}


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run after a checkpoint was saved."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int):
        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        name = signal.Signals(signum).name
        where = f"saved {checkpoint}" if checkpoint else "nothing to save yet"
        super().__init__(f"{name} at step {step}: {where}")


class StoppedAgain(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: stop at once, without a checkpoint (`signum` says which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN or infinite; the last good checkpoint is kept."""


# ----------------------------------------------------------------------------------- pieces


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    decay_steps = optim.lr_decay_steps or max_steps
    if step < optim.warmup_steps:
        # (step + 1) so that the very first step already moves the weights
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    if step >= decay_steps:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_steps - optim.warmup_steps)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the matrices of Linear layers, everything else: embeddings, norms, biases).

    The tied LM head appears once, as the token embedding.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices, others = [], []
    for p in model.parameters():
        (matrices if p.dim() == 2 and id(p) not in embeddings else others).append(p)
    return matrices, others


def configure_optimizer(model: nn.Module, optim: OptimConfig):
    """AdamW with weight decay on Linear matrices only (optim.name=muon: Muon for those
    matrices, see tinylm/muon.py); norms, biases, embeddings are not decayed.

    Decay pulls weights toward 0; for a norm's gain or a bias that is not a sensible prior, and
    the token embedding (shared with the LM head) holds rare tokens that get few gradient updates
    and would shrink toward nothing.
    """
    matrices, others = split_parameters(model)
    if optim.name == "muon":
        from tinylm.muon import muon_with_adamw

        return muon_with_adamw(matrices, others, optim)
    groups = [{"params": matrices, "weight_decay": optim.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    return adamw(groups, optim)


def adamw(groups: list[dict], optim: OptimConfig) -> torch.optim.AdamW:
    """torch's AdamW over `groups` with optim's lr and betas, fused where PyTorch has it."""
    # fused: one kernel for all parameters instead of a dozen passes over them, ~7x faster on
    # a CPU for the default model (3.6 -> 0.5 ms a step), where PyTorch has it (CPU, CUDA)
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for train.precision; `auto` picks the fastest that keeps the loss curve.

    auto: bf16 on CUDA GPUs that have it, else fp16 (with a gradient scaler); on CPUs with bf16
    instructions (AVX512-BF16 or AMX) bf16, which trains tinylm's default model ~1.6x faster than
    fp32 with the same losses; fp32 on other CPUs, where bf16 is emulated and slow.
    """
    if precision == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        cpu = torch.cpu
        fast_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(cpu, "_is_amx_tile_supported", lambda: False)()
        return torch.bfloat16 if device.type == "cpu" and fast_bf16 else torch.float32
    if precision == "fp16" and device.type != "cuda":
        raise bad("train.precision", precision, "fp16 needs CUDA; use bf16 or fp32 on the CPU")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@lru_cache(maxsize=8)
def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """This machine's matmul FLOP/s in `dtype`, measured once per process (well under a second)."""
    n = 4096 if device.type == "cuda" else 1024
    # its own generator: the global RNG (dropout) must not depend on whether this ran
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(device, dtype) for _ in range(2))
    best = math.inf
    for _ in range(4):  # the first product also pays for kernel selection; keep the best
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


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
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), local_rank, dist.get_world_size()


class _StopSignals:
    """Turns the first SIGINT/SIGTERM into a flag the loop checks between steps.

    A second signal interrupts at once (a checkpoint being written stays invisible until
    complete, so even that leaves the last good one readable), except under torchrun: there
    Ctrl-C reaches each worker twice, from the terminal and forwarded by torchrun, and torchrun
    itself kills workers that take too long.
    """

    def __init__(self, abort_on_second: bool = True):
        self.signum: int | None = None
        self.abort_on_second = abort_on_second
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.signum is not None and self.abort_on_second:
            raise StoppedAgain(signum)
        self.signum = self.signum or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals only work there
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------- the run


def _checkpoint_to_resume(cfg: RunConfig) -> Path | None:
    """Which checkpoint train.resume means; refuses to start a fresh run over an old one."""
    run_dir, resume = Path(cfg.run_dir), cfg.train.resume
    checkpoints = run_dir / CHECKPOINTS_DIR
    has_checkpoints = any((checkpoints / tag).exists() for tag in ("last", "best"))
    if resume is False:
        if has_checkpoints:
            raise ConfigError(f"{run_dir} already holds checkpoints ({checkpoints}); continue "
                              f"that run with train.resume=true hydra.run.dir={run_dir}, or "
                              "start a new one in another hydra.run.dir")
        return None
    if resume is True:
        if not has_checkpoints:
            raise ConfigError(f"train.resume=true but {run_dir} holds no checkpoint; point "
                              "hydra.run.dir at the run to continue, or pass "
                              "train.resume=<checkpoint or run dir>")
        return resolve_checkpoint_dir(run_dir, prefer="last")
    try:
        directory = resolve_checkpoint_dir(resume, prefer="last")
    except FileNotFoundError as err:
        raise ConfigError(f"train.resume={resume}: {err}") from None
    if has_checkpoints and not directory.resolve().is_relative_to(run_dir.resolve()):
        raise ConfigError(f"{run_dir} already holds checkpoints of another run; resume "
                          f"{resume} into a new hydra.run.dir")
    return directory


def _check_resume_matches(ckpt, model_cfg: ModelConfig, cfg: RunConfig, tokenizer_file: Path):
    """Refuse a checkpoint of another model shape or tokenizer, saying what differs.

    Dropout is not part of the shape: a run may continue with another dropout.
    """
    saved_tok = ckpt.run_config.get("tokenizer", {})
    differences = [
        f"model.{k}: checkpoint {v!r}, this run {getattr(model_cfg, k)!r}"
        for k, v in dataclasses.asdict(ckpt.config).items()
        if k != "dropout" and getattr(model_cfg, k) != v]
    saved_optimizer = ckpt.run_config.get("optim", {}).get("name", "adamw")
    if saved_optimizer != cfg.optim.name:  # their states do not fit each other
        differences.append(f"optim.name: checkpoint {saved_optimizer!r}, this run "
                           f"{cfg.optim.name!r}")
    differences += [
        f"tokenizer.{k}: checkpoint {saved_tok[k]!r}, this run {v!r}"
        for k, v in dataclasses.asdict(cfg.tokenizer).items() if k in saved_tok
        and saved_tok[k] != v]
    if not differences and (ckpt.directory / TOKENIZER_FILE).read_bytes() != \
            tokenizer_file.read_bytes():
        differences.append(f"tokenizer: {ckpt.directory / TOKENIZER_FILE} differs from this "
                           f"run's {tokenizer_file} (was data.* changed?)")
    if differences:
        raise ConfigError(f"cannot resume from {ckpt.directory}: it does not match this run's "
                          f"config: {'; '.join(differences)}")
    if not (ckpt.directory / TRAINER_STATE_FILE).is_file():
        raise ConfigError(f"cannot resume from {ckpt.directory}: it has no {TRAINER_STATE_FILE}")


def _gather(obj: Any, world_size: int) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _all_reduce(values: list[float], world_size: int, op=None) -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, val_ids: np.ndarray, cfg: TrainConfig, block_size: int,
             device: torch.device, autocast=None, rank: int = 0,
             world_size: int = 1) -> float:
    """Mean loss over cfg.eval_batches batches of windows spread evenly over the val split.

    Evenly spread instead of random: the same windows at every evaluation and in every run,
    whatever the seed, and a closer estimate of the whole split's loss for the same cost.
    """
    n = cfg.eval_batches * cfg.batch_size * world_size
    starts = np.linspace(0, len(val_ids) - block_size - 1, n).round().astype(np.int64)
    autocast = autocast or contextlib.nullcontext()
    model.eval()
    total = 0.0
    for batch in np.array_split(starts[rank::world_size], cfg.eval_batches):  # (B,) each
        windows = torch.from_numpy(val_ids[batch[:, None] + np.arange(block_size + 1)]
                                   .astype(np.int64)).to(device)  # (B, T + 1)
        with autocast:
            total += model(windows[:, :-1], windows[:, 1:], need_logits=False).loss.item()
    model.train()
    return _all_reduce([total / cfg.eval_batches], world_size)[0] / world_size


def _log_sample_and_attention(writer, extras: Extras, model: TinyLM, tokenizer,
                              cfg: TrainConfig, step: int, device: torch.device) -> None:
    """TensorBoard: a continuation of sample_prompt, and every layer's heads on probe_prompt
    (captured here, drawn by the extras' helper while training goes on)."""
    from tinylm.generate import encode_prompt, generate
    from tinylm.inspection import capture_attention
    from tinylm.tensorboard_plugin.summary import write_attention

    model.eval()
    if cfg.sample_tokens:
        ids, _ = encode_prompt(tokenizer, cfg.sample_prompt, model.config.block_size)
        generator = torch.Generator(device=device).manual_seed(cfg.seed)  # the same each time
        out = generate(model, torch.tensor([ids], device=device), cfg.sample_tokens,
                       temperature=0.8, top_k=50, generator=generator,
                       stop_id=tokenizer.eot_id)
        text = tokenizer.decode(out[0].tolist())
        writer.add_text("samples/text", "```\n" + text + "\n```", step)
    if cfg.probe_prompt:
        capture = capture_attention(model, tokenizer, cfg.probe_prompt)
        write_attention(writer, "probe_prompt", capture, step)  # the "tinylm attention" tab
        extras.submit(step, attention_grid_summaries, capture.weights, capture.tokens)
    model.train()


def _log_deciding_attention(extras: Extras, model: TinyLM, name_items: list, step: int) -> None:
    """TensorBoard: each head's attention from the token before the pronoun to the name on the
    shipped agreement items, the layer x head grid in which the carrier head appears (computed
    here, drawn by the extras' helper)."""
    from tinylm.probe import deciding_name_attention

    model.eval()
    grid = deciding_name_attention(model, name_items)
    model.train()
    extras.submit(step, layer_head_summaries, "probe/deciding_attention", grid,
                  f"deciding attention to the name, step {step} ({len(name_items)} items)",
                  "attention")


def _write_hparams(writer, cfg: RunConfig) -> None:
    """The run's hyperparameters for TensorBoard's HPARAMS tab (metrics: the val scalars)."""
    import yaml
    from torch.utils.tensorboard.summary import hparams

    flat = {f"{group}.{key}": value if isinstance(value, int | float | str | bool) else str(value)
            for group, values in cfg.to_dict().items() for key, value in values.items()}
    for summary in hparams(flat, {"val/loss": 0.0, "val/perplexity": 0.0}):
        writer.file_writer.add_summary(summary)
    writer.add_text("config", "```\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False) + "```")


class Trainer:
    """One run's moving parts (model, optimizer, sampler, logs) and the steps that move them.

    Under torchrun every rank builds one; they take the same steps in lockstep, and only rank 0
    writes logs and checkpoints.
    """

    def __init__(self, cfg: RunConfig):
        cpu_sample = start_sample()  # threads=auto: how busy the cores are during start-up
        t = self.t = cfg.train
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.rank, local_rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        self.info = log.info if self.is_main else log.debug
        device = resolve_device(t.device)
        if device.type == "cuda" and self.world_size > 1:
            device = torch.device("cuda", local_rank)
        self.device, self.dtype = device, resolve_precision(t.precision, device)
        resume_from = _checkpoint_to_resume(cfg)

        # Data: rank 0 prepares it (or finds the cache), then the others read the same cache.
        for turn in (True, False):
            if self.is_main == turn:
                prepared = prepare_data(cfg.data, cfg.tokenizer, log=self.info)
            if self.world_size > 1:
                dist.barrier()
        self.tokenizer = prepared.tokenizer
        model_cfg = cfg.model
        if model_cfg.vocab_size is None:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=self.tokenizer.vocab_size)
        elif model_cfg.vocab_size < self.tokenizer.vocab_size:
            raise bad("model.vocab_size", model_cfg.vocab_size, f"the tokenizer has "
                       f"{self.tokenizer.vocab_size} ids; use null or a larger value")
        try:
            check_enough_tokens(prepared, model_cfg.block_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.model_cfg = model_cfg
        self.run_config = dataclasses.replace(cfg, model=model_cfg)
        self.sampler = BatchSampler(prepared.train_path, model_cfg.block_size, t.batch_size,
                                    t.seed, self.rank, self.world_size)
        self.val_ids = np.memmap(prepared.val_path, dtype=prepared.meta["dtype"], mode="r")
        self.tokens_per_step = (t.batch_size * model_cfg.block_size * t.grad_accum_steps
                                * self.world_size)

        self.threads = apply_threads(t.threads, cpu_sample)
        torch.manual_seed(t.seed)
        self.model = TinyLM(model_cfg).to(device)  # the plain module: saved, sampled, probed
        self.optimizer = configure_optimizer(self.model, cfg.optim)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.autocast = torch.autocast(device.type, dtype=self.dtype,
                                       enabled=self.dtype != torch.float32)
        self.step, self.best_val, self.tokens_seen = 0, math.inf, 0
        if resume_from is not None:
            self._resume(resume_from, prepared.directory / TOKENIZER_FILE)

        # What the steps run: compiled and/or wrapped for DDP, sharing the plain module's weights.
        self.forward = torch.compile(self.model) if t.compile else self.model
        if self.world_size > 1:
            self.forward = nn.parallel.DistributedDataParallel(
                self.forward, device_ids=[device.index] if device.type == "cuda" else None)

        self.writer, self.extras, self.name_items = None, None, []
        if self.is_main:
            self.extras = Extras()  # draws the figures in a helper process
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides what an earlier attempt logged after this checkpoint's step
            self.writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR),
                                        purge_step=self.step + 1 if self.step else None)
            if self.step == 0:
                _write_hparams(self.writer, self.run_config)
            from tinylm.probe import shipped_name_items

            # tokenized once: each evaluation then costs one forward pass and one small image
            self.name_items = shipped_name_items(self.tokenizer, model_cfg.block_size)
            # MFU: the FLOPs the model does per token against what the matmuls could do
            self.peak_flops = matmul_peak_flops(device, self.dtype) * self.world_size
            self.info(f"Model: {self.model.num_params() / 1e6:.2f}M parameters "
                      f"({model_cfg.n_layer} layers, {model_cfg.n_head} heads, n_embd "
                      f"{model_cfg.n_embd}, block_size {model_cfg.block_size}, vocab "
                      f"{model_cfg.vocab_size}); {str(self.dtype)[6:]} on {device}"
                      f"{f' x {self.world_size} processes' if self.world_size > 1 else ''}"
                      f"{f', {self.threads.describe()}' if device.type == 'cpu' else ''}; "
                      f"{self.tokens_per_step:,} tokens per step; run dir {self.run_dir}")

    # ---------------------------------------------------------------- checkpoints and resume

    def _resume(self, directory: Path, tokenizer_file: Path) -> None:
        """Load weights and trainer state; on CPU the run then continues bit for bit."""
        ckpt = load_checkpoint(directory, device="cpu")
        _check_resume_matches(ckpt, self.model_cfg, self.cfg, tokenizer_file)
        self.model.load_state_dict(ckpt.model.state_dict())
        state = load_trainer_state(ckpt.trainer_state_path)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"{ckpt.trainer_state_path} does not fit this run's optimizer: "
                             f"{str(err).splitlines()[0]}") from None
        self.step, self.best_val = state["step"], state["best_val_loss"]
        self.tokens_seen = state["tokens_seen"]
        if state["world_size"] == self.world_size:
            self._resume_threads(state.get("threads"))
            self.sampler.load_state_dict(state["sampler"][self.rank])
            torch.set_rng_state(state["rng_cpu"][self.rank])
            if self.device.type == "cuda" and state["rng_cuda"]:
                torch.cuda.set_rng_state(state["rng_cuda"][self.rank], self.device)
        else:  # another data order than an uninterrupted run, but not a replay of the first one
            log.warning(f"resuming with {self.world_size} processes instead of "
                        f"{state['world_size']}: batches continue from a fresh random stream")
            t = self.t
            self.sampler = BatchSampler(self.sampler.path, self.model_cfg.block_size,
                                        t.batch_size, t.seed + self.step, self.rank,
                                        self.world_size)
        self.info(f"Resuming from {ckpt.directory} at step {self.step}")

    def _resume_threads(self, saved: list[int] | None) -> None:
        """threads=auto: the count the run started with (saved in its trainer state), not a new
        choice, so that the resumed steps compute as the first run's did; a number is used as
        it is. A trainer state saved before the count was (no "threads"): this start's choice."""
        if not saved:
            return
        count = int(saved[self.rank])
        if self.t.threads == "auto":
            self.threads = ThreadChoice(count, "resumed run's count")
            torch.set_num_threads(count)
        elif count != self.threads.threads:
            log.warning(f"resuming with train.threads={self.threads.threads}, the checkpoint was "
                        f"trained with {count}: the losses and weights may then differ in the "
                        "last digits from those of an uninterrupted run")

    def save(self, tags: tuple[str, ...]) -> None:
        """Checkpoint the current step (every rank takes part: each hands over its RNG/sampler)."""
        on_cuda = self.device.type == "cuda"
        states = _gather((self.sampler.state_dict(), torch.get_rng_state(),
                          torch.cuda.get_rng_state(self.device) if on_cuda else None,
                          self.threads.threads), self.world_size)
        if not self.is_main:
            return
        trainer_state = {
            "step": self.step, "best_val_loss": self.best_val, "tokens_seen": self.tokens_seen,
            "world_size": self.world_size, "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "sampler": [s[0] for s in states],
            "rng_cpu": [s[1] for s in states], "rng_cuda": [s[2] for s in states] if on_cuda
            else None, "threads": [s[3] for s in states]}
        try:
            save_checkpoint(self.run_dir, self.model, self.tokenizer,
                            self.run_config.to_dict(), self.step, trainer_state, tags)
        except NonFiniteWeights as err:
            raise TrainingDiverged(f"training diverged by step {self.step}: {err}; "
                                   f"{self._last_good()}; try a lower optim.lr (now "
                                   f"{self.cfg.optim.lr}) or train.precision=fp32") from None
        except CheckpointNotWritten as err:
            raise CheckpointNotWritten(f"{err}; {self._last_good()}; make room, then continue "
                                       f"with train.resume=true hydra.run.dir={self.run_dir}"
                                       ) from None

    def _last_good(self) -> str:
        kept = self.last_checkpoint()
        return f"the last good checkpoint is {kept}" if kept else "no checkpoint was saved yet"

    def last_checkpoint(self) -> Path | None:
        last = self.run_dir / CHECKPOINTS_DIR / "last"
        return last.resolve() if self.is_main and last.exists() else None

    # ------------------------------------------------------------------------------ steps

    def train_step(self, stop: _StopSignals) -> tuple[float, float, float, bool]:
        """One optimizer step -> (mean loss, gradient norm, lr, whether any rank must stop)."""
        t = self.t
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        for group in self.optimizer.param_groups:  # Muon's matrices: muon_lr / lr times more
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(t.grad_accum_steps):
            x, y = self.sampler.next_batch(self.device)  # (B, T) each
            # DDP all-reduces the gradients once, after the last micro-batch
            last_micro = micro == t.grad_accum_steps - 1
            sync = contextlib.nullcontext() if self.world_size == 1 or last_micro \
                else self.forward.no_sync()
            with sync:
                with self.autocast:
                    loss = self.forward(x, y, need_logits=False).loss / t.grad_accum_steps
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(),
                                             self.cfg.optim.grad_clip or math.inf).item()
        # one small collective per step: the mean loss, and whether some rank must stop
        loss, stopping = _all_reduce([loss_sum.item(), float(stop.signum is not None)],
                                     self.world_size)
        loss /= self.world_size
        fp16_overflow = self.scaler.is_enabled()  # the scaler skips such steps by itself
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or fp16_overflow):
            raise TrainingDiverged(
                f"training diverged at step {self.step + 1}: "
                + (f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}")
                + f"; {self._last_good()}; try a lower optim.lr (now {self.cfg.optim.lr}) or "
                "train.precision=fp32")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return loss, grad_norm, lr, bool(stopping)

    def evaluate(self) -> float:
        """Validation loss (all ranks), and on rank 0 its scalars, a sample and attention maps."""
        model = self.forward.module if self.world_size > 1 else self.forward  # no DDP sync
        val_loss = evaluate(model, self.val_ids, self.t, self.model_cfg.block_size,
                            self.device, self.autocast, self.rank, self.world_size)
        if self.is_main:
            perplexity = math.exp(min(val_loss, 50.0))
            self.writer.add_scalar("val/loss", val_loss, self.step)
            self.writer.add_scalar("val/perplexity", perplexity, self.step)
            _log_sample_and_attention(self.writer, self.extras, self.model, self.tokenizer,
                                      self.t, self.step, self.device)
            if self.name_items:
                _log_deciding_attention(self.extras, self.model, self.name_items, self.step)
            self.info(f"step {self.step}: val loss {val_loss:.4f}, perplexity {perplexity:.2f}"
                      f"{' (best)' if val_loss < self.best_val else ''}")
        return val_loss

    def log_train(self, loss: float, grad_norm: float, lr: float, tokens_per_s: float) -> None:
        w, step = self.writer, self.step
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        w.add_scalar("train/grad_norm", grad_norm, step)
        w.add_scalar("train/tokens_per_sec", tokens_per_s, step)
        w.add_scalar("train/mfu", self.model.flops_per_token() * tokens_per_s / self.peak_flops,
                     step)

    def close_logs(self, wait: bool = True) -> None:
        """Write the figures still being drawn, then close the TensorBoard files; with
        wait=False, or on Ctrl-C while waiting, drop those figures and say so."""
        if self.writer is None:
            return
        try:
            dropped = self.extras.close(self.writer, wait)
        except KeyboardInterrupt:
            dropped = self.extras.close(self.writer, wait=False)
        if dropped:
            log.warning(f"dropped the figures of {dropped} evaluation(s) still being drawn")
        self.writer.close()
        self.writer = None

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> dict:
        """Train to max_steps, evaluating, logging and checkpointing; returns the final metrics."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        t = self.t
        start_step, start_time, last_saved = self.step, time.perf_counter(), self.step
        train_loss, val_loss, losses = math.nan, None, []
        # tokens/s counts training steps only: evaluations and checkpoints restart the clock
        window_start, window_steps = time.perf_counter(), 0
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not self.is_main, dynamic_ncols=True)
        stop = _StopSignals(abort_on_second=self.world_size == 1)
        try:
            with stop, logging_redirect_tqdm(), bar:
                while self.step < t.max_steps:
                    train_loss, grad_norm, lr, stopping = self.train_step(stop)
                    losses.append(train_loss)
                    window_steps += 1
                    bar.update(1)
                    step, done = self.step, self.step == t.max_steps

                    logging = step % t.log_interval == 0 or done
                    if logging and self.is_main:
                        self.extras.write_finished(self.writer)
                        tokens_per_s = window_steps * self.tokens_per_step / (
                            time.perf_counter() - window_start)
                        mean_loss = sum(losses) / len(losses)
                        bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
                        self.log_train(mean_loss, grad_norm, lr, tokens_per_s)
                    if logging:
                        losses.clear()

                    tags: tuple[str, ...] = ()
                    evaluating = step % t.eval_interval == 0 or done
                    if evaluating:
                        val_loss = self.evaluate()
                        if val_loss < self.best_val:  # the same on every rank (all-reduced)
                            self.best_val, tags = val_loss, ("last", "best")
                    if (t.checkpoint_interval and step % t.checkpoint_interval == 0) or done or \
                            stopping:
                        tags = tags or ("last",)
                    if tags and step != last_saved:
                        self.save(tags)
                        last_saved = step
                    if logging or evaluating or tags:
                        window_start, window_steps = time.perf_counter(), 0
                    if stopping and not done:
                        self.close_logs()
                        # another rank may have been the one signalled
                        raise TrainingInterrupted(stop.signum or signal.SIGTERM,
                                                  self.last_checkpoint(), step)
        except KeyboardInterrupt:  # a second Ctrl-C: out at once
            self.close_logs(wait=False)
            raise
        finally:
            self.close_logs()  # waits for the figures still being drawn

        seconds = time.perf_counter() - start_time
        trained = self.step - start_step
        metrics = {
            "step": self.step, "train_loss": train_loss, "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
            "best_val_loss": self.best_val, "seconds": seconds,
            "tokens_per_sec": trained * self.tokens_per_step / seconds if trained else None,
            "run_dir": str(self.run_dir), "log_dir": str(self.run_dir / TENSORBOARD_DIR)}
        if self.is_main:
            metrics["checkpoint"] = str(resolve_checkpoint_dir(self.run_dir, "last"))
            metrics["best_checkpoint"] = str(resolve_checkpoint_dir(self.run_dir, "best"))
        return metrics


def train(cfg: RunConfig) -> dict:
    """Train a model as `cfg` says; returns the final metrics and where things were written.

    Raises ConfigError for bad input (before any work), RunDirInUse when another process writes
    cfg.run_dir, TrainingInterrupted after Ctrl-C or SIGTERM (a checkpoint saved first),
    TrainingDiverged when the loss or the weights stop being finite, CheckpointNotWritten when
    a checkpoint cannot be written (a full disk). torch's thread count (train.threads) is set
    back to what it was when it returns.
    """
    rank, _, _ = init_distributed()
    threads = torch.get_num_threads()
    # rank 0 writes the run directory; the lock keeps a second run from writing it too
    try:
        with run_dir_lock(cfg.run_dir) if rank == 0 else contextlib.nullcontext():
            return Trainer(cfg).run()
    finally:
        torch.set_num_threads(threads)
