"""The configuration of a training run: TrainConfig (conf/train/) and RunConfig (every group
together, and where the run writes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from tinylm.config import ConfigError, at_least, bad, check, choice, to_dataclass
from tinylm.data import DataConfig
from tinylm.device import check_threads_setting
from tinylm.model import ModelConfig
from tinylm.tokenizer import TokenizerConfig
from tinylm.train.optim import OptimConfig
from tinylm.train.runtime import PRECISIONS


@dataclass
class TrainConfig:
    """The training loop, evaluation, logging, checkpoints: conf/train/*.yaml's schema and
    defaults."""

    max_steps: int = 2000  # optimizer steps of the whole run
    batch_size: int = 16  # sequences per micro-batch (per process under torchrun)
    grad_accum_steps: int = 1  # micro-batches whose gradients add up to one optimizer step
    eval_interval: int = 250  # steps between evaluations
    eval_batches: int = 20  # validation batches per evaluation (the same windows each time)
    # steps between checkpoints (tagged last); 0: none on this schedule. Whatever it is, the
    # run also saves one at its end, on Ctrl-C or SIGTERM, and at each evaluation whose val
    # loss is the best so far (tagged best and last)
    checkpoint_interval: int = 250
    log_interval: int = 10  # steps between TensorBoard scalars / progress-bar updates
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (see runtime.resolve_precision)
    compile: bool = False  # torch.compile the model
    resume: bool | str = False  # False | True (this run dir's last checkpoint) | a checkpoint path
    # continued at each evaluation, into TensorBoard; a data=text run that sets none continues
    # its corpus's first words (cli/train.py)
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = 64  # 0: no sample
    probe_prompt: str = "Lily and Tom went to the park. She"  # attention maps; "": none
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores (device.py)

    def __post_init__(self):
        positive = at_least(1)
        check(self, "train", max_steps=positive, batch_size=positive, grad_accum_steps=positive,
              eval_interval=positive, eval_batches=positive, checkpoint_interval=at_least(0),
              log_interval=positive, sample_tokens=at_least(0), precision=choice(*PRECISIONS),
              threads=check_threads_setting)
        if not isinstance(self.resume, bool) and not (isinstance(self.resume, str)
                                                      and self.resume):
            raise bad("train.resume", self.resume,
                      "must be false, true or the path of a checkpoint or run directory")


@dataclass
class RunConfig:
    """One dataclass per config group, and where the run writes."""

    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    GROUPS = {"model": ModelConfig, "data": DataConfig, "tokenizer": TokenizerConfig,
              "optim": OptimConfig, "train": TrainConfig}

    @classmethod
    def from_config(cls, values: dict, run_dir: str | Path) -> RunConfig:
        """Build from plain data with one key per group (a composed config, as a dict)."""
        unknown = sorted(set(values) - set(cls.GROUPS))
        if unknown:
            raise ConfigError(f"unknown config key {', '.join(unknown)}; allowed top-level keys: "
                              f"{', '.join(cls.GROUPS)} (and experiment=<name>)")
        groups = {name: to_dataclass(kind, values.get(name), name)
                  for name, kind in cls.GROUPS.items()}
        return cls(run_dir=str(run_dir), **groups)

    def to_dict(self) -> dict:
        """The run config as plain data (what checkpoints store as config.yaml)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.GROUPS}
